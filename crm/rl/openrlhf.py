"""A CRM as OpenRLHF's remote reward model (`--reward.remote_url http://HOST:PORT/get_reward`).

    python -m crm.rl.openrlhf CHECKPOINT [--port 5000] [--strategy reference]

The format, checked against openrlhf 0.11.2 (openrlhf/utils/agent.py
`SingleTurnAgentExecutor._fetch_rewards_via_http`, and its reference server
openrlhf/cli/serve_rm.py): a POST of

    {"query": [prompt + response, ...], "prompts": [prompt, ...], "labels": [label, ...]}

where `query` is the decoded prompt and response with special tokens kept, and `labels` the
dataset column `--data.label_key` names; the answer is

    {"rewards": [...], "scores": [...], "extra_logs": {"crm_reward": [...]}}

one value per query. The label holds the criteria (crm/rl/labels.py). The response is `query`
after `prompts`, its trailing end tokens removed; when OpenRLHF cut an over-long prompt from the
left, `query` starts inside the prompt and the response follows the longest end piece of the
prompt it starts with. The user's query is the label's `query`, else the first user turn of a
ChatML or Llama-3 prompt, else the prompt as it is (`prompts` is never truncated).

OpenRLHF sends one sample per request, a whole rollout batch of requests at once, each on a new
connection: uvicorn serves them from one event loop, its listen queue holds thousands (the
standard library server's queue of 5 reset them), and concurrent requests are scored together in
one reward call on one worker thread (crm/rl/batching.py; `batch_wait` seconds to gather them).
OpenRLHF scores each sample alone, so strategy `round_robin` (which needs the whole group) is
refused: `reference` (the label's reference answer) for a pairwise CRM, `pointwise` for a
pointwise one. Bad requests get HTTP 400 with {"error": "..."} (bodies over `max_body` bytes 413),
and every refusal is logged here with its reason: OpenRLHF's client logs only the status.
"""
from __future__ import annotations

import argparse
import json
import logging
import re
import socket
import sys
import threading
import time
from http import HTTPStatus
from typing import NamedTuple

import uvicorn

from crm.inference.reward import CRMReward, CRMRewardError
from crm.rl.batching import MicroBatcher
from crm.rl.labels import parse_label

log = logging.getLogger("crm.rl.openrlhf")
END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "</s>")
CHAT_USER = (re.compile(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", re.S),  # ChatML (Qwen)
             re.compile(r"<\|start_header_id\|>user<\|end_header_id\|>\n\n(.*?)<\|eot_id\|>", re.S))
MAX_BODY = 16 * 2**20
MAX_ITEMS = 4096
# A left-truncated query must still hold this many characters of its prompt's end (the
# generation header: ChatML's "<|im_start|>assistant\n" is 22), so an unrelated query is refused.
MIN_OVERLAP = 16
# Pending connections the kernel queues (capped by net.core.somaxconn): OpenRLHF opens one per
# sample, a rollout batch at once; past the queue the kernel resets them.
LISTEN_QUEUE = 4096


class RequestError(ValueError):
    """A request the server answers with 400."""


class Sample(NamedTuple):
    query: str  # the user's query as the CRM reads it
    response: str
    criteria: list[str]
    reference: str | None


def response_after(query: str, prompt: str) -> str | None:
    """The response in `query` (prompt + response), or None when `query` holds no end of `prompt`.

    OpenRLHF cuts an over-long prompt's tokens from the left and decodes what is left, so the query
    may start anywhere inside the prompt (its first character may be a broken byte, U+FFFD)."""
    if query.startswith(prompt):
        return query[len(prompt):]
    text = query.lstrip("\ufffd")
    tail = prompt[-MIN_OVERLAP:]
    end, at = None, text.find(tail)
    while at >= 0:
        if prompt.endswith(text[:at + len(tail)]):
            end = at + len(tail)  # the last match: the longest end piece of the prompt
        at = text.find(tail, at + 1)
    return None if end is None else text[end:]


def split_sample(query: str, prompt: str, label, row: int) -> Sample:
    """One OpenRLHF sample as the CRM reads it."""
    if not isinstance(query, str) or not isinstance(prompt, str):
        raise RequestError(f"row {row}: query and prompts must be strings")
    if label is None or (isinstance(label, str) and not label.strip()):
        raise RequestError(f"row {row}: no criteria in the label (it is empty: OpenRLHF sends the "
                           "dataset column --data.label_key names)")
    response = response_after(query, prompt)
    if response is None:
        raise RequestError(f"row {row}: the query holds neither its prompt nor an end piece of it "
                           f"({MIN_OVERLAP}+ characters) followed by the response")
    stripped = True
    while stripped:
        stripped = False
        for token in END_TOKENS:
            if response.rstrip().endswith(token):
                response, stripped = response.rstrip()[:-len(token)], True
    try:
        parsed = parse_label(label, row)
    except CRMRewardError as exc:
        raise RequestError(str(exc)) from None
    user = parsed.query
    if user is None:
        match = next((m for m in (p.search(prompt) for p in CHAT_USER) if m), None)
        user = match.group(1) if match else prompt
    return Sample(user, response.strip(), parsed.criteria, parsed.reference)


def samples_of(body, strategy: str) -> list[Sample]:
    """The samples of one request body (the format of the module doc); bad input: RequestError."""
    if not isinstance(body, dict) or not all(isinstance(body.get(k), list)
                                             for k in ("query", "prompts", "labels")):
        raise RequestError('expected {"query": [...], "prompts": [...], "labels": [...]} (lists)')
    queries, prompts, labels = body["query"], body["prompts"], body["labels"]
    if not len(queries) == len(prompts) == len(labels):
        raise RequestError(f"{len(queries)} queries, {len(prompts)} prompts, {len(labels)} labels")
    if len(queries) > MAX_ITEMS:
        raise RequestError(f"{len(queries)} samples in one request; at most {MAX_ITEMS}")
    samples = [split_sample(q, p, lab, i) for i, (q, p, lab) in enumerate(zip(queries, prompts, labels))]
    missing = [i for i, s in enumerate(samples) if s.reference is None]
    if strategy == "reference" and missing:
        raise RequestError(f"rows {missing[:5]}: strategy 'reference' needs a reference answer: "
                           'the label\'s "reference" key ({"criteria": [...], "reference": "..."})')
    return samples


def score(reward: CRMReward, samples: list[Sample]) -> list[float]:
    if not samples:
        return []
    columns = {"criteria": [s.criteria for s in samples]}
    if reward.strategy == "reference":
        columns["reference"] = [s.reference for s in samples]
    return reward([s.query for s in samples], [s.response for s in samples], **columns)


def answer(values: list[float]) -> dict:
    return {"rewards": values, "scores": values, "extra_logs": {"crm_reward": values}}


class RewardApp:
    """The ASGI application: POST a request body (any path, as OpenRLHF's URL says), get rewards."""

    def __init__(self, reward: CRMReward, batch_wait: float = 0.01, max_body: int = MAX_BODY):
        self.reward, self.max_body = reward, max_body
        self.batcher = MicroBatcher(lambda samples: score(reward, samples), batch_wait)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        client = "%s:%s" % tuple(scope.get("client") or ("?", "?"))
        if scope["method"] != "POST":
            return await self._refuse(send, client, HTTPStatus.METHOD_NOT_ALLOWED,
                                      f"{scope['method']}: POST the request body")
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body:
                return await self._refuse(send, client, HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                                          f"body over {self.max_body} bytes")
        try:
            samples = samples_of(json.loads(body or b"null"), self.reward.strategy)
            values = await self.batcher(samples)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return await self._refuse(send, client, HTTPStatus.BAD_REQUEST, f"not JSON: {exc}")
        except (RequestError, CRMRewardError) as exc:
            return await self._refuse(send, client, HTTPStatus.BAD_REQUEST, str(exc))
        except Exception as exc:  # the client gets an answer
            log.exception("scoring failed")
            return await self._refuse(send, client, HTTPStatus.INTERNAL_SERVER_ERROR, repr(exc))
        await self._send(send, HTTPStatus.OK, answer(values))

    async def _refuse(self, send, client: str, status: HTTPStatus, reason: str) -> None:
        log.warning("%s %d %s", client, status, reason)  # OpenRLHF's client logs only the status
        await self._send(send, status, {"error": reason})

    @staticmethod
    async def _send(send, status: HTTPStatus, payload: dict) -> None:
        data = json.dumps(payload).encode()
        await send({"type": "http.response.start", "status": int(status),
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})


class RewardServer:
    """uvicorn serving RewardApp on a socket bound at construction (port 0: a free one, `port`)."""

    def __init__(self, app: RewardApp, host: str, port: int):
        self.app = app
        self.socket = socket.create_server((host, port), backlog=LISTEN_QUEUE)
        self.host, self.port = host, self.socket.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, backlog=LISTEN_QUEUE, lifespan="off",
                                                    access_log=False, log_level="warning"))
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/get_reward"

    def serve_forever(self) -> None:
        """Serve until SIGINT/SIGTERM (in the main thread) or close()."""
        self.server.run(sockets=[self.socket])

    def start(self) -> RewardServer:
        """Serve on a background thread; returns once the server accepts connections."""
        self.thread = threading.Thread(target=self.serve_forever, daemon=True, name="crm-reward-server")
        self.thread.start()
        while not self.server.started and self.thread.is_alive():
            time.sleep(0.01)
        return self

    def close(self) -> None:
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout=30)
        self.app.batcher.close()
        self.socket.close()


def make_server(reward: CRMReward, host: str = "127.0.0.1", port: int = 5000,
                batch_wait: float = 0.01, max_body: int = MAX_BODY) -> RewardServer:
    """The server, bound but not serving: serve_forever(), or start() ... close()."""
    if reward.strategy == "round_robin":
        raise CRMRewardError("OpenRLHF scores each sample alone: round_robin needs the whole group; "
                             "use strategy 'reference' (a pairwise CRM) or 'pointwise'")
    return RewardServer(RewardApp(reward, batch_wait, max_body), host, port)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m crm.rl.openrlhf", description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", help="an export dir (crm.json) or a checkpoint crm-train wrote")
    parser.add_argument("--host", default="127.0.0.1", help="0.0.0.0 listens on the network")
    parser.add_argument("--port", type=int, default=5000, help="0 picks a free port")
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
          f"{server.url}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:  # uvicorn shuts down on Ctrl-C, then raises it again
        pass
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
