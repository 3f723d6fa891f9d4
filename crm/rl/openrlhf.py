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
standard library server's queue of 5 reset them), and concurrent requests are scored together on
one worker thread (crm/rl/batching.py; `batch_wait` seconds to gather them), in slices of at most
`slice_chars` characters that take turns between requests: a large request never holds the
scorer for more than a slice.
OpenRLHF scores each sample alone, so strategy `round_robin` (which needs the whole group) is
refused: `reference` (the label's reference answer) for a pairwise CRM, `pointwise` for a
pointwise one. Bad requests get HTTP 400 with {"error": "..."} (bodies over `Limits.body` bytes
413), and every refusal is logged here with its reason: OpenRLHF's client logs only the status.

Hostile or degenerate input (a looping policy emits megabytes) is bounded before any expensive
work (`Limits`): characters per prompt, response and label (CHARS_PER_TOKEN per token of the CRM's
length; a query twice that), samples per request (so that the largest legal request costs a few
seconds of scoring), JSON values and nesting (counted from the bytes before parsing), body bytes;
text that is not Unicode (a lone surrogate) is refused too. A refusal quotes at most about 200
characters of the value at fault, in the answer and in the log. Parsing and sample splitting run
on worker threads, never on the event loop, and take time linear in the input (no pattern
backtracks over a prompt). The connection guards are crm/core/http.py's: a head of at most 16 KiB
and its body each due within `read_timeout` seconds (408 and closed, or closed), an answer the
client does not read dropped after `write_timeout`, an idle kept-alive connection closed after
`keep_alive` seconds, past `connections` open connections 503 at once, and past
`address_connections` from one address 429 at once.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http import HTTPStatus
from typing import NamedTuple

import uvicorn

from crm.core.errors import excerpt
from crm.core.json_shape import JsonShapeError, check_shape
from crm.core.heap import freeze_startup_heap, return_free_memory
from crm.core.http import BodyTooLarge, read_body, send_json, server_config
from crm.inference.reward import CRMReward, CRMRewardError
from crm.rl.batching import MicroBatcher
from crm.rl.labels import parse_label

log = logging.getLogger("crm.rl.openrlhf")
END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "</s>")
_REVERSED_END = re.compile("(?:\\s|%s)*" % "|".join(re.escape(t[::-1]) for t in END_TOKENS))
# A user turn's opening and closing markers: ChatML (Qwen), Llama 3.
USER_TURNS = (("<|im_start|>user\n", "<|im_end|>"),
              ("<|start_header_id|>user<|end_header_id|>\n\n", "<|eot_id|>"))
MAX_BODY = 16 * 2**20
# Samples per request: the largest legal request (every text at --max-chars) costs a few seconds
# of scoring on the reference CPU (docs/RL.md "Limits"); OpenRLHF sends one.
MAX_SAMPLES = 64
# JSON values per sample that a request may hold, counted from the bytes before parsing
# (crm/core/json_shape.py): the format needs about 12, and 2 more per criterion (about 25 fit).
VALUES_PER_SAMPLE = 64
# Characters (summed over a sample's texts) scored in one turn of the scorer: a request's samples
# are scored in slices of at most this, interleaved with other requests' (crm/rl/batching.py), so
# no request holds the scorer for longer than one slice takes (docs/RL.md "Limits").
SLICE_CHARS = 131_072
SLICE_SAMPLES = 512
# Characters a prompt, a response or a label may hold per token of the CRM's length (max_tokens):
# text that many times longer than the CRM reads is degenerate (natural text is 3-5 characters a
# token), and refusing it first keeps megabytes out of the tokenizer.
CHARS_PER_TOKEN = 16
MAX_DEPTH = 8  # JSON nesting; the format needs 4 (body, its lists, a label object, its criteria)
READ_TIMEOUT = 30.0  # seconds for a request's head, and again for its body
KEEP_ALIVE = 5  # seconds an idle kept-alive connection stays open (uvicorn's default)
MAX_CONNECTIONS = 4096  # open connections; past them uvicorn answers 503 (OpenRLHF retries)
WRITE_TIMEOUT = 10.0  # seconds an answer may wait for a client that reads none of it
# The share of the open connections one client address may hold (OpenRLHF's whole rollout batch
# comes from one trainer): the rest stay for the others.
ADDRESS_SHARE = 0.75
# A left-truncated query must still hold this many characters of its prompt's end (the
# generation header: ChatML's "<|im_start|>assistant\n" is 22), so an unrelated query is refused.
MIN_OVERLAP = 16
# Pending connections the kernel queues (capped by net.core.somaxconn): OpenRLHF opens one per
# sample, a rollout batch at once; past the queue the kernel resets them.
LISTEN_QUEUE = 4096
TRIM_AFTER = 2**20  # body bytes past which the freed memory is handed back after the request
MAX_REASON = 1000  # characters of a refusal's reason, in the answer and the log


class RequestError(ValueError):
    """A request the server answers with 400."""


@dataclass(frozen=True)
class Limits:
    """What one request may hold and how long it may take to arrive (docs/RL.md, "OpenRLHF")."""

    chars: int  # per prompt, response and label (its strings summed); a query (both) twice this
    items: int = MAX_SAMPLES  # samples per request
    depth: int = MAX_DEPTH  # JSON nesting
    body: int = MAX_BODY  # bytes
    read_timeout: float = READ_TIMEOUT
    keep_alive: int = KEEP_ALIVE
    connections: int = MAX_CONNECTIONS
    per_address: int | None = None  # open connections per client address; None: ADDRESS_SHARE
    write_timeout: float = WRITE_TIMEOUT
    slice_chars: int = SLICE_CHARS

    @property
    def values(self) -> int:
        """JSON values a request may hold."""
        return VALUES_PER_SAMPLE * self.items + 16

    @property
    def address_connections(self) -> int:
        return self.per_address or max(1, int(ADDRESS_SHARE * self.connections))

    @classmethod
    def of(cls, reward: CRMReward, chars: int | None = None, **kwargs) -> Limits:
        """The limits for `reward`'s CRM: `chars` defaults to CHARS_PER_TOKEN x its max_tokens."""
        return cls(chars or CHARS_PER_TOKEN * reward.scorer.encoder.max_tokens, **kwargs)


def measure(value, max_depth: int) -> int:
    """The characters of `value`'s strings (keys included), walked without recursion; nesting
    deeper than `max_depth` is refused."""
    chars, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            chars += len(item)
        elif isinstance(item, (list, dict)):
            if depth > max_depth:
                raise RequestError(f"JSON nested deeper than {max_depth} levels")
            children = [x for pair in item.items() for x in pair] if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return chars


class Sample(NamedTuple):
    query: str  # the user's query as the CRM reads it
    response: str
    criteria: list[str]
    reference: str | None


def response_after(query: str, prompt: str) -> str | None:
    """The response in `query` (prompt + response), or None when `query` holds no end of `prompt`.

    OpenRLHF cuts an over-long prompt's tokens from the left and decodes what is left, so the query
    may start anywhere inside the prompt (its first character may be a broken byte, U+FFFD). The
    end piece is a prefix of the query no longer than the prompt: the search reads at most that
    much of the query, in time linear in the prompt's length."""
    if query.startswith(prompt):
        return query[len(prompt):]
    text = query.lstrip("\ufffd")
    head = text[:len(prompt)]
    start = prompt.find(head[:MIN_OVERLAP]) if len(head) >= MIN_OVERLAP else -1
    if start < 0:
        return None
    # The earliest occurrence of the query's first characters starts the longest candidate: it
    # is the answer whenever the rest of the prompt follows (OpenRLHF's cut, nearly always).
    if head.startswith(prompt[start:]):
        return text[len(prompt) - start:]
    end = _longest_end_piece(prompt, head)
    return text[end:] if end >= MIN_OVERLAP else None


def _longest_end_piece(prompt: str, head: str) -> int:
    """The length of the longest prefix of `head` that `prompt` ends with (Knuth-Morris-Pratt:
    one pass over each, whatever repeats they hold)."""
    border = [0] * len(head)  # border[i]: the longest proper prefix of head[:i+1] ending it
    k = 0
    for i in range(1, len(head)):
        while k and head[i] != head[k]:
            k = border[k - 1]
        if head[i] == head[k]:
            k += 1
        border[i] = k
    k = 0
    for char in prompt:
        while k and (k == len(head) or char != head[k]):
            k = border[k - 1]
        if k < len(head) and char == head[k]:
            k += 1
    return k


def split_sample(query: str, prompt: str, label, row: int, limits: Limits) -> Sample:
    """One OpenRLHF sample as the CRM reads it, its sizes checked before any other work."""
    if not isinstance(query, str) or not isinstance(prompt, str):
        raise RequestError(f"row {row}: query and prompts must be strings")
    if label is None or (isinstance(label, str) and not label.strip()):
        raise RequestError(f"row {row}: no criteria in the label (it is empty: OpenRLHF sends the "
                           "dataset column --data.label_key names)")
    _check_size(row, "query", query, len(query), 2 * limits.chars)
    _check_size(row, "prompt", prompt, len(prompt), limits.chars)
    _check_size(row, "label", label, measure(label, limits.depth), limits.chars)
    _check_text(row, "query", query)
    _check_text(row, "prompt", prompt)
    response = response_after(query, prompt)
    if response is None:
        raise RequestError(f"row {row}: the query holds neither its prompt nor an end piece of it "
                           f"({MIN_OVERLAP}+ characters) followed by the response")
    _check_size(row, "response", response, len(response), limits.chars)
    try:
        parsed = parse_label(label, row)
    except CRMRewardError as exc:
        raise RequestError(str(exc)) from None
    for name, text in (("label's query", parsed.query), ("reference", parsed.reference),
                       *(("criteria", c) for c in parsed.criteria)):
        if isinstance(text, str):
            _check_text(row, name, text)
    user = parsed.query
    if user is None:
        user = first_user_turn(prompt)
    return Sample(prompt if user is None else user, without_end_tokens(response),
                  parsed.criteria, parsed.reference)


def first_user_turn(prompt: str) -> str | None:
    """The text of `prompt`'s first user turn (ChatML's, else Llama 3's), or None.

    Two find() calls per template, each linear: an opening marker with no closing marker after it
    ends the search, since every later opening lacks one too. (A lazy regex, `(.*?)<|im_end|>`,
    read from every opening to the prompt's end: quadratic in a prompt of repeated openings.)"""
    for opening, closing in USER_TURNS:
        start = prompt.find(opening)
        if start >= 0:
            end = prompt.find(closing, start + len(opening))
            if end >= 0:
                return prompt[start + len(opening):end]
    return None


def without_end_tokens(response: str) -> str:
    """`response` without its trailing end tokens and the whitespace around them, matched once
    from the end: on the reversed text a greedy match anchored at its start never backtracks
    over the text (cutting a copy per token was quadratic in a response of end tokens)."""
    tail = _REVERSED_END.match(response[::-1])
    return response[:len(response) - tail.end()].strip()


def _check_text(row: int, what: str, text: str) -> None:
    """Text the tokenizer and the caches' hashes can read: valid Unicode (JSON's \\ud800 escape
    gives a lone surrogate, which no encoder takes)."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise RequestError(f"row {row}: the {what} holds a lone surrogate at character "
                               f"{exc.start} (not Unicode text)") from None


def _check_size(row: int, what: str, value, size: int, most: int) -> None:
    if size > most:
        raise RequestError(f"row {row}: the {what} holds {size} characters; at most {most} "
                           f"({CHARS_PER_TOKEN} per token the CRM reads; --max-chars raises it): "
                           f"{excerpt(value)}")


def parse_body(body: bytes, strategy: str, limits: Limits) -> list[Sample]:
    """The samples of one request body as bytes; bad input: RequestError. The body's shape is
    bounded before it is parsed (crm/core/json_shape.py): json.loads holds the GIL throughout, and
    16 MiB of `[],[],...` would cost it seconds and the process hundreds of megabytes."""
    try:
        check_shape(body or b"null", limits.depth, limits.values)
    except JsonShapeError as exc:
        raise RequestError(f"{exc} (at most {limits.depth} levels and {VALUES_PER_SAMPLE} values "
                           f"a sample: {limits.values} for --max-samples {limits.items})") from None
    try:
        data = json.loads(body or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RequestError(f"not JSON: {exc}") from None
    except RecursionError:
        raise RequestError(f"JSON nested deeper than {limits.depth} levels") from None
    except ValueError as exc:  # e.g. a number past Python's digit limit
        raise RequestError(f"not JSON this server reads: {excerpt(str(exc))}") from None
    return samples_of(data, strategy, limits)


def samples_of(body, strategy: str, limits: Limits) -> list[Sample]:
    """The samples of one request body (the format of the module doc); bad input: RequestError."""
    if not isinstance(body, dict) or not all(isinstance(body.get(k), list)
                                             for k in ("query", "prompts", "labels")):
        raise RequestError('expected {"query": [...], "prompts": [...], "labels": [...]} (lists)')
    queries, prompts, labels = body["query"], body["prompts"], body["labels"]
    if not len(queries) == len(prompts) == len(labels):
        raise RequestError(f"{len(queries)} queries, {len(prompts)} prompts, {len(labels)} labels")
    if len(queries) > limits.items:
        raise RequestError(f"{len(queries)} samples in one request; at most {limits.items} "
                           "(--max-samples)")
    samples = [split_sample(q, p, lab, i, limits)
               for i, (q, p, lab) in enumerate(zip(queries, prompts, labels))]
    missing = [i for i, s in enumerate(samples) if s.reference is None]
    if strategy == "reference" and missing:
        raise RequestError(f"rows {missing[:5]}: strategy 'reference' needs a reference answer: "
                           'the label\'s "reference" key ({"criteria": [...], "reference": "..."})')
    return samples


def check(reward: CRMReward, samples: list[Sample]) -> None:
    """The reward's own checks of every sample (the criteria and query fit the CRM, ...), rows
    named as in the request: run on the scorer's thread (its tokenizer is that thread's) before a
    request of several samples is scored in slices, so that one refused for its last sample costs
    no forward and its error names the right row."""
    reward.rows([s.query for s in samples], [s.response for s in samples],
                {reward.criteria_column: [s.criteria for s in samples]})


def score(reward: CRMReward, samples: list[Sample]) -> list[float]:
    if not samples:
        return []
    columns = {"criteria": [s.criteria for s in samples]}
    if reward.strategy == "reference":
        columns["reference"] = [s.reference for s in samples]
    return reward([s.query for s in samples], [s.response for s in samples], **columns)


def answer(values: list[float]) -> dict:
    return {"rewards": values, "scores": values, "extra_logs": {"crm_reward": values}}


def sample_chars(sample: Sample) -> int:
    """What a sample costs the scorer, roughly: its characters."""
    return (len(sample.query) + len(sample.response) + len(sample.reference or "")
            + sum(len(c) for c in sample.criteria if isinstance(c, str)))


class RewardApp:
    """The ASGI application: POST a request body (any path, as OpenRLHF's URL says), get rewards."""

    def __init__(self, reward: CRMReward, batch_wait: float = 0.01, limits: Limits | None = None):
        self.reward, self.limits = reward, limits or Limits.of(reward)
        self.batcher = MicroBatcher(lambda samples: score(reward, samples), batch_wait,
                                    SLICE_SAMPLES, self.limits.slice_chars, sample_chars)
        # Parsing and splitting off the event loop, on threads of their own: a large request is
        # never parsed behind a scoring, nor makes the loop wait.
        self.parser = ThreadPoolExecutor(2, thread_name_prefix="crm-parse")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        client = "%s:%s" % tuple(scope.get("client") or ("?", "?"))
        if scope["method"] != "POST":
            return await self._refuse(send, client, HTTPStatus.METHOD_NOT_ALLOWED,
                                      f"{scope['method']}: POST the request body")
        try:
            body = await read_body(receive, self.limits.body, self.limits.read_timeout)
        except TimeoutError:
            return await self._refuse(send, client, HTTPStatus.REQUEST_TIMEOUT, "the body did not "
                                      f"arrive within {self.limits.read_timeout:g} s")
        except BodyTooLarge as exc:
            return await self._refuse(send, client, HTTPStatus.REQUEST_ENTITY_TOO_LARGE, str(exc))
        size, loop = len(body), asyncio.get_running_loop()
        try:
            await self._answer(send, client, body)
        finally:
            if size >= TRIM_AFTER:  # what its parse and its slices freed, back to the system
                await loop.run_in_executor(self.parser, return_free_memory)

    async def _answer(self, send, client: str, body: bytes) -> None:
        try:
            loop = asyncio.get_running_loop()
            samples = await loop.run_in_executor(
                self.parser, parse_body, body, self.reward.strategy, self.limits)
            if len(samples) > 1:  # one sample is one slice: scored whole or refused whole
                await loop.run_in_executor(self.batcher.executor, check, self.reward, samples)
            values = await self.batcher(samples)
        except (RequestError, CRMRewardError) as exc:
            return await self._refuse(send, client, HTTPStatus.BAD_REQUEST, str(exc))
        except Exception as exc:  # the client gets an answer, the log the traceback
            log.exception("scoring failed")
            return await self._refuse(send, client, HTTPStatus.INTERNAL_SERVER_ERROR,
                                      f"internal error ({type(exc).__name__}): the server logged it")
        await send_json(send, HTTPStatus.OK, answer(values))

    async def _refuse(self, send, client: str, status: HTTPStatus, reason: str) -> None:
        """A one-line refusal, logged, its connection closed after it: a client that pipelines
        bad requests (thousands of GETs on one connection) gets one answer, not one each."""
        # Messages quote user input through excerpt(); the cut and the escapes are the last guard
        # (a log handler writing UTF-8 fails on a lone surrogate).
        reason = reason[:MAX_REASON].encode("utf-8", "backslashreplace").decode("utf-8")
        log.warning("%s %d %s", client, status, reason)  # OpenRLHF's client logs only the status
        await send_json(send, status, {"error": reason}, close=True)

    def close(self) -> None:
        self.batcher.close()
        self.parser.shutdown(wait=False)


class RewardServer:
    """uvicorn serving RewardApp on a socket bound at construction (port 0: a free one, `port`)."""

    def __init__(self, app: RewardApp, host: str, port: int):
        self.app = app
        self.socket = socket.create_server((host, port), backlog=LISTEN_QUEUE)
        self.host, self.port = host, self.socket.getsockname()[1]
        limits = app.limits
        self.server = uvicorn.Server(server_config(
            app, read_timeout=limits.read_timeout, keep_alive=limits.keep_alive,
            connections=limits.connections, per_address=limits.address_connections,
            write_timeout=limits.write_timeout, backlog=LISTEN_QUEUE, lifespan="off",
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
        self.app.close()
        self.socket.close()


def make_server(reward: CRMReward, host: str = "127.0.0.1", port: int = 5000,
                batch_wait: float = 0.01, limits: Limits | None = None) -> RewardServer:
    """The server, bound but not serving: serve_forever(), or start() ... close()."""
    if reward.strategy == "round_robin":
        raise CRMRewardError("OpenRLHF scores each sample alone: round_robin needs the whole group; "
                             "use strategy 'reference' (a pairwise CRM) or 'pointwise'")
    return RewardServer(RewardApp(reward, batch_wait, limits), host, port)


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
    parser.add_argument("--max-chars", type=int, default=None,
                        help=f"characters per prompt, response and label (a query: twice); default "
                             f"{CHARS_PER_TOKEN} x the CRM's max_tokens")
    parser.add_argument("--max-samples", type=int, default=MAX_SAMPLES,
                        help="samples per request (OpenRLHF sends one)")
    parser.add_argument("--slice-chars", type=int, default=SLICE_CHARS,
                        help="characters of samples scored in one turn: a request of more is "
                             "scored in turns with the others")
    parser.add_argument("--read-timeout", type=float, default=READ_TIMEOUT,
                        help="seconds a request's head, then its body, may take to arrive")
    parser.add_argument("--max-connections", type=int, default=MAX_CONNECTIONS,
                        help="open connections; past them the server answers 503")
    parser.add_argument("--max-connections-per-address", type=int, default=None,
                        help=f"open connections from one client address; past them 429 (default "
                             f"{ADDRESS_SHARE:.0%} of --max-connections)")
    parser.add_argument("--write-timeout", type=float, default=WRITE_TIMEOUT,
                        help="seconds an answer may wait for a client that reads none of it")
    parser.add_argument("--cache-size", type=int, default=100_000,
                        help="entries of the verdict cache and of the criteria-fit cache (LRU)")
    args = parser.parse_args(argv)
    for flag in ("max_chars", "max_samples", "slice_chars", "read_timeout", "max_connections",
                 "max_connections_per_address", "write_timeout", "cache_size"):
        if getattr(args, flag) is not None and getattr(args, flag) <= 0:
            parser.error(f"--{flag.replace('_', '-')} must be positive")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    import torch

    try:
        from crm.inference.reward import load_crm_scorer

        scorer = load_crm_scorer(args.checkpoint, batch_size=args.batch_size,
                                 device=torch.device(args.device) if args.device else None)
        strategy = args.strategy or ("pointwise" if scorer.kind == "pointwise" else "reference")
        reward = CRMReward(scorer, strategy, tau=args.tau, log_odds=args.log_odds,
                           cache_size=args.cache_size)
        limits = Limits.of(reward, args.max_chars, items=args.max_samples,
                           read_timeout=args.read_timeout, connections=args.max_connections,
                           per_address=args.max_connections_per_address,
                           write_timeout=args.write_timeout, slice_chars=args.slice_chars)
        server = make_server(reward, args.host, args.port, args.batch_wait, limits)
    except (CRMRewardError, OSError) as exc:
        print(f"crm.rl.openrlhf: {exc}", file=sys.stderr)
        return 2
    print(f"crm.rl.openrlhf: {reward.strategy} rewards from {args.checkpoint} on "
          f"{server.url}", flush=True)
    freeze_startup_heap()
    try:
        server.serve_forever()
    except KeyboardInterrupt:  # uvicorn shuts down on Ctrl-C, then raises it again
        pass
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
