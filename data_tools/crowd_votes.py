"""Human votes in the formats people download, read into `Vote`s (what `crm-data criteria` asks about).

Formats, detected from the first row's columns or named with `--format`:
- `arena-55k` (lmsys/arena-human-preference-55k): `id, model_a, model_b, prompt, response_a,
  response_b, winner_model_a, winner_model_b, winner_tie`; `prompt` and `response_*` are JSON-encoded
  lists of strings, one per turn, whose elements may be null; the winner is one-hot.
- `arena-conversations` (lmsys/chatbot_arena_conversations, lmarena-ai/arena-human-preference-100k
  and -140k): `question_id` or `id`, `conversation_a`, `conversation_b` (message lists, or their JSON
  text; in 140k a message's `content` is a list of parts `{type, text, ...}`), `winner` in
  `model_a | model_b | tie | tie (bothbad) | both_bad`.
- `chosen-rejected` (the Hugging Face preference format): `chosen`, `rejected` as full
  conversations, or as answers (strings or assistant messages) to an explicit `prompt`; optional
  `id`. A row is a vote for `chosen`, which becomes side A.

Files by extension: `.csv`, `.jsonl`/`.json` (JSON Lines), `.parquet`. A null turn becomes an empty
message (the vote stays, and the criteria model sees the empty answer); both ties of the arena
become `tie`. Every row that cannot be a vote is an error naming its line (a Parquet file's row
number), field and reason; a repeated id is an error of the later row.
"""
from __future__ import annotations

import csv
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from crm.core.records import Conversation, RecordError, parse_conversation, parse_line

VOTE_FORMATS = ("arena-55k", "arena-conversations", "chosen-rejected")
ARENA_WINNERS = {"model_a": "model_a", "model_b": "model_b", "tie": "tie", "tie (bothbad)": "tie",
                 "both_bad": "tie"}
ONE_HOT = ("winner_model_a", "winner_model_b", "winner_tie")


@dataclass(frozen=True)
class Vote:
    id: str
    line: int
    winner: str  # model_a | model_b | tie
    model_a: Conversation
    model_b: Conversation

    @property
    def query(self) -> str:
        return self.model_a[0].content


@dataclass(frozen=True)
class VoteRow:
    """One input row: a vote, or the error that kept it from being one (`id` when it was read)."""

    line: int
    vote: Vote | None = None
    error: RecordError | None = None
    id: str | None = None


# ---------------------------------------------------------------------------------------------
# rows of a file: (line, dict) or (line, RecordError)


def _csv_rows(path: Path) -> Iterator[tuple[int, dict | RecordError]]:
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))  # one arena response can pass the 128 KiB default
    with open(path, newline="", encoding="utf-8-sig") as handle:
        reader = csv.DictReader(handle)
        reader.fieldnames  # reads the header: the first row starts after it
        start = reader.line_num + 1
        for row in reader:
            yield start, row
            start = reader.line_num + 1


def _jsonl_rows(path: Path) -> Iterator[tuple[int, dict | RecordError]]:
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                text = raw.decode("utf-8-sig" if number == 1 else "utf-8").strip()
            except UnicodeDecodeError as exc:
                yield number, RecordError(f"not valid UTF-8 (byte {exc.start})")
                continue
            if not text:
                continue
            try:
                row = parse_line(text, lambda obj: obj)
            except RecordError as err:
                yield number, err
                continue
            yield number, row if isinstance(row, dict) else RecordError(
                f"line is {type(row).__name__}, expected a JSON object")


def _parquet_rows(path: Path) -> Iterator[tuple[int, dict | RecordError]]:
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    names = parquet.schema_arrow.names
    fmt = vote_format(names)
    # Only the columns a vote needs: the 140k's full_conversation alone is larger than the rest.
    columns = [c for c in names if c in COLUMNS[fmt]] if fmt else None
    number = 0
    for batch in parquet.iter_batches(batch_size=512, columns=columns):
        for row in batch.to_pylist():
            number += 1
            yield number, row


READERS = {".csv": _csv_rows, ".jsonl": _jsonl_rows, ".json": _jsonl_rows, ".parquet": _parquet_rows}


# ---------------------------------------------------------------------------------------------
# the formats

COLUMNS = {
    "arena-55k": {"id", "prompt", "response_a", "response_b", *ONE_HOT},
    "arena-conversations": {"id", "question_id", "conversation_a", "conversation_b", "winner"},
    "chosen-rejected": {"id", "prompt", "chosen", "rejected"},
}


def vote_format(columns) -> str | None:
    columns = set(columns)
    if {"prompt", "response_a", "response_b"} <= columns:
        return "arena-55k"
    if {"conversation_a", "conversation_b"} <= columns:
        return "arena-conversations"
    if {"chosen", "rejected"} <= columns:
        return "chosen-rejected"
    return None


def _require(row: dict, name: str):
    if row.get(name) is None:
        raise RecordError("missing field" if name not in row else "null", name)
    return row[name]


def _id(row: dict, *names: str) -> str:
    for name in names:
        value = row.get(name)
        if isinstance(value, (str, int)) and not isinstance(value, bool) and str(value).strip():
            return str(value).strip()
    raise RecordError("missing or empty id", names[0])


def _json_value(value, name: str):
    """A list or object stored as JSON text (CSV cells, some Parquet exports) or as itself."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except (json.JSONDecodeError, RecursionError):
            raise RecordError("not JSON", name) from None
    return value


def _turns(value, name: str) -> list[str]:
    """arena-55k: a JSON list of strings, one per turn; a null turn becomes an empty string."""
    turns = _json_value(value, name)
    if not isinstance(turns, list) or not turns:
        raise RecordError("expected a non-empty JSON list of strings, one per turn", name)
    for i, turn in enumerate(turns):
        if turn is not None and not isinstance(turn, str):
            raise RecordError(f"turn {i} is {type(turn).__name__}, expected a string or null", name)
    return ["" if t is None else t for t in turns]


def _one_hot(row: dict) -> str:
    flags = []
    for name in ONE_HOT:
        value = _require(row, name)
        if isinstance(value, str):
            value = value.strip()
        if value in (1, "1", True):
            flags.append(1)
        elif value in (0, "0", False):
            flags.append(0)
        else:
            raise RecordError(f"expected 0 or 1, got {value!r}", name)
    if sum(flags) != 1:
        raise RecordError("not one-hot: " + ", ".join(f"{n}={f}" for n, f in zip(ONE_HOT, flags)),
                          "winner_model_a")
    return ("model_a", "model_b", "tie")[flags.index(1)]


def _arena_55k(row: dict) -> tuple[str, list, list]:
    prompt = _turns(_require(row, "prompt"), "prompt")
    responses = [_turns(_require(row, f"response_{s}"), f"response_{s}") for s in "ab"]
    for side, turns in zip("ab", responses):
        if len(turns) != len(prompt):
            raise RecordError(f"{len(turns)} turns, the prompt has {len(prompt)}", f"response_{side}")
    if not prompt[0].strip():
        raise RecordError("the first turn (the query) is null or empty", "prompt")
    convs = [[m for user, answer in zip(prompt, turns)
              for m in ({"role": "user", "content": user}, {"role": "assistant", "content": answer})]
             for turns in responses]
    return _one_hot(row), *convs


def _text(content, name: str) -> str:
    """A message's content: text, null (an empty message) or a list of text parts (140k)."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise RecordError(f"a {kind or type(part).__name__} part: only text is read", f"{name}[{i}]")
            texts.append(part.get("text") or "")
        return "\n".join(texts)
    raise RecordError(f"expected text or a list of parts, got {type(content).__name__}", name)


def _messages(value, name: str) -> list[dict]:
    messages = _json_value(value, name)
    if not isinstance(messages, list):
        raise RecordError(f"expected a list of messages, got {type(messages).__name__}", name)
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise RecordError(f"message is {type(msg).__name__}, expected an object", f"{name}[{i}]")
        out.append({"role": msg.get("role"), "content": _text(msg.get("content"), f"{name}[{i}].content")})
    return out


def _arena_conversations(row: dict) -> tuple[str, list, list]:
    winner = _require(row, "winner")
    if winner not in ARENA_WINNERS:
        raise RecordError(f"unknown winner {winner!r}, expected one of {', '.join(ARENA_WINNERS)}",
                          "winner")
    return (ARENA_WINNERS[winner], _messages(_require(row, "conversation_a"), "conversation_a"),
            _messages(_require(row, "conversation_b"), "conversation_b"))


def _chosen_rejected(row: dict) -> tuple[str, list, list]:
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        prefix = [{"role": "user", "content": prompt}]
    elif prompt is None:
        prefix = []
    else:
        prefix = _messages(prompt, "prompt")
    convs = []
    for name in ("chosen", "rejected"):
        value = _require(row, name)
        if isinstance(value, str) and prefix:  # an answer to the prompt
            convs.append(prefix + [{"role": "assistant", "content": value}])
            continue
        try:
            convs.append(prefix + _messages(value, name))
        except RecordError:
            if isinstance(value, str):
                raise RecordError("a text answer without a prompt: give `prompt`, or full "
                                  "conversations", name) from None
            raise
    return "model_a", *convs


PARSERS = {"arena-55k": _arena_55k, "arena-conversations": _arena_conversations,
           "chosen-rejected": _chosen_rejected}
ID_FIELDS = {"arena-55k": ("id",), "arena-conversations": ("id", "question_id"),
             "chosen-rejected": ("id",)}


def _vote(row: dict, fmt: str, line: int) -> Vote:
    if fmt == "chosen-rejected" and row.get("id") is None:
        vote_id = f"row-{line}"
    else:
        vote_id = _id(row, *ID_FIELDS[fmt])
    winner, a, b = PARSERS[fmt](row)
    model_a = parse_conversation(a, "model_a")
    model_b = parse_conversation(b, "model_b")
    if model_a[0].content.strip() != model_b[0].content.strip():
        raise RecordError("the two sides answer different queries", "model_b")
    for side, conv in (("model_a", model_a), ("model_b", model_b)):
        for i, m in enumerate(conv):
            try:
                m.content.encode("utf-8")
            except UnicodeEncodeError as exc:  # JSON text can escape a lone surrogate
                raise RecordError(f"not valid Unicode (a lone surrogate at character {exc.start})",
                                  f"{side}[{i}].content") from None
    return Vote(vote_id, line, winner, model_a, model_b)


def read_votes(path: str | Path, fmt: str | None = None) -> Iterator[VoteRow]:
    """Every row of a vote file, as a vote or an error (located at its file and line)."""
    path = Path(path)
    reader = READERS.get(path.suffix.lower())
    if reader is None:
        raise ValueError(f"{path}: unknown extension {path.suffix!r}: votes are read from "
                         f"{', '.join(READERS)} files")
    if fmt is not None and fmt not in VOTE_FORMATS:
        raise ValueError(f"vote format {fmt!r}: expected one of {', '.join(VOTE_FORMATS)}")
    seen: dict[str, int] = {}
    for line, row in reader(path):
        if isinstance(row, RecordError):
            yield VoteRow(line, error=row.at(path, line))
            continue
        if fmt is None:
            fmt = vote_format(row)
            if fmt is None:
                raise ValueError(f"{path}:{line}: columns {sorted(row)} are none of the vote formats "
                                 f"({', '.join(VOTE_FORMATS)}; see `crm-data criteria --help`)")
        try:
            vote = _vote(row, fmt, line)
        except RecordError as err:
            ids = [row[n] for n in ID_FIELDS[fmt] if row.get(n) not in (None, "")]
            yield VoteRow(line, error=err.at(path, line), id=str(ids[0]) if ids else None)
            continue
        if vote.id in seen:
            err = RecordError(f"duplicate id, first at line {seen[vote.id]}", ID_FIELDS[fmt][0])
            yield VoteRow(line, error=err.at(path, line), id=vote.id)
            continue
        seen[vote.id] = line
        yield VoteRow(line, vote=vote, id=vote.id)
