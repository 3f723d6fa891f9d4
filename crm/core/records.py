"""The record formats we read (docs/DESIGN.md section 3), parsed into typed records.

Plain Python over text: no torch, so data tools and tests stay fast. Every defect becomes a
`RecordError` that names the file, the line, the field and the reason.
"""
from __future__ import annotations

import ast
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, TypeVar

PREFERENCES = ("model_a", "model_b", "tie")
# What a training record's criteria are (its optional `shape`, docs/DESIGN.md section 3.1):
# "decides": each side's criteria are what that side wins under (the paper's; the default);
# "tie": criteria on which the two answers are equally good (a tie; the same list on both sides);
# "user": criteria written as a user writes them, independent of the pair, labelled by the rule.
SHAPES = ("decides", "tie", "user")
ROLES = ("system", "user", "assistant")
NO_TOPIC = -1  # the topic id of a criterion whose topic is unknown (README-format training records)


@dataclass(frozen=True)
class Message:
    role: str
    content: str


Conversation = tuple[Message, ...]


@dataclass(frozen=True)
class TrainRecord:
    """A human vote between two conversations, with the criteria under which each side wins."""

    human_winner: str
    model_a: Conversation
    model_b: Conversation
    a_criteria: tuple[str, ...]
    b_criteria: tuple[str, ...]
    a_topics: tuple[int, ...]
    b_topics: tuple[int, ...]
    idx: str | None = None
    topic: str | None = None
    # A README-format record (`criteria` + `preference`): only the preferred side's criteria are
    # known. They sit on the preferred side (on both sides for a tie); the other side's are empty.
    one_sided: bool = False
    shape: str = "decides"  # one of SHAPES

    @property
    def query(self) -> str:
        return self.model_a[0].content


@dataclass(frozen=True)
class TestRecord:
    """A pair judged under given criteria; `preference` is the gold label."""

    __test__ = False  # not a pytest test class, despite the name

    idx: str
    prompt: str
    model_a: Conversation
    model_b: Conversation
    criteria: tuple[str, ...]
    preference: str
    topic: str | None = None


@dataclass(frozen=True)
class BenchRecord:
    """A leaderboard query: one response (or conversation) per model."""

    idx: str
    topic: str
    prompt: str
    responses: dict[str, Conversation] = field(hash=False)


class RecordError(ValueError):
    """A defect in one input line; `str()` reads `file:line: field: reason`."""

    def __init__(self, reason: str, field: str = "", path: str = "", line: int = 0):
        self.reason, self.field, self.path, self.line = reason, field, path, line
        super().__init__(self.location() + reason)

    def location(self) -> str:
        where = f"{self.path}:{self.line}: " if self.path else ""
        return where + (f"{self.field}: " if self.field else "")

    def at(self, path: str, line: int) -> "RecordError":
        return RecordError(self.reason, self.field, str(path), line)

    def as_dict(self) -> dict:
        return {"file": self.path, "line": self.line, "field": self.field, "reason": self.reason}


# ---------------------------------------------------------------------------------------------
# field readers: each returns the typed value or raises RecordError naming the field


def _require(obj: dict, name: str):
    if name not in obj:
        raise RecordError("missing field", name)
    return obj[name]


MESSAGES_SHAPE = ('a list of chat messages, [{"role": "user", "content": QUERY}, '
                  '{"role": "assistant", "content": ANSWER}]')


def _maybe_repr_list(value, name: str, expected: str | None = None):
    # The reference stored some lists as Python-repr strings; literal_eval parses literals only.
    # `expected` names what the field holds where plain text is a likely slip (a response's text).
    if isinstance(value, str):
        try:
            value = ast.literal_eval(value)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            # TypeError: a literal that cannot be built, e.g. "{[1]: 2}" (unhashable key)
            reason = f"text, expected {expected}" if expected else "string is not a list literal"
            raise RecordError(reason, name) from None
        if not isinstance(value, list):
            raise RecordError(f"string parses as {type(value).__name__}, expected "
                              f"{expected or 'a list'}", name)
    return value


def _string(value, name: str, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise RecordError(f"expected a string, got {_type(value)}", name)
    if not allow_empty and not value.strip():
        raise RecordError("empty string", name)
    return value


def _ident(value, name: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise RecordError(f"expected a string or integer id, got {_type(value)}", name)
    return str(value)


def _type(value) -> str:
    return "null" if value is None else type(value).__name__


def _criteria(value, name: str) -> tuple[str, ...]:
    value = _maybe_repr_list(value, name)
    if not isinstance(value, list):
        raise RecordError(f"expected a list of strings, got {_type(value)}", name)
    if not value:
        raise RecordError("empty criteria list", name)
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise RecordError(f"criterion {i} is {_type(item)}, expected a string", name)
        if not item.strip():
            raise RecordError(f"criterion {i} is empty", name)
    return tuple(value)


def _topics(value, name: str) -> tuple[int, ...]:
    value = _maybe_repr_list(value, name)
    if not isinstance(value, list):
        raise RecordError(f"expected a list of integer topic ids, got {_type(value)}", name)
    for i, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, int):
            raise RecordError(f"topic {i} is {_type(item)}, expected an integer", name)
    return tuple(value)


def _conversation(value, name: str) -> Conversation:
    value = _maybe_repr_list(value, name, MESSAGES_SHAPE)
    if not isinstance(value, list):
        raise RecordError(f"expected a list of messages, got {_type(value)}", name)
    if not value:
        raise RecordError("empty conversation", name)
    messages = []
    for i, msg in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(msg, dict):
            raise RecordError(f"message is {_type(msg)}, expected an object", where)
        role = msg.get("role")
        if role not in ROLES:
            raise RecordError(f"role {role!r} is not one of {', '.join(ROLES)}", where + ".role")
        if "content" not in msg:
            raise RecordError("message without content", where + ".content")
        messages.append(Message(role, _string(msg["content"], where + ".content", allow_empty=True)))
    if messages[0].role != "user":
        raise RecordError("the first message must be the user's query", f"{name}[0].role")
    if not any(m.role == "assistant" for m in messages):
        raise RecordError("no assistant message", name)
    return tuple(messages)


def parse_conversation(value, name: str) -> Conversation:
    """A chat message list whose first message is the user's query; RecordError naming `name`."""
    return _conversation(value, name)


def _response(value, name: str, query: str) -> Conversation:
    """A benchmark response: plain text (one answer to `query`) or a full conversation."""
    if isinstance(value, str):
        return (Message("user", query), Message("assistant", _string(value, name)))
    return _conversation(value, name)


def _same_query(a: Conversation, b: Conversation) -> None:
    if a[0].content.strip() != b[0].content.strip():
        raise RecordError("first message differs from model_a's query", "model_b[0].content")


# ---------------------------------------------------------------------------------------------
# the three formats


def parse_train(obj, with_topics: bool = True) -> TrainRecord:
    """A training record: the training format, or the README format (see `as_training`).

    Shards keep each input line as it was, so a shard member may be in either format. Each
    criterion has its topic id (the noise transforms draw by topic); `with_topics=False` reads a
    record whose ids are still to come (`crm-data topics`), with none.
    """
    if not isinstance(obj, dict):
        raise RecordError(f"line is {_type(obj)}, expected a JSON object")
    if line_format(obj) == "test":
        return as_training(parse_test(obj))
    winner = _require(obj, "human_winner")
    if winner not in PREFERENCES:
        raise RecordError(f"unknown preference {winner!r}, expected one of {', '.join(PREFERENCES)}",
                          "human_winner")
    model_a = _conversation(_require(obj, "model_a"), "model_a")
    model_b = _conversation(_require(obj, "model_b"), "model_b")
    _same_query(model_a, model_b)
    idx = obj.get("idx")
    topic = obj.get("topic")
    criteria, topics = {}, {}
    for side in "ab":
        criteria[side] = _criteria(_require(obj, f"{side}_criteria"), f"{side}_criteria")
        if not with_topics:
            topics[side] = ()
            continue
        name = f"{side}_broad_criteria_topic"
        if name not in obj:
            raise RecordError("missing field: no topic ids yet (`crm-data topics IN.jsonl OUT.jsonl` "
                              "fills them)", name)
        topics[side] = _topics(obj[name], name)
        if len(topics[side]) != len(criteria[side]):
            raise RecordError(f"{len(topics[side])} topic ids for {len(criteria[side])} criteria: "
                              "one per criterion (`crm-data topics` fills them)", name)
    return TrainRecord(
        human_winner=winner,
        model_a=model_a,
        model_b=model_b,
        a_criteria=criteria["a"],
        b_criteria=criteria["b"],
        a_topics=topics["a"],
        b_topics=topics["b"],
        idx=None if idx is None else _ident(idx, "idx"),
        topic=None if topic is None else _string(topic, "topic"),
        shape=_shape(obj.get("shape"), winner, criteria["a"], criteria["b"]),
    )


def _shape(value, winner: str, a_criteria: tuple, b_criteria: tuple) -> str:
    if value is None:  # absent, or null as other optional fields
        return "decides"
    if value not in SHAPES:
        raise RecordError(f"unknown shape {value!r}, expected one of {', '.join(SHAPES)}", "shape")
    # A tie record says the pair is equal under its criteria: another label, or two lists, would
    # contradict it.
    if value == "tie" and winner != "tie":
        raise RecordError(f"shape 'tie' needs human_winner 'tie', got {winner!r}", "shape")
    if value == "tie" and a_criteria != b_criteria:
        raise RecordError("shape 'tie': b_criteria must equal a_criteria (the criteria on which "
                          "both answers are equally good)", "b_criteria")
    return value


def parse_test(obj) -> TestRecord:
    if not isinstance(obj, dict):
        raise RecordError(f"line is {_type(obj)}, expected a JSON object")
    preference = _require(obj, "preference")
    if preference not in PREFERENCES:
        raise RecordError(
            f"unknown preference {preference!r}, expected one of {', '.join(PREFERENCES)}", "preference")
    model_a = _conversation(_require(obj, "model_a"), "model_a")
    model_b = _conversation(_require(obj, "model_b"), "model_b")
    _same_query(model_a, model_b)
    topic = obj.get("topic")
    return TestRecord(
        idx=_ident(_require(obj, "idx"), "idx"),
        prompt=_string(_require(obj, "prompt"), "prompt"),
        model_a=model_a,
        model_b=model_b,
        criteria=_criteria(_require(obj, "criteria"), "criteria"),
        preference=preference,
        topic=None if topic is None else _string(topic, "topic"),
    )


def as_training(record: TestRecord) -> TrainRecord:
    """A README-format record as training data: its criteria are the preferred side's (a tie's
    criteria are shown with the tie label), and the other side's criteria are unknown. Its shape
    is "tie" for a tie (criteria under which neither answer is preferred, on both sides), else
    "decides"."""
    criteria, topics = record.criteria, (NO_TOPIC,) * len(record.criteria)
    on_a = record.preference in ("model_a", "tie")
    on_b = record.preference in ("model_b", "tie")
    return TrainRecord(
        human_winner=record.preference, model_a=record.model_a, model_b=record.model_b,
        a_criteria=criteria if on_a else (), b_criteria=criteria if on_b else (),
        a_topics=topics if on_a else (), b_topics=topics if on_b else (),
        idx=record.idx, topic=record.topic, one_sided=True,
        shape="tie" if record.preference == "tie" else "decides")


def parse_bench(obj) -> BenchRecord:
    if not isinstance(obj, dict):
        raise RecordError(f"line is {_type(obj)}, expected a JSON object")
    prompt = _string(_require(obj, "prompt"), "prompt")
    responses = _require(obj, "responses")
    if not isinstance(responses, dict):
        raise RecordError(f"expected an object of model name -> response, got {_type(responses)}",
                          "responses")
    if not responses:
        raise RecordError("no responses", "responses")
    return BenchRecord(
        idx=_ident(_require(obj, "idx"), "idx"),
        topic=_string(_require(obj, "topic"), "topic"),
        prompt=prompt,
        responses={name: _response(r, f"responses.{name}", prompt) for name, r in responses.items()},
    )


PARSERS: dict[str, Callable[[object], object]] = {
    "train": parse_train, "test": parse_test, "bench": parse_bench}
FORMATS = tuple(PARSERS)


def line_format(obj) -> str | None:
    """The format that one JSON object's keys name, or None when they name none."""
    if isinstance(obj, dict):
        if "human_winner" in obj or "a_criteria" in obj or "b_criteria" in obj:
            return "train"
        if "responses" in obj:
            return "bench"
        if "preference" in obj or "criteria" in obj:
            return "test"
    return None


def detect_format(obj) -> str:
    """Guess the format of one JSON object from its keys (for commands that take any file)."""
    return line_format(obj) or "train"


# ---------------------------------------------------------------------------------------------
# reading files

R = TypeVar("R")


@dataclass(frozen=True)
class Line:
    """One non-blank input line; `record` is set when it parsed, `error` when it did not."""

    path: str
    number: int
    text: str
    record: object | None = None
    error: RecordError | None = None


def parse_line(text: str, parser: Callable[[object], R]) -> R:
    return parser(_json(text))


def _json(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise RecordError(f"bad JSON: {exc.msg} at column {exc.colno}") from None
    except RecursionError:
        raise RecordError("bad JSON: nested too deeply") from None


def read_lines(path: str | Path, fmt: str | None = None,
               parser: Callable[[object], object] | None = None) -> Iterator[Line]:
    """Every non-blank line of a JSONL file, parsed; a line's defects are yielded, never raised.

    `fmt` is "train", "test" or "bench"; None detects it from the first line whose keys name a
    format. A file holds one format: a line of another format raises a RecordError naming it (one
    misplaced line means the wrong file, not a bad line). `parser` replaces the format's parser
    (for files that are a format in the making, e.g. training records before their topics).
    A missing or unreadable file raises OSError (the caller reports it once).
    """
    path = str(path)
    file_fmt, fixed_by = fmt, "asked for"
    seen_object = False
    # Binary, decoded line by line: a bad byte is a defect of its line, not a crash of the file.
    with open_data(path) as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                text = raw.decode("utf-8-sig" if number == 1 else "utf-8").strip()  # BOM: editors add one
            except UnicodeDecodeError as exc:
                err = RecordError(f"not valid UTF-8 (byte {exc.start})").at(path, number)
                yield Line(path, number, raw.decode("utf-8", "replace").strip(), error=err)
                continue
            if not text:
                continue
            if not seen_object:  # a whole-file JSON document is one error, not a reject a line
                seen_object = True
                not_lines = whole_document(text)
                if not_lines:
                    raise RecordError(not_lines, path=path, line=number)
            try:
                obj = _json(text)
            except RecordError as err:
                yield Line(path, number, text, error=err.at(path, number))
                continue
            kind = line_format(obj)
            if kind and file_fmt is None:
                file_fmt, fixed_by = kind, f"the format of line {number}"
            elif kind and kind != file_fmt and fixed_by == "asked for":
                raise RecordError(f"a {kind}-format record where {file_fmt}-format records are "
                                  f"wanted ({FORMAT_FIELDS[file_fmt]}; docs/DESIGN.md section "
                                  "3.1): this file is not one", path=path, line=number)
            elif kind and kind != file_fmt:
                raise RecordError(f"a {kind}-format record in a {file_fmt}-format file ({fixed_by}): "
                                  "a file holds one format", path=path, line=number)
            try:
                record = (parser or PARSERS[file_fmt or "train"])(obj)
            except RecordError as err:
                yield Line(path, number, text, error=err.at(path, number))
            else:
                yield Line(path, number, text, record=record)


FORMAT_FIELDS = {
    "train": "human_winner, model_a, model_b, a_criteria, b_criteria and their topic ids",
    "test": "the README format: idx, prompt, model_a, model_b, criteria, preference",
    "bench": "idx, topic, prompt, responses"}
GZIP_MAGIC = b"\x1f\x8b"


def open_data(path: str | Path):
    """`path` opened for reading bytes, a gzip file (`.jsonl.gz`, or any file that starts with
    gzip's magic bytes) decompressed as it is read."""
    with open(path, "rb") as probe:
        magic = probe.read(2)
    if magic == GZIP_MAGIC:
        import gzip

        return gzip.open(path, "rb")  # closing it closes the file (a GzipFile over a handle would not)
    return open(path, "rb")


def whole_document(first_line: str) -> str | None:
    """What a file is when its first non-blank line shows one JSON document rather than JSON
    lines (a pretty-printed array or object), with what to do; None for a JSON line."""
    convert = "write one JSON object per line (`jq -c '.[]' FILE > FILE.jsonl` converts an array)"
    if first_line == "[" or (first_line.startswith("[") and _is_array(first_line)):
        return f"a JSON array, not JSON lines: {convert}"
    if first_line == "{":
        return f"a pretty-printed JSON object (one record over several lines), not JSON lines: {convert}"
    return None


def _is_array(text: str) -> bool:
    try:
        return isinstance(json.loads(text), list)
    except (ValueError, RecursionError):
        return False


def fingerprint(obj) -> bytes:
    """The same for two records that are the same JSON, whatever their key order or spacing: an
    exact duplicate (a record twice weighs twice in training; in train and val, it leaks)."""
    import hashlib

    text = json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def load_records(path: str | Path, fmt: str) -> list:
    """All records of a file (for inputs that must be clean): every defect is read first, then
    raised together as one BadRecords, so a user fixes the file in one pass, not one line a run."""
    records, errors = [], []
    for line in read_lines(path, fmt):
        if line.error:
            errors.append(line.error)
        else:
            records.append(line.record)
    if errors:
        raise BadRecords(str(path), errors)
    return records


class BadRecords(RecordError):
    """A file's defective lines: the first `shown` as file:line: field: reason, then the count.
    As a RecordError it names the first defect's field and line."""

    def __init__(self, path: str, errors: list[RecordError], shown: int = 3):
        self.errors = errors
        first = errors[0]
        listed = "; ".join(str(e) for e in errors[:shown])
        more = (f"; and {len(errors) - shown} more ({len(errors)} bad records: `crm-data validate "
                f"{path}` lists every one)") if len(errors) > shown else ""
        super().__init__(first.reason, first.field, first.path, first.line)
        self.args = (listed + more,)

    def __str__(self) -> str:
        return self.args[0]
