"""data_tools.crowd_votes: the vote files people download, in their exact shapes (the dataset cards of
lmsys/arena-human-preference-55k, lmsys/chatbot_arena_conversations, lmarena-ai/arena-human-
preference-100k and -140k, and the Hugging Face chosen/rejected format), as CSV, JSONL and Parquet;
multi-turn, null turns and non-English text; every bad row named by line, field and reason.
"""
from __future__ import annotations

import json

import pytest
from vote_files import arena_55k_row, write_csv, write_jsonl, write_parquet

from crm.core.records import Message
from data_tools.crowd_votes import read_votes, vote_format

ZH_Q, ZH_A, ZH_B = "用一句话解释量子纠缠。", "两个粒子的状态相互关联。", "我不知道。"
RU_Q, RU_A, RU_B = "Как сварить яйцо?", "Варите девять минут.", "Никак."


def arena_55k_rows() -> list[dict]:
    return [
        arena_55k_row(30192, ["Is it morally right?"], ["It depends."], ["Yes."], "model_a"),
        # two turns; B's second answer is null (the model failed); the prompt's JSON text spans
        # four lines of the CSV (a quoted cell)
        arena_55k_row(53567, ["What is the difference\nbetween marriage and a license?", "And in Europe?"],
                      ["A license is paperwork.", "Similar."], ["Marriage is a union.", None], "model_b",
                      indent=1),
        arena_55k_row(65089, [ZH_Q], [ZH_A], [ZH_B], "tie"),
        arena_55k_row(96401, [RU_Q], [RU_A], [RU_B], "model_a"),
    ]


def conv(*turns: str) -> tuple[Message, ...]:
    roles = ("user", "assistant")
    return tuple(Message(roles[i % 2], t) for i, t in enumerate(turns))


EXPECTED_55K = [
    ("30192", "model_a", conv("Is it morally right?", "It depends."), conv("Is it morally right?", "Yes.")),
    ("53567", "model_b",
     conv("What is the difference\nbetween marriage and a license?", "A license is paperwork.",
          "And in Europe?", "Similar."),
     conv("What is the difference\nbetween marriage and a license?", "Marriage is a union.",
          "And in Europe?", "")),
    ("65089", "tie", conv(ZH_Q, ZH_A), conv(ZH_Q, ZH_B)),
    ("96401", "model_a", conv(RU_Q, RU_A), conv(RU_Q, RU_B)),
]


def votes_of(path, fmt=None):
    rows = list(read_votes(path, fmt))
    assert all(r.error is None for r in rows), [str(r.error) for r in rows if r.error]
    return [(r.vote.id, r.vote.winner, r.vote.model_a, r.vote.model_b) for r in rows]


@pytest.mark.parametrize("container", ["csv", "jsonl", "parquet"])
def test_arena_55k_in_every_container(tmp_path, container):
    rows = arena_55k_rows()
    path = tmp_path / f"train.{container}"
    {"csv": write_csv, "jsonl": write_jsonl, "parquet": write_parquet}[container](path, rows)
    assert votes_of(path) == EXPECTED_55K
    assert votes_of(path, "arena-55k") == EXPECTED_55K


def test_csv_lines_are_where_each_row_starts(tmp_path):
    path = write_csv(tmp_path / "train.csv", arena_55k_rows())
    # header on line 1; row 2 starts on line 3 and its prompt cell spans four lines
    assert [r.line for r in read_votes(path)] == [2, 3, 7, 8]


def test_arena_55k_bad_rows_are_named_by_line_field_and_reason(tmp_path):
    good = arena_55k_rows()[0]
    bad = [
        ({**good, "id": 1, "winner_model_b": 1}, "winner_model_a",
         "not one-hot: winner_model_a=1, winner_model_b=1, winner_tie=0"),
        ({**good, "id": 2, "winner_tie": "yes"}, "winner_tie", "expected 0 or 1, got 'yes'"),
        ({**good, "id": 3, "prompt": "[\"unterminated"}, "prompt", "not JSON"),
        ({**good, "id": 4, "response_a": json.dumps(["a", "b"])}, "response_a", "2 turns, the prompt has 1"),
        ({**good, "id": 5, "prompt": json.dumps([None])}, "prompt", "the first turn (the query) is null or empty"),
        ({**good, "id": 6, "response_b": json.dumps([3])}, "response_b", "turn 0 is int, expected a string or null"),
        ({**good, "id": 7, "prompt": "[]"}, "prompt", "expected a non-empty JSON list of strings, one per turn"),
        ({**good, "id": 8, "response_a": '["\\ud83d broken emoji"]'}, "model_a[1].content",
         "not valid Unicode (a lone surrogate at character 0)"),
        ({**good, "id": ""}, "id", "missing or empty id"),
        ({**good, "id": 30192}, "id", "duplicate id, first at line 2"),
    ]
    path = write_csv(tmp_path / "bad.csv", [good] + [row for row, _, _ in bad] + [{**good, "id": 9}])
    rows = list(read_votes(path))
    assert [r.vote.id for r in rows if r.vote] == ["30192", "9"]
    errors = [r for r in rows if r.error]
    assert [(e.error.line, e.error.field, e.error.reason) for e in errors] == [
        (3 + i, field, reason) for i, (_, field, reason) in enumerate(bad)]
    assert [e.id for e in errors] == ["1", "2", "3", "4", "5", "6", "7", "8", None, "30192"]
    assert str(errors[0].error) == f"{path}:3: winner_model_a: {bad[0][2]}"


def arena_conversation_rows() -> list[dict]:
    """chatbot_arena_conversations: question_id, conversation_a/b as {content, role} lists."""
    def messages(*turns):
        return [{"content": t, "role": ("user", "assistant")[i % 2]} for i, t in enumerate(turns)]
    return [
        {"question_id": "58210e39b3fd4441a2bd4a518bb44c2d", "model_a": "chatglm-6b", "model_b": "koala-13b",
         "winner": "model_b", "judge": "arena_user_973", "conversation_a": messages("Hi", "Hello"),
         "conversation_b": messages("Hi", "Hey there"), "turn": 1, "anony": True, "language": "English"},
        {"question_id": "2564acd09e3942fd97657d05282d4389", "model_a": "oasst-pythia-12b", "model_b": "alpaca-13b",
         "winner": "tie (bothbad)", "judge": "arena_user_973", "conversation_a": messages(RU_Q, RU_A, "Ещё?", "Нет."),
         "conversation_b": messages(RU_Q, RU_B, "Ещё?", None), "turn": 2, "anony": True, "language": "Russian"},
        {"question_id": "90bfd142157948aba01931726c888e7f", "model_a": "koala-13b", "model_b": "oasst-pythia-12b",
         "winner": "model_a", "judge": "arena_user_1", "conversation_a": messages(ZH_Q, ZH_A),
         "conversation_b": messages(ZH_Q, ZH_B), "turn": 1, "anony": True, "language": "Chinese"},
    ]


EXPECTED_CONVERSATIONS = [
    ("58210e39b3fd4441a2bd4a518bb44c2d", "model_b", conv("Hi", "Hello"), conv("Hi", "Hey there")),
    ("2564acd09e3942fd97657d05282d4389", "tie", conv(RU_Q, RU_A, "Ещё?", "Нет."), conv(RU_Q, RU_B, "Ещё?", "")),
    ("90bfd142157948aba01931726c888e7f", "model_a", conv(ZH_Q, ZH_A), conv(ZH_Q, ZH_B)),
]


@pytest.mark.parametrize("container", ["jsonl", "parquet"])
def test_chatbot_arena_conversations(tmp_path, container):
    path = tmp_path / f"train.{container}"
    (write_jsonl if container == "jsonl" else write_parquet)(path, arena_conversation_rows())
    assert votes_of(path) == EXPECTED_CONVERSATIONS


def test_arena_100k_with_conversations_as_json_text(tmp_path):
    # the 100k card types conversation_a/b as strings: JSON text of the message list
    rows = [{**r, "conversation_a": json.dumps(r["conversation_a"], ensure_ascii=False),
             "conversation_b": json.dumps(r["conversation_b"], ensure_ascii=False),
             "is_code": False, "category_tag": "{}"} for r in arena_conversation_rows()]
    for container, write in (("parquet", write_parquet), ("csv", write_csv)):
        path = write(tmp_path / f"arena-100k.{container}", rows)
        assert votes_of(path, "arena-conversations") == EXPECTED_CONVERSATIONS


def arena_140k_rows() -> list[dict]:
    """arena-human-preference-140k: id, content as lists of parts {type, text, image, mimeType}."""
    def messages(*turns):
        return [{"role": ("user", "assistant")[i % 2],
                 "content": [{"type": "text", "text": t, "image": None, "mimeType": None}]}
                for i, t in enumerate(turns)]
    two_parts = messages(RU_Q, RU_A)
    two_parts[1]["content"].append({"type": "text", "text": "P.S.", "image": None, "mimeType": None})
    with_image = messages("What is this?", "A cat.")
    with_image[0]["content"].append({"type": "image", "text": None, "image": "img-001", "mimeType": "image/png"})
    return [
        {"id": "c4e6a3bb-1", "model_a": "gemini-2.5-pro", "model_b": "o3", "winner": "both_bad",
         "evaluation_session_id": "s1", "evaluation_order": 1,
         "conversation_a": messages(ZH_Q, ZH_A), "conversation_b": messages(ZH_Q, ZH_B)},
        {"id": "c4e6a3bb-2", "model_a": "o3", "model_b": "claude-opus-4", "winner": "model_a",
         "evaluation_session_id": "s1", "evaluation_order": 2,
         "conversation_a": two_parts, "conversation_b": messages(RU_Q, RU_B)},
        {"id": "c4e6a3bb-3", "model_a": "o3", "model_b": "claude-opus-4", "winner": "model_b",
         "evaluation_session_id": "s2", "evaluation_order": 1,
         "conversation_a": with_image, "conversation_b": messages("What is this?", "A dog.")},
        {"id": "c4e6a3bb-4", "model_a": "o3", "model_b": "claude-opus-4", "winner": "both good",
         "evaluation_session_id": "s3", "evaluation_order": 1,
         "conversation_a": messages("Hi", "Hello"), "conversation_b": messages("Hi", "Hey")},
    ]


@pytest.mark.parametrize("container", ["jsonl", "parquet"])
def test_arena_140k_content_parts(tmp_path, container):
    path = tmp_path / f"train.{container}"
    (write_jsonl if container == "jsonl" else write_parquet)(path, arena_140k_rows())
    rows = list(read_votes(path))
    assert [(r.vote.id, r.vote.winner, r.vote.model_a, r.vote.model_b) for r in rows[:2]] == [
        ("c4e6a3bb-1", "tie", conv(ZH_Q, ZH_A), conv(ZH_Q, ZH_B)),
        ("c4e6a3bb-2", "model_a", conv(RU_Q, RU_A + "\nP.S."), conv(RU_Q, RU_B)),
    ]
    assert [(r.id, r.error.line, r.error.field, r.error.reason) for r in rows[2:]] == [
        ("c4e6a3bb-3", 3, "conversation_a[0].content[1]", "a image part: only text is read"),
        ("c4e6a3bb-4", 4, "winner", "unknown winner 'both good', expected one of model_a, model_b, "
                                    "tie, tie (bothbad), both_bad"),
    ]


def test_conversation_defects(tmp_path):
    base = arena_conversation_rows()[0]
    rows = [
        {**base, "question_id": "q1", "conversation_b": [{"role": "user", "content": "Other"},
                                                          {"role": "assistant", "content": "x"}]},
        {**base, "question_id": "q2", "conversation_a": [{"role": "assistant", "content": "Hello"}]},
        {**base, "question_id": "q3", "conversation_a": "not json"},
        {**base, "question_id": "q4", "conversation_b": [{"role": "user", "content": "Hi"}]},
        {**base, "question_id": "q5", "conversation_a": [{"role": "bot", "content": "Hi"}]},
    ]
    path = write_jsonl(tmp_path / "bad.jsonl", rows + ["not an object"])
    got = [(r.error.line, r.error.field, r.error.reason) for r in read_votes(path)]
    assert got == [
        (1, "model_b", "the two sides answer different queries"),
        (2, "model_a[0].role", "the first message must be the user's query"),
        (3, "conversation_a", "not JSON"),
        (4, "model_b", "no assistant message"),
        (5, "model_a[0].role", "role 'bot' is not one of system, user, assistant"),
        (6, "", "line is str, expected a JSON object"),
    ]


def test_chosen_rejected_shapes(tmp_path):
    rows = [
        # standard, explicit prompt
        {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
        # conversational, implicit prompt (full conversations)
        {"chosen": [{"role": "user", "content": ZH_Q}, {"role": "assistant", "content": ZH_A}],
         "rejected": [{"role": "user", "content": ZH_Q}, {"role": "assistant", "content": ZH_B}]},
        # conversational, explicit prompt; an id of its own
        {"id": "pair-7", "prompt": [{"role": "user", "content": RU_Q}],
         "chosen": [{"role": "assistant", "content": RU_A}], "rejected": [{"role": "assistant", "content": RU_B}]},
        # a text answer without a prompt cannot be split into query and answer
        {"chosen": "Human: hi Assistant: hello", "rejected": "Human: hi Assistant: go away"},
    ]
    expected = [
        ("row-1", "model_a", conv("The sky is", " blue."), conv("The sky is", " green.")),
        ("row-2", "model_a", conv(ZH_Q, ZH_A), conv(ZH_Q, ZH_B)),
        ("pair-7", "model_a", conv(RU_Q, RU_A), conv(RU_Q, RU_B)),
    ]
    got = list(read_votes(write_jsonl(tmp_path / "prefs.jsonl", rows)))
    assert [(r.vote.id, r.vote.winner, r.vote.model_a, r.vote.model_b) for r in got[:3]] == expected
    # a Parquet column has one type: the conversational rows (the first is row 1 there)
    parquet = write_parquet(tmp_path / "prefs.parquet", rows[1:3])
    assert votes_of(parquet) == [("row-1", *expected[1][1:]), expected[2]]
    (err,) = [r.error for r in got if r.error]
    assert (err.line, err.field) == (4, "chosen")
    assert err.reason == "a text answer without a prompt: give `prompt`, or full conversations"


def test_formats_are_detected_from_columns_and_unknown_ones_refused(tmp_path):
    assert vote_format(["id", "prompt", "response_a", "response_b", "winner_tie"]) == "arena-55k"
    assert vote_format(["question_id", "conversation_a", "conversation_b"]) == "arena-conversations"
    assert vote_format(["prompt", "chosen", "rejected"]) == "chosen-rejected"
    assert vote_format(["prompt", "model_a", "model_b", "criteria"]) is None
    path = write_jsonl(tmp_path / "readme.jsonl", [{"idx": 1, "prompt": "p", "criteria": ["c"]}])
    with pytest.raises(ValueError, match=r"readme.jsonl:1: columns \['criteria', 'idx', 'prompt'\] "
                                         "are none of the vote formats"):
        list(read_votes(path))
    with pytest.raises(ValueError, match="unknown extension '.txt'"):
        list(read_votes(tmp_path / "votes.txt"))
    with pytest.raises(ValueError, match="vote format 'arena'"):
        list(read_votes(path, "arena"))
