"""crm.core.records: the three input formats, and how every defect is reported (docs/DESIGN.md section 3)."""
from __future__ import annotations

import json
import os

import pytest

from crm.core.records import (
    NO_TOPIC,
    BenchRecord,
    Message,
    RecordError,
    TestRecord,
    TrainRecord,
    as_training,
    load_records,
    parse_bench,
    parse_test,
    parse_train,
    read_lines,
)

QUERY = "What is 2 + 2?"
DROP = object()  # a field value meaning "leave the field out"


def message_dicts(conversation) -> list[dict]:
    return [{"role": m.role, "content": m.content} for m in conversation]


def conv(answer: str, query: str = QUERY) -> list[dict]:
    return [{"role": "user", "content": query}, {"role": "assistant", "content": answer}]


def make_train_obj(**fields) -> dict:
    obj = {
        "human_winner": "model_a",
        "model_a": conv("4"),
        "model_b": conv("5"),
        "a_criteria": ["is correct", "is concise"],
        "b_criteria": ["is playful"],
        "a_broad_criteria_topic": [1, 2],
        "b_broad_criteria_topic": [7],
        "idx": 3,
        "topic": "math",
    }
    obj.update(fields)
    return {k: v for k, v in obj.items() if v is not DROP}


def make_test_obj(**fields) -> dict:
    obj = {
        "idx": "t-1",
        "prompt": QUERY,
        "model_a": conv("4"),
        "model_b": conv("5"),
        "criteria": ["is correct"],
        "preference": "model_a",
    }
    obj.update(fields)
    return {k: v for k, v in obj.items() if v is not DROP}


def line(obj) -> str:
    return json.dumps(obj)


# (id, defective line, field named by the error, words of the reason)
TRAIN_DEFECTS = [
    ("bad-json", '{"human_winner": "model_a", "model_a": [', "", "bad JSON"),
    ("json-too-deep", "[" * 100_000, "", "bad JSON: nested too deeply"),
    ("non-object-line", "[1, 2, 3]", "", "line is list, expected a JSON object"),
    ("json-string-line", '"just a string"', "", "line is str, expected a JSON object"),
    ("missing-field", line(make_train_obj(a_criteria=DROP)), "a_criteria", "missing field"),
    ("missing-winner", line(make_train_obj(human_winner=DROP)), "human_winner", "missing field"),
    ("wrong-type-conversation", line(make_train_obj(model_a=5)), "model_a",
     "expected a list of messages, got int"),
    ("wrong-type-criteria", line(make_train_obj(b_criteria={"x": 1})), "b_criteria",
     "expected a list of strings, got dict"),
    ("wrong-type-topic", line(make_train_obj(topic=5)), "topic", "expected a string, got int"),
    ("wrong-type-idx", line(make_train_obj(idx=True)), "idx", "expected a string or integer id, got bool"),
    ("unknown-preference", line(make_train_obj(human_winner="model_c")), "human_winner",
     "unknown preference 'model_c'"),
    ("empty-conversation", line(make_train_obj(model_b=[])), "model_b", "empty conversation"),
    ("message-not-object", line(make_train_obj(model_a=["hi", {"role": "assistant", "content": "4"}])),
     "model_a[0]", "message is str, expected an object"),
    ("message-without-content", line(make_train_obj(model_a=[{"role": "user", "content": QUERY},
                                                        {"role": "assistant"}])),
     "model_a[1].content", "message without content"),
    ("null-content", line(make_train_obj(model_b=[{"role": "user", "content": QUERY},
                                             {"role": "assistant", "content": None}])),
     "model_b[1].content", "expected a string, got null"),
    ("bad-role", line(make_train_obj(model_a=[{"role": "user", "content": QUERY},
                                         {"role": "bot", "content": "4"}])),
     "model_a[1].role", "role 'bot' is not one of"),
    ("first-message-not-user", line(make_train_obj(model_a=[{"role": "assistant", "content": "4"},
                                                       {"role": "user", "content": QUERY}])),
     "model_a[0].role", "the first message must be the user's query"),
    ("no-assistant-message", line(make_train_obj(model_b=[{"role": "user", "content": QUERY}])),
     "model_b", "no assistant message"),
    ("query-mismatch", line(make_train_obj(model_b=conv("5", query="What is 3 + 3?"))),
     "model_b[0].content", "first message differs from model_a's query"),
    ("non-string-criterion", line(make_train_obj(b_criteria=["is playful", 3])), "b_criteria",
     "criterion 1 is int, expected a string"),
    ("blank-criterion", line(make_train_obj(a_criteria=["is correct", "   "])), "a_criteria",
     "criterion 1 is empty"),
    ("empty-criteria-list", line(make_train_obj(a_criteria=[])), "a_criteria", "empty criteria list"),
    ("repr-not-a-list", line(make_train_obj(a_criteria="{'is correct': 1}")), "a_criteria",
     "string parses as dict, expected a list"),
    ("repr-not-a-literal", line(make_train_obj(model_a="[x for x in 'ab']")), "model_a",
     'text, expected a list of chat messages, [{"role": "user", "content": QUERY}, '
     '{"role": "assistant", "content": ANSWER}]'),
    ("repr-unbuildable-literal", line(make_train_obj(a_criteria="{[1]: 2}")), "a_criteria",
     "string is not a list literal"),
    ("non-int-topic-id", line(make_train_obj(a_broad_criteria_topic=[1, "2"])), "a_broad_criteria_topic",
     "topic 1 is str, expected an integer"),
    ("bool-topic-id", line(make_train_obj(b_broad_criteria_topic=[True])), "b_broad_criteria_topic",
     "topic 0 is bool, expected an integer"),
    ("topics-not-a-list", line(make_train_obj(b_broad_criteria_topic=7)), "b_broad_criteria_topic",
     "expected a list of integer topic ids, got int"),
    ("unknown-shape", line(make_train_obj(shape="ties")), "shape",
     "unknown shape 'ties', expected one of decides, tie, user"),
    ("shape-not-a-string", line(make_train_obj(shape=["tie"])), "shape", "unknown shape ['tie']"),
    ("tie-shape-with-a-winner", line(make_train_obj(shape="tie")), "shape",
     "shape 'tie' needs human_winner 'tie', got 'model_a'"),
    ("tie-shape-with-two-lists", line(make_train_obj(shape="tie", human_winner="tie")), "b_criteria",
     "shape 'tie': b_criteria must equal a_criteria"),
]

TEST_DEFECTS = [
    ("bad-json", '{"idx": 1, "prompt": }', "", "bad JSON"),
    ("non-object-line", "null", "", "line is null, expected a JSON object"),
    ("missing-field", line(make_test_obj(criteria=DROP)), "criteria", "missing field"),
    ("missing-idx", line(make_test_obj(idx=DROP)), "idx", "missing field"),
    ("wrong-type-prompt", line(make_test_obj(prompt=["hi"])), "prompt", "expected a string, got list"),
    ("empty-prompt", line(make_test_obj(prompt="  ")), "prompt", "empty string"),
    ("wrong-type-idx", line(make_test_obj(idx=1.5)), "idx", "expected a string or integer id, got float"),
    ("unknown-preference", line(make_test_obj(preference="both")), "preference",
     "unknown preference 'both'"),
    ("empty-conversation", line(make_test_obj(model_a=[])), "model_a", "empty conversation"),
    ("message-without-content", line(make_test_obj(model_b=[{"role": "user"}])),
     "model_b[0].content", "message without content"),
    ("bad-role", line(make_test_obj(model_b=[{"role": "human", "content": QUERY}])),
     "model_b[0].role", "role 'human' is not one of"),
    ("first-message-not-user", line(make_test_obj(model_b=[{"role": "system", "content": "be brief"},
                                                      {"role": "assistant", "content": "5"}])),
     "model_b[0].role", "the first message must be the user's query"),
    ("query-mismatch", line(make_test_obj(model_b=conv("5", query="Something else"))),
     "model_b[0].content", "first message differs from model_a's query"),
    ("non-string-criterion", line(make_test_obj(criteria=[None])), "criteria",
     "criterion 0 is null, expected a string"),
    ("empty-criteria-list", line(make_test_obj(criteria=[])), "criteria", "empty criteria list"),
    ("empty-criteria-repr", line(make_test_obj(criteria="[]")), "criteria", "empty criteria list"),
    ("repr-not-a-list", line(make_test_obj(model_a="('user', 'hi')")), "model_a",
     "string parses as tuple, expected a list"),
    ("repr-code", line(make_test_obj(criteria="__import__('os').system('echo hi')")), "criteria",
     "string is not a list literal"),
    # the README's format with each response as plain text: the message list's shape is said
    ("plain-text-response", line(make_test_obj(model_b="Sure! Boil it for nine minutes.")),
     "model_b", "text, expected a list of chat messages"),
]


def _write(path, lines: list[str]) -> None:
    path.write_text("".join(text + "\n" for text in lines), encoding="utf-8")


@pytest.mark.parametrize(
    "fmt, make, record_type, bad, field, reason",
    [("train", make_train_obj, TrainRecord, *d[1:]) for d in TRAIN_DEFECTS]
    + [("test", make_test_obj, TestRecord, *d[1:]) for d in TEST_DEFECTS],
    ids=[f"train-{d[0]}" for d in TRAIN_DEFECTS] + [f"test-{d[0]}" for d in TEST_DEFECTS],
)
def test_read_lines_reports_each_defect_at_its_line(tmp_path, fmt, make, record_type, bad, field,
                                                   reason):
    path = tmp_path / f"{fmt}.jsonl"
    # line 2 is blank: not reported, but the defect is still on the file's line 4
    _write(path, [line(make(idx=1)), "", line(make(idx=2)), bad, line(make(idx=4))])

    lines = list(read_lines(path, fmt))

    assert [ln.number for ln in lines] == [1, 3, 4, 5]
    good = [ln for ln in lines if ln.number != 4]
    assert all(ln.error is None and isinstance(ln.record, record_type) for ln in good)
    assert [ln.record.idx for ln in good] == ["1", "2", "4"]
    (err_line,) = [ln for ln in lines if ln.number == 4]
    assert err_line.record is None
    err = err_line.error
    assert isinstance(err, RecordError)
    assert (err.path, err.line, err.field) == (str(path), 4, field)
    assert reason in err.reason
    assert str(err) == f"{path}:4: {field + ': ' if field else ''}{err.reason}"


@pytest.mark.parametrize("fmt, make, defects", [("train", make_train_obj, TRAIN_DEFECTS),
                                                ("test", make_test_obj, TEST_DEFECTS)])
def test_one_file_with_every_defect_between_good_lines(tmp_path, fmt, make, defects):
    texts, expected_errors = [], {}
    for i, (_, bad, field, _reason) in enumerate(defects):
        texts += [line(make(idx=f"good-{i}")), "   ", bad]
        expected_errors[len(texts)] = field
    texts.append(line(make(idx="last")))
    path = tmp_path / "mixed.jsonl"
    _write(path, texts)

    lines = list(read_lines(path, fmt))

    assert len(lines) == 2 * len(defects) + 1  # the blank lines are not reported
    errors = {ln.number: ln.error.field for ln in lines if ln.error}
    assert errors == expected_errors
    good = [ln.record.idx for ln in lines if ln.error is None]
    assert good == [f"good-{i}" for i in range(len(defects))] + ["last"]


def test_read_lines_detects_the_format_from_the_first_object(tmp_path):
    for fmt, make, record_type in (("train", make_train_obj, TrainRecord),
                                   ("test", make_test_obj, TestRecord)):
        path = tmp_path / f"{fmt}.jsonl"
        # a broken and a non-object first line must not decide the format
        _write(path, ["{not json", "[1]", line(make()), line(make())])
        lines = list(read_lines(path))
        assert [ln.number for ln in lines] == [1, 2, 3, 4]
        assert "bad JSON" in lines[0].error.reason
        assert "expected a JSON object" in lines[1].error.reason
        assert all(isinstance(ln.record, record_type) for ln in lines[2:])
    path = tmp_path / "bench.jsonl"
    _write(path, [line({"idx": 1, "topic": "t", "prompt": "p", "responses": {"m": "r"}})])
    assert isinstance(next(read_lines(path)).record, BenchRecord)


def test_invalid_utf8_is_a_defect_of_its_line_not_a_crash(tmp_path):
    path = tmp_path / "bytes.jsonl"
    path.write_bytes(line(make_test_obj(idx=1)).encode() + b"\n"
                     + b'{"idx": "\xff\xfe"}\n'
                     + line(make_test_obj(idx=3)).encode() + b"\r\n")  # CRLF is fine too
    lines = list(read_lines(path, "test"))
    assert [ln.number for ln in lines] == [1, 2, 3]
    assert lines[1].error.line == 2 and "not valid UTF-8" in lines[1].error.reason
    assert [ln.record.idx for ln in (lines[0], lines[2])] == ["1", "3"]


def test_python_repr_strings_parse_like_lists():
    a = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello!"}]
    b = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hey"},
         {"role": "user", "content": "more"}, {"role": "assistant", "content": "sure"}]
    criteria = ["is friendly", "uses the user's name"]
    obj = make_test_obj(prompt="hi", model_a=str(a), model_b=str(b), criteria=str(criteria))
    assert all(isinstance(obj[k], str) for k in ("model_a", "model_b", "criteria"))

    record = parse_test(obj)

    assert record.model_a == (Message("user", "hi"), Message("assistant", "hello!"))
    assert message_dicts(record.model_b) == b
    assert record.criteria == tuple(criteria)
    # and the same through a file
    train = parse_train(make_train_obj(model_a=str(conv("4")), a_criteria=str(["is correct"]),
                                  a_broad_criteria_topic="[1]"))
    assert train.a_criteria == ("is correct",) and train.a_topics == (1,)
    assert train.query == QUERY


def test_repr_string_with_code_is_rejected_and_never_executed(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(os, "system", lambda *a: calls.append(a) or 0)
    marker = tmp_path / "pwned"
    payloads = ["__import__('os').system('echo hi')",
                f"__import__('pathlib').Path({str(marker)!r}).touch() or ['x']",
                "[__import__('os').system('echo hi')]"]
    for payload in payloads:
        for obj, field in ((make_test_obj(criteria=payload), "criteria"),
                           (make_test_obj(model_a=payload), "model_a")):
            with pytest.raises(RecordError) as info:
                parse_test(obj)
            assert info.value.field == field
            assert info.value.reason.startswith(
                "string is not a list literal" if field == "criteria" else "text, expected a list")
    assert calls == [] and not marker.exists()


def test_record_error_str_reads_file_line_field_reason(tmp_path):
    err = RecordError("empty conversation", "model_b", "data/train.jsonl", 7)
    assert str(err) == "data/train.jsonl:7: model_b: empty conversation"
    assert err.as_dict() == {"file": "data/train.jsonl", "line": 7, "field": "model_b",
                             "reason": "empty conversation"}
    # without a field, and located after the fact by `at`
    located = RecordError("bad JSON: x").at(tmp_path / "f.jsonl", 2)
    assert str(located) == f"{tmp_path / 'f.jsonl'}:2: bad JSON: x"
    assert isinstance(located, ValueError)
    # unlocated, as the parsers raise it
    with pytest.raises(RecordError) as info:
        parse_train(make_train_obj(model_b=[]))
    assert str(info.value) == "model_b: empty conversation"


def test_bench_text_responses_become_two_message_conversations():
    kept = [{"role": "user", "content": "Write a haiku"}, {"role": "assistant", "content": "Leaves"},
            {"role": "user", "content": "Another"}, {"role": "assistant", "content": "Snow"}]
    record = parse_bench({"idx": 9, "topic": "poetry", "prompt": "Write a haiku",
                          "responses": {"gpt": "An old silent pond", "llama": kept,
                                        "repr": str(kept[:2])}})
    assert (record.idx, record.topic, record.prompt) == ("9", "poetry", "Write a haiku")
    assert list(record.responses) == ["gpt", "llama", "repr"]
    assert record.responses["gpt"] == (Message("user", "Write a haiku"),
                                       Message("assistant", "An old silent pond"))
    assert message_dicts(record.responses["llama"]) == kept
    # a bench response string is the model's text, even when it looks like a list: never parsed
    assert record.responses["repr"] == (Message("user", "Write a haiku"),
                                        Message("assistant", str(kept[:2])))


@pytest.mark.parametrize("responses, field, reason", [
    ({}, "responses", "no responses"),
    (["a"], "responses", "expected an object of model name -> response, got list"),
    ({"m": ""}, "responses.m", "empty string"),
    ({"m": 3}, "responses.m", "expected a list of messages, got int"),
    ({"m": [{"role": "assistant", "content": "x"}]}, "responses.m[0].role", "user's query"),
])
def test_bench_defects(responses, field, reason):
    with pytest.raises(RecordError) as info:
        parse_bench({"idx": 1, "topic": "t", "prompt": "p", "responses": responses})
    assert info.value.field == field and reason in info.value.reason


def test_load_records_returns_records_or_raises_the_first_error(tmp_path):
    clean = tmp_path / "clean.jsonl"
    _write(clean, [line(make_train_obj(idx=1)), "", line(make_train_obj(idx=2, human_winner="tie"))])
    records = load_records(clean, "train")
    assert [(r.idx, r.human_winner) for r in records] == [("1", "model_a"), ("2", "tie")]
    assert all(isinstance(r, TrainRecord) for r in records)

    dirty = tmp_path / "dirty.jsonl"
    _write(dirty, [line(make_train_obj()), "", line(make_train_obj(model_b=[])),
                   line(make_train_obj(idx=DROP)), "{oops"])
    with pytest.raises(RecordError) as info:
        load_records(dirty, "train")
    assert (info.value.line, info.value.field) == (3, "model_b")
    assert str(info.value).startswith(f"{dirty}:3: model_b: ")


def test_missing_file_raises_oserror(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_records(tmp_path / "nope.jsonl", "test")
    with pytest.raises(OSError):
        list(read_lines(tmp_path / "nope.jsonl"))


# ---------------------------------------------------------------------------------------------
# the README format (criteria + preference) as training data


@pytest.mark.parametrize("preference, on_a, on_b", [("model_a", True, False),
                                                    ("model_b", False, True),
                                                    ("tie", True, True)])
def test_readme_format_parses_as_a_one_sided_training_record(preference, on_a, on_b):
    obj = make_test_obj(preference=preference, criteria=["is correct", "is short"], topic="math")
    record = parse_train(obj)
    assert record == as_training(parse_test(obj))
    assert record.one_sided and record.human_winner == preference
    assert (record.idx, record.topic, record.query) == ("t-1", "math", QUERY)
    assert record.a_criteria == (("is correct", "is short") if on_a else ())
    assert record.b_criteria == (("is correct", "is short") if on_b else ())
    assert record.a_topics == ((NO_TOPIC, NO_TOPIC) if on_a else ())
    assert record.b_topics == ((NO_TOPIC, NO_TOPIC) if on_b else ())
    # a README-format defect is reported as the README format's
    with pytest.raises(RecordError) as info:
        parse_train(make_test_obj(criteria=[]))
    assert (info.value.field, info.value.reason) == ("criteria", "empty criteria list")
    assert not parse_train(make_train_obj()).one_sided
    assert record.shape == ("tie" if preference == "tie" else "decides")


def test_a_records_shape_is_read_and_decides_when_absent():
    assert parse_train(make_train_obj()).shape == "decides"
    assert parse_train(make_train_obj(shape=None)).shape == "decides"
    assert parse_train(make_train_obj(shape="user", human_winner="tie")).shape == "user"
    tie = parse_train(make_train_obj(shape="tie", human_winner="tie", b_criteria=["is correct", "is concise"],
                                      b_broad_criteria_topic=[1, 2]))
    assert (tie.shape, tie.human_winner, tie.a_criteria) == ("tie", "tie", tie.b_criteria)


@pytest.mark.parametrize("fmt", [None, "test"])
def test_a_file_mixing_formats_names_the_first_line_of_the_other_format(tmp_path, fmt):
    path = tmp_path / "mixed.jsonl"
    # line 1: defective and marks no format; line 2 fixes it (when detected); line 4 is training
    _write(path, ['{"idx": 1}', line(make_test_obj(idx=2)), line(make_test_obj(idx=3)),
                  line(make_train_obj(idx=4)), line(make_train_obj(idx=5))])
    lines = []
    with pytest.raises(RecordError) as info:
        for ln in read_lines(path, fmt):
            lines.append(ln)
    assert [ln.number for ln in lines] == [1, 2, 3]
    # before any line names the format, a defective line is read as training data
    assert lines[0].error.field == ("preference" if fmt else "human_winner")
    assert lines[1].record.idx == "2"
    assert str(info.value) == (
        f"{path}:4: a train-format record in a test-format file (the format of line 2): a file "
        "holds one format" if fmt is None else
        f"{path}:4: a train-format record where test-format records are wanted (the README "
        "format: idx, prompt, model_a, model_b, criteria, preference; docs/DESIGN.md section "
        "3.1): this file is not one")
    # A whole file in another format than the one asked for stops at its first line.
    with pytest.raises(RecordError, match=r":2: a test-format record where train-format records are wanted"):
        list(read_lines(path, "train"))
    clean_start = tmp_path / "clean_start.jsonl"
    _write(clean_start, [line(make_test_obj(idx=2)), line(make_train_obj(idx=4))])
    with pytest.raises(RecordError, match=":2: a train-format record"):
        load_records(clean_start, "test")
