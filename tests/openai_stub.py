"""A small OpenAI-compatible server for tests and benchmarks: POST /v1/chat/completions on
127.0.0.1 (an ephemeral port), standard library only.

It reads the vote from the request's user message (the <query>, <response_a> and <response_b>
blocks of data_tools/criteria_prompt.yaml) and answers the criteria `criteria(query, response_a,
response_b)` gives (a_criteria, b_criteria, tie_criteria), by default ones made from the responses'
first words, the tie's from the words both responses hold (none when they share no word). Faults
are scripted per vote: `faults={marker: [kind, ...]}` makes the n-th request of a vote whose query
contains `marker` end as the n-th kind (then "ok"). Kinds:
  429, 500          an HTTP error (the 429 with Retry-After: 0)
  slow              the answer after `slow_seconds` (past the client's timeout)
  drop              the connection closed without a response
  badjson, schema   a 200 whose content is not JSON / is JSON that breaks the schema
  notie             a 200 without tie_criteria (a server or prompt of before tie criteria)
  empty             a 200 with an empty a_criteria list
  ok                the criteria
`answers` counts, per query, the 200 answers that reached the socket; `requests` every request.
With `api_key`, a request without that bearer token gets a 401.

    python tests/openai_stub.py [--latency 0.1]    # serves until killed; prints its base URL
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

BLOCKS = re.compile(r"<query>\n(.*?)\n</query>.*?<response_a>\n(.*?)\n</response_a>.*?"
                    r"<response_b>\n(.*?)\n</response_b>", re.S)
KINDS = ("429", "500", "slow", "drop", "badjson", "schema", "notie", "empty", "ok")
KEYS = {"a_criteria", "b_criteria", "tie_criteria"}


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # the default listen backlog of 5 stalls 32 clients connecting at once

    def handle_error(self, request, client_address):
        # A client that gave up or closed its pooled keep-alive connection is not the stub's fault;
        # socketserver would print its traceback into the test process's stderr.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


def first_words_criteria(query: str, response_a: str,
                         response_b: str) -> tuple[list[str], list[str], list[str]]:
    shared = [w for w in response_a.split() if w in response_b.split()]
    return ([f"Prefers an answer that opens with '{' '.join(response_a.split()[:3])}'"],
            [f"Prefers an answer that opens with '{' '.join(response_b.split()[:3])}'"],
            [f"Wants an answer that says '{' '.join(shared[:3])}'"] if shared else [])


class StubLLM:
    def __init__(self, *, latency: float = 0.0, slow_seconds: float = 2.0, criteria=first_words_criteria,
                 faults: dict[str, list[str]] | None = None, api_key: str | None = None):
        for kinds in (faults or {}).values():
            assert set(kinds) <= set(KINDS), kinds
        self.latency, self.slow_seconds, self.criteria = latency, slow_seconds, criteria
        self.faults, self.api_key = faults or {}, api_key
        self.answers: Counter = Counter()
        self.requests: Counter = Counter()
        self.lock = threading.Lock()
        self.server = _Server(("127.0.0.1", 0), self._handler())
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def start(self) -> "StubLLM":
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> "StubLLM":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _next_kind(self, query: str) -> str:
        with self.lock:
            n = self.requests[query]
            self.requests[query] += 1
        for marker, kinds in self.faults.items():
            if marker in query:
                return kinds[n] if n < len(kinds) else "ok"
        return "ok"

    def _handler(self):
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as the client's connection pool expects
            disable_nagle_algorithm = True  # headers and body are two writes: no 40 ms delayed ACK

            def log_message(self, *args):
                pass

            def _send(self, status: int, body: dict, headers: dict | None = None) -> bool:
                data = json.dumps(body).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    for name, value in (headers or {}).items():
                        self.send_header(name, value)
                    self.end_headers()
                    self.wfile.write(data)
                    self.wfile.flush()
                    return True
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (a timeout)
                    self.close_connection = True
                    return False

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if stub.api_key and self.headers.get("Authorization") != f"Bearer {stub.api_key}":
                    return self._send(401, {"error": {"message": "Incorrect API key provided"}})
                if not self.path.endswith("/chat/completions"):
                    return self._send(404, {"error": {"message": f"no route {self.path}"}})
                user = [m["content"] for m in body["messages"] if m["role"] == "user"][-1]
                blocks = BLOCKS.search(user)
                schema = body.get("response_format", {}).get("json_schema", {}).get("schema", {})
                if not blocks or set(schema.get("required", ())) != KEYS:
                    return self._send(400, {"error": {"message": "expected the criteria prompt and schema"}})
                query, response_a, response_b = blocks.groups()
                kind = stub._next_kind(query)
                time.sleep(stub.latency)
                if kind in ("429", "500"):
                    return self._send(int(kind), {"error": {"message": f"stub {kind}"}},
                                      {"Retry-After": "0"} if kind == "429" else None)
                if kind == "drop":
                    self.close_connection = True
                    return None
                if kind == "slow":
                    time.sleep(stub.slow_seconds)
                a, b, tie = stub.criteria(query, response_a, response_b)
                content = {
                    "badjson": "Sure! Response A is better because it is concise.",
                    "schema": json.dumps({"a_criteria": "concise", "reason": "shorter"}),
                    "notie": json.dumps({"a_criteria": a, "b_criteria": b}),
                    "empty": json.dumps({"a_criteria": [], "b_criteria": b, "tie_criteria": tie}),
                }.get(kind, json.dumps({"a_criteria": a, "b_criteria": b, "tie_criteria": tie}))
                answer = {
                    "id": "chatcmpl-stub", "object": "chat.completion", "created": int(time.time()),
                    "model": body["model"],
                    "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None,
                                 "message": {"role": "assistant", "content": content, "refusal": None}}],
                    "usage": {"prompt_tokens": len(user) // 4, "completion_tokens": len(content) // 4,
                              "total_tokens": len(user) // 4 + len(content) // 4},
                }
                if self._send(200, answer):
                    with stub.lock:
                        stub.answers[query] += 1
                return None

        return Handler


def main() -> None:
    p = argparse.ArgumentParser(description="Serve the stub until killed; print its base URL.")
    p.add_argument("--latency", type=float, default=0.0, help="seconds before each answer")
    args = p.parse_args()
    stub = StubLLM(latency=args.latency)
    print(stub.url, flush=True)
    stub.server.serve_forever()


if __name__ == "__main__":
    main()
