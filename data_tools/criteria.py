"""`crm-data criteria`: for each human vote, an LLM writes the criteria under which each side wins.

Any OpenAI-compatible endpoint (vLLM, SGLang, OpenAI) through the official client (`AsyncOpenAI`).
Each vote is one chat request: the query, then response A, then response B, with a structured
output (a JSON schema) whose properties are `a_criteria`, `b_criteria` and `tie_criteria` (the
criteria on which the two responses are equally good; may be empty).

Run like a batch job that costs money:
- at most `concurrency` requests in flight; 429s, 5xx, timeouts and connection errors are retried
  with exponential backoff (and the server's Retry-After), `max_retries` times, then the vote is
  rejected for this run (a rerun asks again);
- an answer that is not JSON or breaks the schema is asked again, up to `answer_attempts` answers,
  then rejected with the model's raw answer; an empty criteria list is rejected at once;
- every final answer (criteria or an answer reject) is appended, as it arrives, to
  OUT_DIR/answers.jsonl, keyed by (vote id, vote text hash, prompt hash, model): the same command
  after a crash or a kill -9 asks only the votes it has no answer for, and pays for none twice.
Output (rebuilt from the cache at the end of every run): train.jsonl in the training format, each
vote once, in input order, a decisive vote followed by its tie record when the answer named tie
criteria (`write_vote`); rejects.jsonl (the vote's id and line, the stage and reason, the raw
answer when there was one); summary.json (votes read = written + rejected, and the tie records;
this run's requests, retries and tokens). Then `crm-data topics` fills the criteria topics
(data_tools/topics.py).
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import time
from functools import cached_property
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import openai
import yaml
from openai.types.chat import ChatCompletion

from crm.core.files import write_json
from crm.core.records import Conversation
from data_tools.crowd_votes import Vote, read_votes

PROMPT = Path(__file__).with_name("criteria_prompt.yaml")
PLACEHOLDERS = ("{query}", "{response_a}", "{response_b}")
SIDES = ("a_criteria", "b_criteria")
TIE = "tie_criteria"  # criteria on which the two responses are equally good: may be empty
KEYS = (*SIDES, TIE)
SCHEMA = {
    "type": "object",
    "properties": {key: {"type": "array", "items": {"type": "string"}} for key in KEYS},
    "required": list(KEYS),
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema",
                   "json_schema": {"name": "criteria", "strict": True, "schema": SCHEMA}}
ANSWERS, TRAIN, REJECTS, SUMMARY = "answers.jsonl", "train.jsonl", "rejects.jsonl", "summary.json"
ENDPOINT_ERRORS = (401, 403, 404)  # a wrong key, base URL or model: every request would fail
TRANSIENT = (408, 409, 429)  # and 5xx, timeouts, connection errors: retried with backoff
MAX_BACKOFF = 60.0  # seconds
MAX_RETRY_AFTER = 120.0  # a server asking for a longer pause gets this one


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------
# the prompt


@dataclass(frozen=True)
class CriteriaPrompt:
    system: str
    user: str
    path: str

    @classmethod
    def load(cls, path: str | Path = PROMPT) -> "CriteriaPrompt":
        try:
            spec = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except yaml.YAMLError as exc:
            raise ValueError(f"{path}: not YAML: {exc}") from None
        if not isinstance(spec, dict) or not isinstance(spec.get("user"), str) \
                or not isinstance(spec.get("system", ""), str):
            raise ValueError(f"{path}: expected the keys `system` (text) and `user` (text)")
        for placeholder in PLACEHOLDERS:
            if spec["user"].count(placeholder) != 1:
                raise ValueError(f"{path}: `user` must contain {placeholder} exactly once")
        # A prompt that never asks for a key of the schema (one written before tie_criteria) gets
        # answers the model has to guess for it: refused before any request is paid for.
        for key in KEYS:
            if key not in spec.get("system", "") + spec["user"]:
                raise ValueError(f"{path}: the prompt never names {key!r}, a key of the answer's "
                                 f"schema ({', '.join(KEYS)}): ask for it (see {PROMPT})")
        return cls(spec.get("system", "").strip(), spec["user"].strip(), str(path))

    @cached_property  # asked for every vote: the same wording and schema each time
    def hash(self) -> str:
        """What decides an answer besides the vote and the model: the wording and the schema."""
        return _digest({"system": self.system, "user": self.user, "response_format": RESPONSE_FORMAT})

    def messages(self, vote: Vote) -> list[dict]:
        values = {"{query}": vote.query, "{response_a}": render_response(vote.model_a),
                  "{response_b}": render_response(vote.model_b)}
        user = self.user
        # One pass over the template: a vote's text that contains "{response_b}" stays text.
        for placeholder in sorted(PLACEHOLDERS, key=user.index, reverse=True):
            at = user.index(placeholder)
            user = user[:at] + values[placeholder] + user[at + len(placeholder):]
        return ([{"role": "system", "content": self.system}] if self.system else []) + \
            [{"role": "user", "content": user}]


def render_response(conversation: Conversation) -> str:
    """A side's part of the conversation after the query: the answer, or every later turn labelled."""
    rest = conversation[1:]
    if len(rest) == 1:
        return rest[0].content
    return "\n\n".join(f"[{m.role}]\n{m.content}" for m in rest)


# ---------------------------------------------------------------------------------------------
# answers


class AnswerError(ValueError):
    def __init__(self, reason: str, retry: bool = True):
        super().__init__(reason)
        self.reason, self.retry = reason, retry


def read_answer(text: str | None, finish_reason: str | None = None) -> dict[str, list[str]]:
    """{a_criteria, b_criteria, tie_criteria} from the model's answer, or AnswerError (retry=False:
    final). Only tie_criteria may be empty: some pairs differ on everything a user could name."""
    if not text or not text.strip():
        raise AnswerError(f"empty answer (finish_reason={finish_reason})")
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        hint = " (cut at max tokens: raise --max-tokens)" if finish_reason == "length" else ""
        raise AnswerError(f"not JSON: {getattr(exc, 'msg', exc)}{hint}") from None
    if not isinstance(obj, dict) or set(obj) != set(KEYS):
        keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise AnswerError(f"breaks the schema: expected the keys {list(KEYS)}, got {keys}")
    for key in KEYS:
        items = obj[key]
        if not isinstance(items, list) or not all(isinstance(c, str) and c.strip() for c in items):
            raise AnswerError(f"breaks the schema: {key} is not a list of non-blank strings")
    for side in SIDES:
        if not obj[side]:
            raise AnswerError(f"empty {side}", retry=False)
    return obj


def vote_hash(vote: Vote) -> str:
    return _digest([[[m.role, m.content] for m in conv] for conv in (vote.model_a, vote.model_b)])


class AnswerCache:
    """answers.jsonl: one line per final answer, appended and flushed as it arrives.

    A process killed mid-write leaves a torn last line: it is cut off when the cache opens (that
    vote is asked again). Answers of other prompts or models stay in the file, unused.
    """

    def __init__(self, path: Path):
        self.path = path
        self.entries: dict[tuple, dict] = {}
        if path.exists():
            data = path.read_bytes()
            whole = data[:data.rfind(b"\n") + 1]
            if len(whole) != len(data):
                with open(path, "r+b") as handle:
                    handle.truncate(len(whole))
            for number, line in enumerate(whole.decode("utf-8").splitlines(), start=1):
                try:
                    entry = json.loads(line)
                    self.entries[self.key_of(entry)] = entry
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise ValueError(f"{path}:{number}: not an answer line; the cache is damaged "
                                     "(move it away to start over)") from None
        self.handle = open(path, "a", encoding="utf-8")

    @staticmethod
    def key_of(entry: dict) -> tuple:
        return entry["id"], entry["vote_hash"], entry["prompt_hash"], entry["model"]

    def get(self, key: tuple) -> dict | None:
        return self.entries.get(key)

    def add(self, entry: dict) -> None:
        self.entries[self.key_of(entry)] = entry
        self.handle.write(json.dumps(entry, ensure_ascii=False) + "\n")
        self.handle.flush()  # survives a kill of this process; the OS writes it out

    def close(self) -> None:
        self.handle.close()


# ---------------------------------------------------------------------------------------------
# asking


@dataclass(frozen=True)
class AskConfig:
    base_url: str
    model: str
    concurrency: int = 8  # requests in flight
    timeout: float = 120.0  # seconds per request
    max_retries: int = 8  # retries of one request after a 429, 5xx, timeout or connection error
    answer_attempts: int = 3  # answers asked for when one is not JSON or breaks the schema
    backoff: float = 1.0  # seconds before the first retry; doubles each retry, up to MAX_BACKOFF
    max_tokens: int | None = 1024  # per answer (max_completion_tokens); None: the server's limit
    temperature: float | None = None  # None: the server's default

    def __post_init__(self):
        for name, least in (("concurrency", 1), ("answer_attempts", 1), ("max_retries", 0)):
            if getattr(self, name) < least:
                raise ValueError(f"{name}={getattr(self, name)}: expected at least {least}")


class EndpointError(ValueError):
    """The endpoint refuses every request (a wrong key, base URL or model): stop the run."""


@dataclass
class Tally:
    requests: int = 0
    retries: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    done: int = 0
    rejected: int = 0


async def ask(client, vote: Vote, prompt: CriteriaPrompt, cfg: AskConfig, tally: Tally) -> dict:
    """One vote's final outcome: a cache entry (criteria or an answer reject), or, when no answer
    came, {"failed": reason} (not cached: a rerun asks again)."""
    body = {"model": cfg.model, "messages": prompt.messages(vote), "response_format": RESPONSE_FORMAT}
    if cfg.max_tokens is not None:
        body["max_completion_tokens"] = cfg.max_tokens
    if cfg.temperature is not None:
        body["temperature"] = cfg.temperature
    vote_id, vote_digest, prompt_hash, model = _key(vote, prompt, cfg)
    failures, answers = 0, 0
    usage = {"in": 0, "out": 0}
    while True:
        tally.requests += 1
        try:
            # The body of chat.completions.create(**body), posted as it is: create() first walks it
            # against its typed parameters, a large share of the client's CPU per vote
            # (docs/DATA_PIPELINE.md section 2), which caps the rate when cores are busy.
            response = await client.post("/chat/completions", body=body, cast_to=ChatCompletion)
        except openai.APIError as exc:
            status = getattr(exc, "status_code", None)
            if status in ENDPOINT_ERRORS:
                raise EndpointError(f"{cfg.base_url} refused the request ({_describe(exc)}): check "
                                    "OPENAI_API_KEY, --base-url and --model") from None
            if not (isinstance(exc, openai.APIConnectionError) or status in TRANSIENT
                    or (status or 0) >= 500):
                return {"failed": f"request refused: {_describe(exc)}"}  # e.g. 400: this vote only
            failures += 1
            if failures > cfg.max_retries:
                return {"failed": f"no answer after {failures} attempts: {_describe(exc)}"}
            tally.retries += 1
            await asyncio.sleep(_backoff(cfg.backoff, failures, exc))
            continue
        if response.usage is not None:
            usage["in"] += response.usage.prompt_tokens
            usage["out"] += response.usage.completion_tokens
            tally.tokens_in += response.usage.prompt_tokens
            tally.tokens_out += response.usage.completion_tokens
        answers += 1
        choice = response.choices[0] if response.choices else None
        text = choice.message.content if choice else None
        entry = {"id": vote_id, "vote_hash": vote_digest, "prompt_hash": prompt_hash,
                 "model": model, "answer": text, "usage": usage}
        if choice is not None and choice.message.refusal:
            return {**entry, "reject": f"refused: {choice.message.refusal}"}
        try:
            criteria = read_answer(text, choice.finish_reason if choice else None)
        except AnswerError as err:
            if err.retry and answers < cfg.answer_attempts:
                tally.retries += 1
                continue
            reason = err.reason + (f" ({answers} answers)" if err.retry else "")
            return {**entry, "reject": reason}
        return {**entry, **criteria}


def _describe(exc) -> str:
    # a status error's message reads "Error code: 429 - <the server's message>"; a connection
    # error's own reads "Connection error.": the reason (refused, unknown host) is its cause's
    if getattr(exc, "status_code", None):
        return exc.message
    cause, reason = exc, str(exc)
    while (cause := cause.__cause__ or cause.__context__) is not None:  # the innermost: "refused"
        reason = str(cause) or reason
    return f"{type(exc).__name__}: {reason}"


def _backoff(base: float, failures: int, exc) -> float:
    delay = min(MAX_BACKOFF, base * 2 ** (failures - 1)) * random.uniform(0.5, 1.0)  # jitter
    response = getattr(exc, "response", None)
    retry_after = response.headers.get("retry-after") if response is not None else None
    try:
        return max(delay, min(float(retry_after), MAX_RETRY_AFTER)) if retry_after else delay
    except ValueError:  # an HTTP date: the exponential delay will do
        return delay


async def ask_all(votes: list[Vote], prompt: CriteriaPrompt, cfg: AskConfig, cache: AnswerCache,
                  progress=None) -> tuple[Tally, dict[str, str]]:
    """Ask for every vote with `cfg.concurrency` requests in flight; cache each final answer.

    Returns the tally and {vote id: reason} of the votes that got no answer in this run.
    """
    tally, failed = Tally(), {}
    pending = iter(votes)
    # max_retries=0: the retries are ours, counted and following Retry-After. An endpoint without
    # keys (vLLM's default) takes any.
    api_key = os.environ.get("OPENAI_API_KEY") or "none"
    client = openai.AsyncOpenAI(base_url=cfg.base_url, api_key=api_key, timeout=cfg.timeout, max_retries=0)

    async def worker():
        for vote in pending:  # one iterator shared by the workers: each vote is taken once
            outcome = await ask(client, vote, prompt, cfg, tally)
            if "failed" in outcome:
                failed[vote.id] = outcome["failed"]
            else:
                cache.add(outcome)
            tally.done += 1
            if "failed" in outcome or "reject" in outcome:
                tally.rejected += 1
            if progress is not None:
                progress.update(1)
                progress.set_postfix(retries=tally.retries, rejected=tally.rejected,
                                     tok_in=tally.tokens_in, tok_out=tally.tokens_out, refresh=False)

    async with client:
        workers = [asyncio.create_task(worker()) for _ in range(min(cfg.concurrency, len(votes)))]
        try:
            await asyncio.gather(*workers)
        finally:
            for task in workers:  # one worker's EndpointError stops the others
                task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
    return tally, failed


# ---------------------------------------------------------------------------------------------
# the command


def extract(votes_path: str | Path, out_dir: str | Path, cfg: AskConfig, *, fmt: str | None = None,
            prompt_path: str | Path | None = None, progress: bool = True) -> dict:
    """Votes -> OUT_DIR/train.jsonl (without topics), rejects.jsonl, summary.json; the summary."""
    from tqdm import tqdm

    start = time.perf_counter()
    prompt = CriteriaPrompt.load(prompt_path or PROMPT)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cache = AnswerCache(out / ANSWERS)
    try:
        read, todo, cached = 0, [], 0
        for row in read_votes(votes_path, fmt):
            read += 1
            if row.vote is not None:
                if cache.get(_key(row.vote, prompt, cfg)) is None:
                    todo.append(row.vote)
                else:
                    cached += 1
        bar = tqdm(total=len(todo), unit="vote", desc="criteria", disable=not progress or not todo,
                   mininterval=1.0)
        asking = time.perf_counter()
        with bar:
            tally, failed = asyncio.run(ask_all(todo, prompt, cfg, cache, bar))
        asking = time.perf_counter() - asking
        summary = _write_outputs(votes_path, fmt, out, prompt, cfg, cache, failed)
    finally:
        cache.close()
    assert summary["read"] == read
    summary.update(
        cached_before=cached, asked=len(todo), requests=tally.requests, retries=tally.retries,
        tokens_in=tally.tokens_in, tokens_out=tally.tokens_out,
        ask_seconds=round(asking, 3), seconds=round(time.perf_counter() - start, 2))
    return summary


def _key(vote: Vote, prompt: CriteriaPrompt, cfg: AskConfig) -> tuple:
    return vote.id, vote_hash(vote), prompt.hash, cfg.model


def _messages(conversation: Conversation) -> list[dict]:
    return [{"role": m.role, "content": m.content} for m in conversation]


def _write_outputs(votes_path, fmt, out: Path, prompt: CriteriaPrompt, cfg: AskConfig,
                   cache: AnswerCache, failed: dict[str, str]) -> dict:
    """train.jsonl and rejects.jsonl in input order, from the cache; summary.json."""
    counts, reasons, shapes = Counter(), Counter(), Counter()
    train_tmp, rejects_tmp = out / (TRAIN + ".tmp"), out / (REJECTS + ".tmp")
    with open(train_tmp, "w", encoding="utf-8") as train, open(rejects_tmp, "w", encoding="utf-8") as rejects:
        def reject(row_id, line, stage, reason, field="", answer=None):
            counts[f"rejected_{stage}"] += 1
            reasons[stage, reason] += 1
            entry = {"id": row_id, "file": str(votes_path), "line": line, "stage": stage,
                     "field": field, "reason": reason}
            if answer is not None:
                entry["answer"] = answer
            rejects.write(json.dumps(entry, ensure_ascii=False) + "\n")

        for row in read_votes(votes_path, fmt):
            counts["read"] += 1
            if row.error is not None:
                reject(row.id, row.line, "input", row.error.reason, row.error.field)
                continue
            vote = row.vote
            entry = cache.get(_key(vote, prompt, cfg))
            if entry is None:
                reject(vote.id, vote.line, "request", failed.get(vote.id, "not asked"))
                continue
            try:
                if "reject" in entry:
                    raise AnswerError(entry["reject"])
                records = vote_records(vote, entry)
            except AnswerError as err:
                reject(vote.id, vote.line, "answer", err.reason, answer=entry["answer"])
                continue
            counts["written"] += 1
            counts["tie_records"] += len(records) - 1
            for record in records:
                shapes[record["shape"]] += 1
                train.write(json.dumps(record, ensure_ascii=False) + "\n")
    train_tmp.replace(out / TRAIN)
    rejects_tmp.replace(out / REJECTS)
    rejected = {stage: counts[f"rejected_{stage}"] for stage in ("input", "answer", "request")}
    summary = {"votes": str(votes_path), "base_url": cfg.base_url, "model": cfg.model,
               "prompt": prompt.path, "prompt_hash": prompt.hash, "read": counts["read"],
               "written": counts["written"], "rejected": sum(rejected.values()),
               "rejected_by_stage": rejected, "tie_records": counts["tie_records"],
               "shapes": dict(sorted(shapes.items())),
               "top_reasons": [{"stage": stage, "reason": reason, "count": n}
                               for (stage, reason), n in reasons.most_common(5)]}
    assert summary["read"] == summary["written"] + summary["rejected"]
    assert sum(shapes.values()) == summary["written"] + summary["tie_records"]
    return summary


def vote_records(vote: Vote, answer: dict) -> list[dict]:
    """A vote's training records (docs/DATA_PIPELINE.md section 2). A decisive vote: its record
    (each side's criteria, shape decides), then, when the answer named any, a tie record under
    `<id>:tie`: the criteria on which both responses are equally good, on both sides, labelled tie.
    A tie vote: the tie record alone, under the vote's id. Each side's own criteria name what that
    side does better, under which the user's rule gives it the pair, not the tie the voter saw.
    AnswerError when a tie vote's answer names no tie criteria: nothing to label its tie with."""
    pair = {"model_a": _messages(vote.model_a), "model_b": _messages(vote.model_b)}
    tie = answer[TIE]
    tie_record = {"human_winner": "tie", **pair, "a_criteria": tie, "b_criteria": tie, "shape": "tie"}
    if vote.winner == "tie":
        if not tie:
            raise AnswerError(f"a tie vote, but {TIE} is empty: the answer names nothing the two "
                              "responses do equally well, so no criteria hold the tie", retry=False)
        return [{"idx": vote.id, **tie_record}]
    records = [{"idx": vote.id, "human_winner": vote.winner, **pair, "a_criteria": answer["a_criteria"],
                "b_criteria": answer["b_criteria"], "shape": "decides"}]
    if tie:
        records.append({"idx": f"{vote.id}:tie", **tie_record})
    return records


def write_summary(out_dir: str | Path, summary: dict) -> None:
    write_json(Path(out_dir) / SUMMARY, summary)
