"""A CRM as OpenRLHF's remote reward model (`--reward.remote_url http://HOST:PORT/get_reward`).

    python -m crm.rl.openrlhf CHECKPOINT [--port 5000] [--strategy reference]

The format, checked against OpenRLHF's own source (github.com/OpenRLHF/OpenRLHF,
openrlhf/utils/agent.py `SingleTurnAgentExecutor._fetch_rewards_via_http`, and its reference
server openrlhf/cli/serve_rm.py): a POST of

    {"query": [prompt + response, ...], "prompts": [prompt, ...], "labels": [label, ...]}

where `query` is the decoded prompt and response with special tokens kept, and `labels` the
dataset column `--data.label_key` names; the answer is

    {"rewards": [...], "scores": [...], "extra_logs": {"crm_reward": [...]}}

one value per query (OpenRLHF sends one sample per request, many requests at once). The label
holds the criteria (crm/rl/labels.py). The response is `query` after `prompts`, its trailing end
tokens removed. The user's query is the label's `query`, else the first user turn of a ChatML or
Llama-3 prompt, else the prompt as it is.

OpenRLHF scores each sample alone, so strategy `round_robin` (which needs the whole group) is
refused: `reference` (the label's reference answer) for a pairwise CRM, `pointwise` for a pointwise
one. Concurrent requests are scored together in one batch (`batch_wait` seconds to gather them).
Bad requests get HTTP 400 with {"error": "..."}; bodies over `max_body` bytes 413.
"""
from __future__ import annotations

import argparse
import json
import logging
import queue
import re
import sys
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from crm.inference.reward import CRMReward, CRMRewardError
from crm.rl.labels import parse_label

log = logging.getLogger("crm.rl.openrlhf")
END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "</s>")
CHAT_USER = (re.compile(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", re.S),  # ChatML (Qwen)
             re.compile(r"<\|start_header_id\|>user<\|end_header_id\|>\n\n(.*?)<\|eot_id\|>", re.S))
MAX_BODY = 16 * 2**20
MAX_ITEMS = 4096


class RequestError(ValueError):
    """A request the server answers with 400."""


def split_sample(query: str, prompt: str, label, row: int) -> tuple[str, str, list[str], str | None]:
    """(the user's query, the response, criteria, reference) of one OpenRLHF sample."""
    if not isinstance(query, str) or not isinstance(prompt, str):
        raise RequestError(f"row {row}: query and prompts must be strings")
    if not query.startswith(prompt):
        raise RequestError(f"row {row}: query does not start with its prompt")
    response = query[len(prompt):]
    stripped = True
    while stripped:
        stripped = False
        for token in END_TOKENS:
            if response.rstrip().endswith(token):
                response, stripped = response.rstrip()[:-len(token)], True
    parsed = parse_label(label, row)
    user = parsed.query
    if user is None:
        match = next((m for m in (p.search(prompt) for p in CHAT_USER) if m), None)
        user = match.group(1) if match else prompt
    return user, response.strip(), parsed.criteria, parsed.reference


def rewards_for(reward: CRMReward, body: dict) -> dict:
    """The response to one request body (the format of the module doc)."""
    check_shape(body)
    queries, prompts, labels = body["query"], body["prompts"], body["labels"]
    if not len(queries) == len(prompts) == len(labels):
        raise RequestError(f"{len(queries)} queries, {len(prompts)} prompts, {len(labels)} labels")
    if len(queries) > MAX_ITEMS:
        raise RequestError(f"{len(queries)} samples in one request; at most {MAX_ITEMS}")
    samples = [split_sample(q, p, lab, i) for i, (q, p, lab) in enumerate(zip(queries, prompts, labels))]
    if not samples:
        return {"rewards": [], "scores": [], "extra_logs": {"crm_reward": []}}
    columns = {"criteria": [s[2] for s in samples]}
    if reward.strategy == "reference":
        missing = [i for i, s in enumerate(samples) if s[3] is None]
        if missing:
            raise RequestError(f"rows {missing[:5]}: strategy 'reference' needs the label's "
                               "reference answer")
        columns["reference"] = [s[3] for s in samples]
    values = reward([s[0] for s in samples], [s[1] for s in samples], **columns)
    return {"rewards": values, "scores": values, "extra_logs": {"crm_reward": values}}


class Batcher:
    """Scores concurrent requests together: the first request waits `wait` seconds for others,
    then one reward call scores them all and each request gets its own rows back."""

    def __init__(self, reward: CRMReward, wait: float = 0.01, max_rows: int = 256):
        self.reward, self.wait, self.max_rows = reward, wait, max_rows
        self.requests: queue.Queue = queue.Queue()
        threading.Thread(target=self._loop, daemon=True, name="crm-reward-batcher").start()

    def __call__(self, body: dict) -> dict:
        done = threading.Event()
        slot = {"body": body, "done": done}
        self.requests.put(slot)
        done.wait()
        if "error" in slot:
            raise slot["error"]
        return slot["result"]

    def _loop(self) -> None:
        while True:
            batch = [self.requests.get()]
            rows = _rows(batch[0]["body"])
            while rows < self.max_rows:
                try:
                    slot = self.requests.get(timeout=self.wait)
                except queue.Empty:
                    break
                batch.append(slot)
                rows += _rows(slot["body"])
            self._score(batch)

    def _score(self, batch: list[dict]) -> None:
        merged = {"query": [], "prompts": [], "labels": []}
        try:
            for slot in batch:  # each request is checked alone, so a bad one fails alone
                check_shape(slot["body"])
                for key in merged:
                    merged[key].extend(slot["body"][key])
            values = rewards_for(self.reward, merged)["rewards"]
        except (RequestError, CRMRewardError):
            for slot in batch:  # score them one by one: the bad request gets its error
                try:
                    slot["result"] = rewards_for(self.reward, slot["body"])
                except (RequestError, CRMRewardError) as exc:
                    slot["error"] = exc
                slot["done"].set()
            return
        except Exception as exc:  # a crash must reach the waiting requests
            log.exception("scoring failed")
            for slot in batch:
                slot["error"] = exc
                slot["done"].set()
            return
        start = 0
        for slot in batch:
            n = len(slot["body"]["query"])
            part = values[start:start + n]
            start += n
            slot["result"] = {"rewards": part, "scores": part, "extra_logs": {"crm_reward": part}}
            slot["done"].set()


def check_shape(body) -> None:
    if not isinstance(body, dict) or not all(isinstance(body.get(k), list)
                                             for k in ("query", "prompts", "labels")):
        raise RequestError('expected {"query": [...], "prompts": [...], "labels": [...]} (lists)')


def _rows(body) -> int:
    return len(body.get("query") or []) if isinstance(body, dict) else 0


def make_server(reward: CRMReward, host: str = "127.0.0.1", port: int = 5000,
                batch_wait: float = 0.01, max_body: int = MAX_BODY) -> ThreadingHTTPServer:
    """The HTTP server (not started: call serve_forever). POST any path, as OpenRLHF's URL says."""
    if reward.strategy == "round_robin":
        raise CRMRewardError("OpenRLHF scores each sample alone: round_robin needs the whole group; "
                             "use strategy 'reference' (a pairwise CRM) or 'pointwise'")
    batcher = Batcher(reward, batch_wait)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            length = int(self.headers.get("Content-Length") or 0)
            if length > max_body:
                return self._send(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                                  {"error": f"body of {length} bytes; at most {max_body}"})
            try:
                body = json.loads(self.rfile.read(length) or b"null")
                self._send(HTTPStatus.OK, batcher(body))
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                self._send(HTTPStatus.BAD_REQUEST, {"error": f"not JSON: {exc}"})
            except (RequestError, CRMRewardError) as exc:
                self._send(HTTPStatus.BAD_REQUEST, {"error": str(exc)})
            except Exception as exc:  # the client gets an answer
                self._send(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": repr(exc)})

        def _send(self, status: HTTPStatus, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format, *args):
            log.debug("%s " + format, self.address_string(), *args)

    return ThreadingHTTPServer((host, port), Handler)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m crm.rl.openrlhf", description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="an export dir (crm.json) or a checkpoint crm-train wrote")
    parser.add_argument("--host", default="127.0.0.1", help="0.0.0.0 listens on the network")
    parser.add_argument("--port", type=int, default=5000)
    parser.add_argument("--strategy", choices=("reference", "pointwise"), default=None,
                        help="default: pointwise for a pointwise CRM, reference for a pairwise one")
    parser.add_argument("--tau", type=float, default=1.0)
    parser.add_argument("--log-odds", action="store_true", help="unbounded log-odds rewards")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--batch-wait", type=float, default=0.01,
                        help="seconds a request waits for others to share its batch")
    parser.add_argument("--device", default=None, help="cpu | cuda | cuda:1 (default: cuda if visible)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    import torch

    try:
        from crm.inference.reward import load_crm_scorer

        scorer = load_crm_scorer(args.checkpoint, batch_size=args.batch_size,
                                 device=torch.device(args.device) if args.device else None)
        strategy = args.strategy or ("pointwise" if scorer.kind == "pointwise" else "reference")
        reward = CRMReward(scorer, strategy, tau=args.tau, log_odds=args.log_odds)
        server = make_server(reward, args.host, args.port, args.batch_wait)
    except (CRMRewardError, OSError) as exc:
        print(f"crm.rl.openrlhf: {exc}", file=sys.stderr)
        return 2
    print(f"crm.rl.openrlhf: {reward.strategy} rewards from {args.checkpoint} on "
          f"http://{args.host}:{args.port}/get_reward", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
