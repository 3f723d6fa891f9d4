"""crm-data criteria against a real HTTP server (tests/openai_stub.py on 127.0.0.1): the prompt, the
answers' checks, every fault kind ending in a row or a reject with its reason, resume (in-process and
after a kill -9) paying for no answer twice, and each vote format's round trip to shardable rows.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from openai_stub import StubLLM
from vote_files import arena_55k_row, write_csv, write_jsonl, write_parquet

from crm.core.records import Message, read_lines
from data_tools.cli import main
import data_tools.criteria
from data_tools.criteria import (ANSWERS, KEYS, RESPONSE_FORMAT, SCHEMA, SIDES, AnswerCache,
                                 AnswerError, CriteriaPrompt, read_answer, render_response, vote_hash)
from data_tools.crowd_votes import Vote, read_votes

FAST = ["--model", "stub", "--backoff", "0.01", "--no-progress", "--concurrency", "4", "--k", "3"]


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def votes_csv(path: Path, queries: list[str]) -> Path:
    """One single-turn 55k-format vote per query (ids 0..n-1), winners cycling a, b, tie."""
    winners = ("model_a", "model_b", "tie")
    return write_csv(path, [arena_55k_row(i, [q], [f"Answer A to {q}"], [f"Answer B to {q}"], winners[i % 3])
                            for i, q in enumerate(queries)])


def jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines()]


# ---------------------------------------------------------------------------------------------
# the prompt and the answers


def vote(a: list[str], b: list[str], query: str = "How do I boil an egg?") -> Vote:
    def conv(answers):
        msgs = [Message("user", query), Message("assistant", answers[0])]
        for i, answer in enumerate(answers[1:], start=1):
            msgs += [Message("user", f"follow-up {i}"), Message("assistant", answer)]
        return tuple(msgs)
    return Vote("v1", 2, "model_a", conv(a), conv(b))


def test_prompt_shows_the_query_then_a_then_b():
    prompt = CriteriaPrompt.load()
    system, user = prompt.messages(vote(["Nine minutes."], ["Ask a chef {response_b}."]))
    assert system["role"] == "system" and "a_criteria" not in system["content"]
    assert user["role"] == "user"
    text = user["content"]
    assert text.index("How do I boil an egg?") < text.index("Nine minutes.") < text.index("Ask a chef")
    # a vote's text that looks like a placeholder stays text
    assert "Ask a chef {response_b}." in text and text.count("Nine minutes.") == 1
    assert RESPONSE_FORMAT["json_schema"]["schema"]["required"] == ["a_criteria", "b_criteria",
                                                                   "tie_criteria"]
    assert len(prompt.hash) == 16 and prompt.hash == CriteriaPrompt.load().hash


def test_multi_turn_responses_show_every_later_turn():
    v = vote(["First.", "Second."], ["Only."])
    assert render_response(v.model_a) == "[assistant]\nFirst.\n\n[user]\nfollow-up 1\n\n[assistant]\nSecond."
    assert render_response(vote(["Only."], ["x"]).model_a) == "Only."


def test_an_edited_prompt_has_another_hash_and_a_broken_one_is_refused(tmp_path):
    default = CriteriaPrompt.load()
    edited = tmp_path / "prompt.yaml"
    edited.write_text(json.dumps({"system": "Be terse.", "user": default.user}))  # JSON is YAML
    assert CriteriaPrompt.load(edited).hash != default.hash
    for spec, match in (({"user": "{query} {response_a}"}, r"\{response_b\} exactly once"),
                        ({"user": "{query} {query} {response_a} {response_b}"}, r"\{query\} exactly once"),
                        ({"system": "no user"}, "expected the keys")):
        edited.write_text(json.dumps(spec))
        with pytest.raises(ValueError, match=match):
            CriteriaPrompt.load(edited)


def test_a_prompt_that_never_asks_for_tie_criteria_is_refused_before_any_request(tmp_path, capsys):
    """A copy of the prompt made before tie criteria: the model would have to guess the key."""
    default = CriteriaPrompt.load()
    old = tmp_path / "old_prompt.yaml"
    old.write_text(json.dumps({"system": default.system.replace("tie_criteria", ""),
                               "user": default.user.replace("tie_criteria", "ties")}))
    out = tmp_path / "out"
    out.mkdir()
    (out / "train.jsonl").write_text("the user's earlier output\n")
    with StubLLM() as stub:
        code, _, err = run(capsys, "criteria", votes_csv(tmp_path / "votes.csv", ["q1"]), out,
                           "--base-url", stub.url, *FAST, "--prompt", old)
        assert sum(stub.requests.values()) == 0
    assert code == 2
    assert err.splitlines() == [f"crm-data criteria: {old}: the prompt never names 'tie_criteria', a "
                                "key of the answer's schema (a_criteria, b_criteria, tie_criteria): "
                                f"ask for it (see {data_tools.criteria.PROMPT})"]
    assert (out / "train.jsonl").read_text() == "the user's earlier output\n"
    assert sorted(p.name for p in out.iterdir()) == ["train.jsonl"]


NO_TIE = '"tie_criteria": []'
KEYS_LIST = "['a_criteria', 'b_criteria', 'tie_criteria']"


@pytest.mark.parametrize("text, reason, retry", [
    (None, "empty answer", True),
    ("Sure! A is better.", "not JSON", True),
    ('{"a_criteria": ["x"]', "not JSON", True),
    ('["x"]', f"breaks the schema: expected the keys {KEYS_LIST}, got list", True),
    ('{"a_criteria": ["x"], "b_criteria": ["y"], %s, "why": 1}' % NO_TIE, "breaks the schema", True),
    # an answer of the schema before tie criteria
    ('{"a_criteria": ["x"], "b_criteria": ["y"]}',
     f"breaks the schema: expected the keys {KEYS_LIST}, got ['a_criteria', 'b_criteria']", True),
    ('{"a_criteria": "x", "b_criteria": ["y"], %s}' % NO_TIE,
     "a_criteria is not a list of non-blank strings", True),
    ('{"a_criteria": ["x", " "], "b_criteria": ["y"], %s}' % NO_TIE, "a_criteria is not a list", True),
    ('{"a_criteria": ["x"], "b_criteria": [2], %s}' % NO_TIE, "b_criteria is not a list", True),
    ('{"a_criteria": ["x"], "b_criteria": ["y"], "tie_criteria": "z"}', "tie_criteria is not a list", True),
    ('{"a_criteria": ["x"], "b_criteria": ["y"], "tie_criteria": [""]}', "tie_criteria is not a list", True),
    ('{"a_criteria": ["x"], "b_criteria": [], %s}' % NO_TIE, "empty b_criteria", False),
])
def test_read_answer_rejects_what_is_not_three_lists_of_criteria(text, reason, retry):
    with pytest.raises(AnswerError) as info:
        read_answer(text)
    assert reason in info.value.reason and info.value.retry is retry
    # tie_criteria may be empty: some pairs differ in everything a user could name
    assert read_answer('{"b_criteria": ["y"], "tie_criteria": [], "a_criteria": ["Prefers x"]}') == {
        "a_criteria": ["Prefers x"], "b_criteria": ["y"], "tie_criteria": []}
    with pytest.raises(AnswerError, match="raise --max-tokens"):
        read_answer('{"a_criteria": ["x', finish_reason="length")


# ---------------------------------------------------------------------------------------------
# faults: every kind ends in a written row or a reject with its reason

# query marker -> (the stub's script for that vote, where it ends, what the reason says)
FAULTS = {
    "q-429-once": (["429"], "written", None),
    "q-500-twice": (["500", "500"], "written", None),
    "q-slow-once": (["slow"], "written", None),
    "q-drop-once": (["drop"], "written", None),
    "q-badjson-once": (["badjson"], "written", None),
    "q-schema-once": (["schema"], "written", None),
    "q-429-always": (["429"] * 10, "request", "no answer after 3 attempts: Error code: 429 - stub 429"),
    "q-500-always": (["500"] * 10, "request", "no answer after 3 attempts: Error code: 500 - stub 500"),
    "q-slow-always": (["slow"] * 10, "request", "no answer after 3 attempts: APITimeoutError"),
    "q-drop-always": (["drop"] * 10, "request", "no answer after 3 attempts: APIConnectionError"),
    "q-badjson-always": (["badjson"] * 10, "answer", "not JSON: Expecting value (3 answers)"),
    "q-schema-always": (["schema"] * 10, "answer",
                        f"breaks the schema: expected the keys {KEYS_LIST}, got "
                        "['a_criteria', 'reason'] (3 answers)"),
    "q-empty": (["empty"] * 10, "answer", "empty a_criteria"),
    "q-fine": ([], "written", None),
    "q-notie-once": (["notie"], "written", None),
    "q-notie-always": (["notie"] * 10, "answer",
                       f"breaks the schema: expected the keys {KEYS_LIST}, got "
                       "['a_criteria', 'b_criteria'] (3 answers)"),
}


def test_every_fault_ends_in_a_row_or_a_reject_with_its_reason(tmp_path, capsys):
    queries = list(FAULTS)
    votes = votes_csv(tmp_path / "votes.csv", queries)
    out = tmp_path / "out"
    with StubLLM(slow_seconds=1.5, faults={q: script for q, (script, _, _) in FAULTS.items()}) as stub:
        code, stdout, _ = run(capsys, "criteria", votes, out, "--base-url", stub.url, *FAST,
                              "--max-retries", "2", "--timeout", "0.4")
        requests = dict(stub.requests)
    assert code == 0, stdout
    summary = json.loads((out / "summary.json").read_text())
    rows = {r["idx"]: r for r in jsonl(out / "train.jsonl")}
    rejects = {r["id"]: r for r in jsonl(out / "rejects.jsonl")}
    assert summary["read"] == len(queries) == summary["written"] + summary["rejected"]
    # each written vote's record, and a decisive one's tie record (the stub's answers share words)
    assert summary["written"] + summary["tie_records"] == len(rows)
    assert summary["rejected"] == len(rejects)
    for i, (q, (script, ends, reason)) in enumerate(FAULTS.items()):
        if ends == "written":
            assert str(i) in rows and str(i) not in rejects, q
            row, tie = rows[str(i)], [f"Wants an answer that says 'Answer to {q}'"]
            if i % 3 == 2:  # a tie vote (votes_csv): its record holds the criteria of its tie
                assert (row["shape"], row["a_criteria"], row["b_criteria"]) == ("tie", tie, tie)
            else:
                assert row["a_criteria"] == ["Prefers an answer that opens with 'Answer A to'"]
                assert (rows[f"{i}:tie"]["a_criteria"], rows[f"{i}:tie"]["shape"]) == (tie, "tie")
            assert row["model_a"] == [{"role": "user", "content": q},
                                      {"role": "assistant", "content": f"Answer A to {q}"}]
            assert len(row["a_broad_criteria_topic"]) == 1  # topics ran at the end
        else:
            r = rejects[str(i)]
            assert (r["stage"], r["line"], r["file"]) == (ends, i + 2, str(votes)), q
            assert r["reason"].startswith(reason), (q, r["reason"])
            assert ("answer" in r) == (ends == "answer")  # the model's raw answer, when it answered
    assert rejects["10"]["answer"] == "Sure! Response A is better because it is concise."
    assert summary["rejected_by_stage"] == {"input": 0, "answer": 4, "request": 4}
    # the client's counts are the server's: every request, and a retry for each but the first
    assert summary["requests"] == sum(requests.values())
    assert summary["retries"] == summary["requests"] - len(queries)
    assert requests["q-empty"] == 1  # an empty list is final: not asked again
    assert requests["q-429-always"] == 3 and requests["q-badjson-always"] == 3
    assert requests["q-notie-always"] == 3
    assert summary["tokens_in"] > 0 and summary["tokens_out"] > 0
    assert f"{len(queries)} votes read = 8 written" in stdout
    # the output shards: every written row is a valid training record
    assert all(line.error is None for line in read_lines(out / "train.jsonl", "train"))


# query marker -> the stub's tie criteria for that vote
TIES = {"q-a-shared": ["Wants a polite answer"], "q-a-nothing": [],
        "q-tie-shared": ["Wants a short answer", "Likes plain words"], "q-tie-nothing": []}


def test_tie_criteria_become_tie_records_and_a_tie_vote_without_them_is_rejected(tmp_path, capsys):
    winners = ("model_a", "model_b", "tie", "tie")
    votes = write_csv(tmp_path / "votes.csv", [arena_55k_row(i, [q], [f"A to {q}"], [f"B to {q}"], w)
                                               for i, (q, w) in enumerate(zip(TIES, winners))])
    out = tmp_path / "out"
    with StubLLM(criteria=lambda q, a, b: (["Likes A"], ["Likes B"], TIES[q])) as stub:
        code, stdout, _ = run(capsys, "criteria", votes, out, "--base-url", stub.url, *FAST)
        assert stub.requests["q-tie-nothing"] == 1  # final: asking again pays for the same judgement
    assert code == 0, stdout
    rows = jsonl(out / "train.jsonl")
    pair = {0: ("A to q-a-shared", "B to q-a-shared"), 2: ("A to q-tie-shared", "B to q-tie-shared")}
    shared = ["Wants a short answer", "Likes plain words"]
    assert [(r["idx"], r["human_winner"], r["shape"], r["a_criteria"], r["b_criteria"]) for r in rows] == [
        ("0", "model_a", "decides", ["Likes A"], ["Likes B"]),
        ("0:tie", "tie", "tie", ["Wants a polite answer"], ["Wants a polite answer"]),
        ("1", "model_b", "decides", ["Likes A"], ["Likes B"]),  # no tie criteria: no tie record
        ("2", "tie", "tie", shared, shared),  # a tie vote: its record is its tie's
    ]
    assert [r["model_a"][1]["content"] for r in rows[:2]] == [pair[0][0]] * 2
    assert rows[3]["model_b"][1]["content"] == pair[2][1]
    rejects = jsonl(out / "rejects.jsonl")
    assert [(r["id"], r["line"], r["stage"]) for r in rejects] == [("3", 5, "answer")]
    assert rejects[0]["reason"].startswith("a tie vote, but tie_criteria is empty")
    assert json.loads(rejects[0]["answer"])["tie_criteria"] == []  # the raw answer, kept
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["read"], summary["written"], summary["rejected"], summary["tie_records"]) == (4, 3, 1, 1)
    assert summary["shapes"] == {"decides": 2, "tie": 2}
    assert "4 votes read = 3 written" in stdout and "+ 1 tie record" in stdout
    # topics fill the tie records' ids too, the same on both sides; every line is a training record
    assert rows[1]["a_broad_criteria_topic"] == rows[1]["b_broad_criteria_topic"] != []
    assert [line.record.shape for line in read_lines(out / "train.jsonl", "train")] == \
        ["decides", "tie", "decides", "tie"]


def test_an_answer_cached_before_tie_criteria_is_asked_again(tmp_path, capsys, monkeypatch):
    """The schema is in the prompt hash, so an answer without tie_criteria is another key."""
    old_schema = {**SCHEMA, "properties": {side: SCHEMA["properties"][side] for side in SIDES},
                  "required": list(SIDES)}
    monkeypatch.setattr(data_tools.criteria, "RESPONSE_FORMAT",
                        {**RESPONSE_FORMAT, "json_schema": {**RESPONSE_FORMAT["json_schema"],
                                                            "schema": old_schema}})
    old_hash = CriteriaPrompt.load().hash  # today's wording under the old schema
    monkeypatch.undo()
    assert old_hash != CriteriaPrompt.load().hash and list(SCHEMA["properties"]) == list(KEYS)
    votes = votes_csv(tmp_path / "votes.csv", ["q-old"])
    out = tmp_path / "out"
    out.mkdir()
    old = {"id": "0", "vote_hash": vote_hash(next(read_votes(votes)).vote), "prompt_hash": old_hash,
           "model": "stub", "answer": "{}", "usage": {}, "a_criteria": ["x"], "b_criteria": ["y"]}
    (out / ANSWERS).write_text(json.dumps(old) + "\n")
    with StubLLM() as stub:
        assert run(capsys, "criteria", votes, out, "--base-url", stub.url, *FAST)[0] == 0
        assert stub.requests["q-old"] == 1
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["cached_before"], summary["asked"], summary["tie_records"]) == (0, 1, 1)
    assert jsonl(out / "train.jsonl")[0]["a_criteria"] != ["x"]


def test_rerun_asks_only_the_votes_without_an_answer(tmp_path, capsys):
    queries = ["q-fine-1", "q-down-then-up", "q-badjson-always", "q-fine-2"]
    votes = votes_csv(tmp_path / "votes.csv", queries)
    out = tmp_path / "out"
    faults = {"q-down-then-up": ["500", "500"], "q-badjson-always": ["badjson"] * 10}
    with StubLLM(faults=faults) as stub:
        args = ["criteria", votes, out, "--base-url", stub.url, *FAST, "--max-retries", "1"]
        assert run(capsys, *args)[0] == 0
        first = json.loads((out / "summary.json").read_text())
        assert first["rejected_by_stage"] == {"input": 0, "answer": 1, "request": 1}
        prompt_hash = CriteriaPrompt.load().hash  # recorded in the summary and in every answer
        assert first["prompt_hash"] == prompt_hash
        assert {e["prompt_hash"] for e in jsonl(out / ANSWERS)} == {prompt_hash}
        answered = dict(stub.answers)
        # the rerun asks the vote whose requests failed, and nothing else: the answer reject is
        # an answer too (its raw text is kept), and asking again would pay again
        assert run(capsys, *args)[0] == 0
        second = json.loads((out / "summary.json").read_text())
        assert (second["asked"], second["cached_before"]) == (1, 3)
        assert stub.answers["q-down-then-up"] == 1
        assert {q: n for q, n in stub.answers.items() if q != "q-down-then-up"} == \
            {q: n for q, n in answered.items() if q != "q-down-then-up"}
        assert second["written"] == 3 and second["rejected_by_stage"]["answer"] == 1
        # another model is another key: asked again
        args[args.index("stub")] = "other-model"
        assert run(capsys, *args)[0] == 0
        assert json.loads((out / "summary.json").read_text())["asked"] == 4
    assert len(jsonl(out / ANSWERS)) == 4 + 4  # both models' answers are kept


def test_an_endpoint_that_refuses_every_request_stops_the_run(tmp_path, capsys, monkeypatch):
    votes = votes_csv(tmp_path / "votes.csv", ["q1", "q2", "q3"])
    with StubLLM(api_key="sk-test") as stub:
        monkeypatch.delenv("OPENAI_API_KEY", raising=False)
        code, _, stderr = run(capsys, "criteria", votes, tmp_path / "out", "--base-url", stub.url, *FAST)
        assert code == 2
        # a line of stderr, not all of it: the stub's server threads share this process's stderr
        assert (f"crm-data criteria: {stub.url} refused the request (Error code: 401 - Incorrect API "
                "key provided): check OPENAI_API_KEY, --base-url and --model") in stderr.splitlines()
        assert sum(stub.answers.values()) == 0
        monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
        assert run(capsys, "criteria", votes, tmp_path / "out", "--base-url", stub.url, *FAST)[0] == 0


def test_the_cache_cuts_a_torn_last_line_and_refuses_a_damaged_one(tmp_path):
    path = tmp_path / ANSWERS
    entry = {"id": "1", "vote_hash": "h", "prompt_hash": "p", "model": "m", "a_criteria": ["x"]}
    path.write_text(json.dumps(entry) + "\n" + '{"id": "2", "vote_h')  # killed mid-write
    cache = AnswerCache(path)
    cache.add({**entry, "id": "3"})
    cache.close()
    assert [e["id"] for e in jsonl(path)] == ["1", "3"]
    assert AnswerCache(path).get(("3", "h", "p", "m"))["a_criteria"] == ["x"]
    path.write_text(json.dumps(entry) + "\nnot json\n" + json.dumps(entry) + "\n")
    with pytest.raises(ValueError, match=f"{ANSWERS}:2: not an answer line; the cache is damaged"):
        AnswerCache(path)


# ---------------------------------------------------------------------------------------------
# kill -9 and resume


def test_kill_9_then_rerun_writes_every_vote_once_and_pays_for_none_twice(tmp_path):
    n = 240
    queries = [f"question {i}: what is {i} squared?" for i in range(n)]
    votes = votes_csv(tmp_path / "votes.csv", queries)
    out = tmp_path / "out"
    script = Path(sys.executable).with_name("crm-data")
    with StubLLM(latency=0.02) as stub:
        cmd = [str(script), "criteria", str(votes), str(out), "--base-url", stub.url, *FAST[:-2],
               "--no-topics"]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        cache = out / ANSWERS
        deadline = time.monotonic() + 60
        while not (cache.exists() and cache.read_bytes().count(b"\n") >= n // 4):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no answers within a minute"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        answered_at_kill = dict(stub.answers)
        reopened = AnswerCache(cache)  # cuts a torn last line, as the rerun will
        saved = [e["id"] for e in reopened.entries.values()]
        reopened.close()
        assert n // 4 <= len(saved) < n, "killed after the end"
        assert not (out / "train.jsonl").exists()

        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
    rows = [r for r in jsonl(out / "train.jsonl") if not r["idx"].endswith(":tie")]
    assert sorted(int(r["idx"]) for r in rows) == list(range(n))  # every vote, once
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["read"], summary["written"], summary["rejected"]) == (n, n, 0)
    assert summary["cached_before"] == len(saved) and summary["asked"] == n - len(saved)
    # no vote whose answer was saved before the kill was asked again
    for vote_id in saved:
        q = queries[int(vote_id)]
        assert stub.answers[q] == answered_at_kill[q] == 1, q
    # answers in flight at the kill (sent, not yet saved) are the only ones paid twice
    paid_twice = [q for q, count in stub.answers.items() if count > 1]
    assert len(paid_twice) <= 4  # --concurrency
    assert all(stub.answers[q] >= 1 for q in queries)


# ---------------------------------------------------------------------------------------------
# each vote format round-trips to shardable training rows

ZH = "用一句话解释量子纠缠。"


def round_trip_files(tmp_path: Path) -> dict[str, tuple[Path, list[tuple]]]:
    """A file per format, with what each vote must become: (idx, winner, model_a, model_b)."""
    def msgs(*turns):
        return [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(turns)]

    def parts(*turns):
        return [{"role": ("user", "assistant")[i % 2],
                 "content": [{"type": "text", "text": t, "image": None, "mimeType": None}]}
                for i, t in enumerate(turns)]
    return {
        "55k.csv": (write_csv(tmp_path / "55k.csv", [
            arena_55k_row(1, ["Hi", "More?"], ["Hello", "Sure"], ["Hey", None], "model_b"),
            arena_55k_row(2, [ZH], ["纠缠。"], ["不知道。"], "tie")]),
            [("1", "model_b", msgs("Hi", "Hello", "More?", "Sure"), msgs("Hi", "Hey", "More?", "")),
             ("2", "tie", msgs(ZH, "纠缠。"), msgs(ZH, "不知道。"))]),
        "conversations.parquet": (write_parquet(tmp_path / "conversations.parquet", [
            {"question_id": "qa", "model_a": "x", "model_b": "y", "winner": "tie (bothbad)",
             "conversation_a": msgs("Q1", "A1"), "conversation_b": msgs("Q1", "B1"), "turn": 1}]),
            [("qa", "tie", msgs("Q1", "A1"), msgs("Q1", "B1"))]),
        "140k.jsonl": (write_jsonl(tmp_path / "140k.jsonl", [
            {"id": "c1", "model_a": "x", "model_b": "y", "winner": "model_a",
             "conversation_a": parts("Q2", "A2"), "conversation_b": parts("Q2", "B2")}]),
            [("c1", "model_a", msgs("Q2", "A2"), msgs("Q2", "B2"))]),
        "prefs.jsonl": (write_jsonl(tmp_path / "prefs.jsonl", [
            {"prompt": "Q3", "chosen": "good", "rejected": "bad"}]),
            [("row-1", "model_a", msgs("Q3", "good"), msgs("Q3", "bad"))]),
    }


def test_every_vote_format_round_trips_to_shardable_rows(tmp_path, capsys):
    # tie criteria for every vote: a tie vote's record holds them (the words the stub's default
    # draws them from are not the ZH answers': they have no spaces)
    with StubLLM(criteria=lambda q, a, b: (["Likes A"], ["Likes B"], ["Wants an answer"])) as stub:
        for name, (path, expected) in round_trip_files(tmp_path).items():
            out = tmp_path / f"out-{name}"
            code, stdout, _ = run(capsys, "criteria", path, out, "--base-url", stub.url, *FAST)
            assert code == 0, (name, stdout)
            rows = [r for r in jsonl(out / "train.jsonl") if not r["idx"].endswith(":tie")]
            assert [(r["idx"], r["human_winner"], r["model_a"], r["model_b"]) for r in rows] == expected
            assert all(r["a_criteria"] and r["b_criteria"] for r in rows)
            assert run(capsys, "shard", out / "train.jsonl", tmp_path / f"shards-{name}",
                       "--strict", "--val-fraction", "0")[0] == 0, name


def test_bad_vote_rows_are_rejected_before_any_request(tmp_path, capsys):
    good = arena_55k_row(1, ["Hi"], ["Hello"], ["Hey"], "model_a")
    votes = write_csv(tmp_path / "votes.csv", [good, {**good, "id": 2, "winner_tie": 1},
                                               {**good, "id": 1}])
    with StubLLM() as stub:
        code, stdout, _ = run(capsys, "criteria", votes, tmp_path / "out", "--base-url", stub.url,
                              *FAST, "--strict")
        assert sum(stub.requests.values()) == 1
    assert code == 1  # --strict: a reject fails the run
    rejects = jsonl(tmp_path / "out" / "rejects.jsonl")
    assert [(r["id"], r["line"], r["stage"], r["field"]) for r in rejects] == [
        ("2", 3, "input", "winner_model_a"), ("1", 4, "input", "id")]
    assert rejects[1]["reason"] == "duplicate id, first at line 2"
    assert "3 votes read = 1 written" in stdout and "2 input" in stdout
