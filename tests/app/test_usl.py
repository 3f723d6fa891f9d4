"""crm-usl's service without a server (crm.app): cache keys and invalidation, selection by topic and
by similarity, bad input refused before any model call, the model gate, the page's rendering."""
from __future__ import annotations

import hashlib
import json
import logging
import shutil
import threading
import time
from pathlib import Path
from urllib.parse import parse_qs

import pytest
from scorers import export_tiny, tiny_scorer

from crm.app.cache import VerdictCache, Verdicts, crm_fingerprint, verdict_key
from crm.core.lru import LRU
from crm.app.service import BoardError, Busy, Leaderboards, Limits, ModelGate
from crm.app.similarity import QueryIndex
from crm.core.files import file_digest
from crm.evaluation.leaderboard import Bootstrap, Outcome, leaderboard, select

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

TOPICS = {"cooking": ["How long do I boil pasta?", "Best way to season a cast iron pan?"],
          "travel": ["What should I pack for a week in Rome?", "Cheap flights to Tokyo?"],
          "music": ["How do I tune a guitar by ear?", "Which chords start a blues song?"]}


def write_bench(path: Path) -> Path:
    lines = []
    for topic, prompts in TOPICS.items():
        for prompt in prompts:
            i = len(lines)
            lines.append({"idx": f"q{i}", "topic": topic, "prompt": prompt, "responses": {
                "base": "alpha reply " * (1 + i % 3), "m1": "beta reply",
                "m2": "the answer is alpha", "m3": "beta reply " * 4}})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def service(tmp_path, scorer=None, bench=None, cache_dir="cache", crm="crm-a", **kwargs):
    bench = bench or write_bench(tmp_path / "bench.jsonl")
    return Leaderboards(scorer or tiny_scorer(), select(bench, "base"), crm_fingerprint=crm,
                        bench_fingerprint=file_digest(bench), version="test",
                        cache=VerdictCache(tmp_path / cache_dir if cache_dir else None),
                        **kwargs)


def scored(lb: Leaderboards) -> int:
    return lb.scorer.counts["sequences"]


# -- criteria and selection -----------------------------------------------------------------------

def test_criteria_are_normalised_and_limited(tmp_path):
    lb = service(tmp_path, limits=Limits(lines=3, chars=60))
    assert lb.criteria("  be   brief \n\n\t be kind  \n") == ("be brief", "be kind")
    for text, message in [("", "No criteria"), (" \n \t\n", "No criteria"),
                          ("a\nb\nc\nd", "4 lines of criteria: at most 3"),
                          ("x" * 61, "61 characters long: at most 60")]:
        with pytest.raises(BoardError, match=message):
            lb.criteria(text)


def test_topics_must_be_known_and_not_empty(tmp_path):
    lb = service(tmp_path)
    assert lb.topic_counts == {"cooking": 2, "travel": 2, "music": 2}
    assert lb.choose(None).topics == ("cooking", "travel", "music")
    assert lb.choose(["music", "cooking"]).topics == ("cooking", "music")  # the benchmark's order
    with pytest.raises(BoardError, match="No topic selected"):
        lb.choose([])
    with pytest.raises(BoardError, match=r"Unknown topics: 'sports'\. The benchmark's topics: "
                                          r"cooking, travel, music\."):
        lb.choose(["cooking", "sports"])


def test_similarity_selects_the_closest_queries(tmp_path):
    records = select(write_bench(tmp_path / "bench.jsonl"), "base").records
    index = QueryIndex(records)
    # "pasta" and "pan" appear in the cooking queries only; the topic's name counts too
    assert [i for i, _ in index.nearest("I cook pasta in a pan", 2)] == ["q0", "q1"]
    assert [i for i, _ in index.nearest("cooking", 5)] == ["q0", "q1"]
    near = index.nearest("guitar chords for a blues song", 3)
    assert near[0][0] == "q5" and 0 < near[-1][1] <= near[0][1] <= 1
    assert index.nearest("zebra quantum", 3) == []  # no shared word: nothing, not noise
    lb = service(tmp_path)
    choice = lb.choose(["travel"], describe="I tune my guitar", k=1)  # the description wins
    assert choice.topics == ("music",) and choice.idx == {"q4"}
    with pytest.raises(BoardError, match="No benchmark query shares a word"):
        lb.choose(None, describe="zebra quantum")


# -- verdicts: scored once, cached, invalidated ---------------------------------------------------

def test_a_criteria_set_is_scored_once_and_topics_only_filter(tmp_path):
    lb = service(tmp_path)
    criteria = lb.criteria("be brief")
    full = lb.board(criteria, lb.choose(None))
    assert scored(lb) == 6 * 3 and full["examples"] == 6
    music = lb.board(criteria, lb.choose(["music"]))
    near = lb.board(criteria, lb.choose(None, describe="pasta", k=1))
    drill = lb.examples(criteria, lb.choose(["cooking", "travel"]), "m2")
    assert scored(lb) == 6 * 3  # no model call after the first board
    assert music["topics"] == ["music"] and music["examples"] == 2
    assert near["examples"] == 1 and near["similar_to"] == "pasta"
    assert {r["idx"] for r in drill} == {"q0", "q1", "q2", "q3"}
    # the drill-down: the CRM's most confident verdicts first
    confidence = [abs(r["p_win"] - 0.5) for r in drill]
    assert confidence == sorted(confidence, reverse=True)
    assert drill[0]["response"] == "the answer is alpha"
    assert {r["result"] for r in drill} <= {"win", "tie", "loss"}
    with pytest.raises(BoardError, match="Unknown model 'm9'"):
        lb.examples(criteria, lb.choose(None), "m9")


def test_the_drill_down_shows_the_tie_probability(tmp_path):
    lb = service(tmp_path, scorer=tiny_scorer(num_labels=3))  # a head with a tie class
    criteria = lb.criteria("be brief")
    drill = lb.examples(criteria, lb.choose(None), "m1")
    p_tie = {o.idx: round(o.p_tie, 4) for o in lb.verdicts(criteria) if o.model == "m1"}
    assert [r["p_tie"] for r in drill] == [p_tie[r["idx"]] for r in drill]
    assert all(0 < r["p_tie"] < 1 - r["p_win"] for r in drill)


def test_the_board_equals_crm_leaderboard_arithmetic(tmp_path):
    """Judging every topic then filtering gives leaderboard()'s rows for the selected topics."""
    lb = service(tmp_path)
    criteria = ("be brief", "be kind")
    doc = lb.board(criteria, lb.choose(["travel", "music"]))
    reference = leaderboard(tiny_scorer(), select(tmp_path / "bench.jsonl", "base",
                                                  topics=["travel", "music"]), criteria)
    assert doc["rows"] == reference["boards"][0]["rows"]
    assert doc["interval"] == reference["interval"]


def test_the_board_measures_slot_bias_and_judges_as_crm_leaderboard(tmp_path):
    """both_orders=auto and the slot sample as crm-leaderboard's defaults: the same measurement,
    the same orders, the same rows (the random tiny CRM follows the slot)."""
    from crm.app.page import info, text
    from crm.evaluation.render import slot_note

    lb = service(tmp_path, both_orders="auto", slot_sample=64)
    doc = lb.board(("be brief",), lb.choose(None))
    reference = leaderboard(tiny_scorer(), select(tmp_path / "bench.jsonl", "base"), ("be brief",),
                            both_orders="auto", slot_sample=64)["boards"][0]
    assert doc["slot_bias"]["biased"] and doc["both_orders"] is True
    assert doc["slot_bias"] == reference["slot_bias"] and doc["rows"] == reference["rows"]
    assert reference["both_orders"] is True
    assert slot_note(doc).startswith("Slot bias") and text(slot_note(doc)) in info(doc)
    again = service(tmp_path, both_orders="auto", slot_sample=64)  # from the disk cache
    assert again.board(("be brief",), again.choose(None)) == doc and scored(again) == 0


def test_contrast_gives_two_boards_and_their_kendall_tau(tmp_path):
    lb = service(tmp_path)
    versus = lb.contrast(("be brief",), ("be detailed",), lb.choose(None))
    first, second = versus["boards"]
    assert first["criteria"] == ["be brief"] and second["criteria"] == ["be detailed"]
    # the random tiny CRM: every model wins every pair under "be detailed", one rank for all;
    # Kendall tau then has no order to compare (leaderboard.kendall_tau)
    assert [[r["rank"] for r in b["rows"]] for b in versus["boards"]] == [[1, 1, 3], [1, 1, 1]]
    assert versus["kendall_tau"] == {"tau": None, "p_value": None, "models": 3,
                                     "reason": "every model tied in one ranking: no order to compare"}
    assert scored(lb) == 2 * 6 * 3


def test_a_restart_serves_from_disk_and_a_change_invalidates(tmp_path):
    criteria = ("be brief",)
    first = service(tmp_path)
    board = first.board(criteria, first.choose(None))
    # a restart (a new service over the same cache dir): no model call
    again = service(tmp_path)
    assert again.board(criteria, again.choose(None)) == board and scored(again) == 0
    # whitespace alone is not a new criteria set
    assert again.is_cached(again.criteria("  be   brief "))
    # another CRM, both_orders, dtype: not cached
    assert not service(tmp_path, crm="crm-b").is_cached(criteria)
    assert not service(tmp_path, both_orders=True).is_cached(criteria)
    assert not service(tmp_path, dtype="bfloat16").is_cached(criteria)
    # a changed benchmark: a new fingerprint, scored again
    bench = tmp_path / "bench.jsonl"
    bench.write_text(bench.read_text().replace("beta reply", "beta answer"))
    changed = service(tmp_path, bench=bench)
    assert not changed.is_cached(criteria)
    changed.board(criteria, changed.choose(None))
    assert scored(changed) == 6 * 3


def test_crm_fingerprint_follows_the_files(tmp_path):
    a = export_tiny(tmp_path / "a", seed=0)
    shutil.copytree(a, tmp_path / "copy")
    b = export_tiny(tmp_path / "b", seed=1)
    assert crm_fingerprint(a) == crm_fingerprint(tmp_path / "copy") != crm_fingerprint(b)
    meta = json.loads((tmp_path / "copy" / "crm.json").read_text())
    (tmp_path / "copy" / "crm.json").write_text(json.dumps({**meta, "max_tokens": 500}))
    assert crm_fingerprint(tmp_path / "copy") != crm_fingerprint(a)
    # a crm-train checkpoint file (it carries its tokenizer and template)
    (tmp_path / "last.ckpt").write_bytes(b"weights")
    ckpt = crm_fingerprint(tmp_path / "last.ckpt")
    (tmp_path / "last.ckpt").write_bytes(b"other weights")
    assert crm_fingerprint(tmp_path / "last.ckpt") != ckpt


def test_verdict_cache_memory_lru_disk_bound_and_damage(tmp_path, caplog):
    outcomes = Verdicts([Outcome("m1", "t", "win", 0.75, "q0", 0.05),
                         Outcome("m2", "t", "loss", 0.25, "q0")],
                        {"pairs": 2, "follow_slot": 2, "rate": 1.0, "slot": "B", "biased": True}, True)
    fields = [{"crm": "a", "criteria": [f"c{i}"]} for i in range(3)]
    cache = VerdictCache(tmp_path / "v", memory_entries=1, disk_entries=2)
    for f in fields:
        cache.put(f, outcomes)
        time.sleep(0.01)  # distinct file times
    assert len(list((tmp_path / "v").glob("*.json"))) == 2  # the oldest deleted
    assert cache.memory.get(verdict_key(fields[2])) == outcomes
    assert cache.memory.get(verdict_key(fields[1])) is None  # memory holds 1
    assert VerdictCache(tmp_path / "v").get(fields[1]) == outcomes  # from disk
    assert VerdictCache(tmp_path / "v").get(fields[0]) is None
    # a damaged file, or one whose fields differ from its key's: a miss and a warning
    path = tmp_path / "v" / f"{verdict_key(fields[2])}.json"
    path.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="crm.app"):
        assert VerdictCache(tmp_path / "v").get(fields[2]) is None
        path.write_text(json.dumps({"format": 1, "fields": fields[0], "outcomes": []}))
        assert VerdictCache(tmp_path / "v").get(fields[2]) is None
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2 and all("ignoring the cached verdicts" in w for w in warnings)
    assert "fields differ" in warnings[1]
    assert VerdictCache(None).get(fields[0]) is None  # memory only


def test_verdicts_cached_before_p_tie_was_kept_are_scored_again(tmp_path):
    """A file of cache format 1 (outcomes without P(tie)) is never found: its key was made with
    its format, so the app scores the criteria again rather than show every P(tie) as 0."""
    fields = {"crm": "a", "criteria": ["c"]}
    old_key = hashlib.sha256(json.dumps({"format": 1, **fields}, sort_keys=True,
                                        ensure_ascii=False).encode()).hexdigest()
    (tmp_path / "v").mkdir()
    (tmp_path / "v" / f"{old_key}.json").write_text(json.dumps(
        {"format": 1, "fields": fields, "outcomes": [["m1", "t", "tie", 0.3, "q0"]]}))
    assert VerdictCache(tmp_path / "v").get(fields) is None


def test_lru_forgets_the_least_recently_used():
    lru = LRU(2)
    lru.put("a", 1)
    lru.put("b", 2)
    assert lru.get("a") == 1  # now b is the least recently used
    lru.put("c", 3)
    assert (lru.get("a"), lru.get("b"), lru.get("c")) == (1, None, 3)


# -- bad input: a message, no model call ----------------------------------------------------------

def test_criteria_too_long_for_the_token_budget_are_refused_unscored(tmp_path):
    lb = service(tmp_path, scorer=tiny_scorer(max_tokens=300))
    with pytest.raises(BoardError, match=r"too long for this CRM: with them 18 of 18 benchmark "
                                         r"pairs do not fit in its 300 tokens"):
        lb.board(lb.criteria("alpha beta " * 150), lb.choose(None))
    assert scored(lb) == 0
    lb.board(lb.criteria("be brief"), lb.choose(None))  # short criteria fit
    assert scored(lb) == 18


@pytest.mark.parametrize("call", [
    lambda lb: lb.criteria(""), lambda lb: lb.criteria("x\n" * 21),
    lambda lb: lb.criteria("x" * 2001), lambda lb: lb.choose([]),
    lambda lb: lb.choose(["nope"]), lambda lb: lb.choose(None, describe="zebra"),
    lambda lb: lb.choose(None, describe="x" * 2001)])
def test_bad_input_is_refused_before_any_model_call(tmp_path, call):
    lb = service(tmp_path)
    with pytest.raises(BoardError):
        call(lb)
    assert scored(lb) == 0


# -- the model gate -------------------------------------------------------------------------------

def test_the_gate_bounds_scorings_and_waiting_then_refuses():
    gate = ModelGate(concurrency=1, waiting=1, timeout=5)
    inside, release = threading.Event(), threading.Event()
    order = []

    def hold(name):
        with gate():
            order.append(name)
            inside.set()
            release.wait(5)

    first = threading.Thread(target=hold, args=("first",))
    first.start()
    inside.wait(5)
    second = threading.Thread(target=hold, args=("second",))
    second.start()
    deadline = time.time() + 5
    while gate.admitted < 2 and time.time() < deadline:
        time.sleep(0.01)
    started = time.perf_counter()
    with pytest.raises(Busy, match="busy scoring other boards"):
        with gate():
            pass
    assert time.perf_counter() - started < 0.5  # refused at once, not after a wait
    release.set()
    first.join(5)
    second.join(5)
    assert order == ["first", "second"] and gate.admitted == 0
    with gate():  # free again
        pass
    slow = ModelGate(concurrency=1, waiting=1, timeout=0.05)
    with slow():
        with pytest.raises(Busy, match="stayed busy"):
            with slow():
                pass


def test_a_cached_board_does_not_wait_for_the_model(tmp_path):
    lb = service(tmp_path)
    lb.board(("be brief",), lb.choose(None))
    with lb.gate():  # the model busy with another board
        started = time.perf_counter()
        lb.board(("be brief",), lb.choose(["music"]))
        assert time.perf_counter() - started < 5
    # a full line refuses a new board at once
    full = service(tmp_path, gate=ModelGate(concurrency=1, waiting=0))
    with full.gate():
        with pytest.raises(Busy):
            full.board(("be kind",), full.choose(None))
    assert scored(full) == 0


# -- the page's rendering (no server) -------------------------------------------------------------

def test_page_rendering_escapes_and_links_round_trip(tmp_path):
    from crm.app.page import chart, info, link, table, text

    lb = service(tmp_path)
    evil = '<img src=x onerror="window.__xss=1"> [a](javascript:alert(1)) | *b*'
    doc = lb.board(lb.criteria(f"be brief\n{evil}"), lb.choose(["cooking", "music"]))
    frame = table(doc)
    assert list(frame.columns) == ["Rank", "Rank (UB)", "Model", "Overall (%)", "95% CI",
                                   "cooking", "music"]
    assert len(frame) == 3 and frame["Rank"].tolist() == [r["rank"] for r in doc["rows"]]
    shown = info(doc)
    assert "<img" not in shown and "[a](" not in shown and "&#60;img src&#61;x" in shown
    assert text("a<b>") == "a&#60;b&#62;"
    assert "| test | 4 | 3 | base |" in shown
    html_chart = chart(doc)
    assert html_chart.count('class="usl-row"') == 3 and "<script" not in html_chart
    query = parse_qs(link(doc["criteria"], (), doc["topics"], "", 20)[1:])
    assert query == {"criteria": [f"be brief\n{evil}"], "topics": ["cooking\nmusic"]}
    query = parse_qs(link(["c"], ["d"], [], "I cook", 7)[1:])
    assert query == {"criteria": ["c"], "contrast": ["d"], "describe": ["I cook"], "k": ["7"]}


def test_a_links_k_is_a_plain_number_or_the_default():
    from crm.app.page import DEFAULT_K, shared_k

    assert shared_k("7") == 7
    for bad in ["\u00b2", "\u0663", "9" * 5000, "-3", "1e3", "", " 7"]:
        assert shared_k(bad) == DEFAULT_K, bad


def test_the_default_board_ranks_under_the_generic_criterion(tmp_path):
    from crm.app.page import default_board

    lb = service(tmp_path, interval=Bootstrap(resamples=200))
    doc = default_board(lb)
    assert doc["criteria"] == ["General user preference"] and doc["topics"] == list(TOPICS)
    assert doc["interval"]["resamples"] == 200
    # m1 wins all 6 pairs, m2 and m3 4 of 6 each: one rank for the two
    assert [(r["model"], r["rank"], r["overall"]["wins"]) for r in doc["rows"]] == [
        ("m1", 1, 6), ("m2", 2, 4), ("m3", 2, 4)]


# -- the page served in process: Gradio's sessions ------------------------------------------------

def test_gradio_sessions_are_bounded_and_forgotten(tmp_path):
    """The page served as crm-usl serves it (launch), on a free port: an API call's own session
    is forgotten once its result is read; a queued handler is not run past the queue (Gradio's
    REST route refuses it); a handler or API the page lacks is a one-line 400 or 404; the sessions
    a page's requests name are at most serve.sessions_per_address from one address (a one-line
    429 past them, a known one still served), and one idle serve.session_age seconds is
    forgotten with what Gradio held of it.
    Gradio's own session store (its state per session) is read directly."""
    import httpx
    from helpers import free_port

    from crm.app.page import HttpLimits, build, default_board, launch

    lb = service(tmp_path)
    page = build(lb, default_board(lb))
    port = free_port()
    server = launch(page, "127.0.0.1", port, block=False,
                    limits=HttpLimits(sessions_per_address=3, session_age=1.0))
    url = f"http://127.0.0.1:{port}/gradio_api"
    queue, held = page._queue, page.state_holder.session_data

    def settles(condition) -> bool:
        """The server's thread finishes a request after its client has the answer."""
        deadline = time.monotonic() + 30
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.05)
        return condition()

    try:
        with httpx.Client(timeout=30) as http:
            for _ in range(4):
                event = http.post(f"{url}/call/rank", json={"data": ["be brief", []]})
                result = http.get(f"{url}/call/rank/{event.json()['event_id']}")
                assert "event: complete" in result.text, result.text
            assert settles(lambda: not held and not queue.pending_messages_per_session)  # kept: 4

            drill = next(f._id for f in page.fns.values() if f.name == "drill")

            def join(session: str) -> httpx.Response:
                return http.post(f"{url}/queue/join", json={
                    "data": [None, None], "fn_index": drill, "session_hash": session})

            direct = http.post(f"{url}/run/predict", json={"data": [None, None], "fn_index": drill})
            assert direct.status_code == 404 and "join the queue" in direct.text  # not past it
            for route, body, status, message in [  # Gradio: 500 and a traceback in the log
                    ("run/predict", {"data": [], "fn_index": 999}, 400, "no handler 999"),
                    ("queue/join", {"data": [], "fn_index": "x", "session_hash": "z"}, 400,
                     "no handler 'x'"),
                    ("call/nosuch", {"data": []}, 404, "no API named 'nosuch'")]:
                wrong = http.post(f"{url}/{route}", json=body)
                assert wrong.status_code == status and message in wrong.json()["detail"], wrong.text
            assert [join(f"s{i}").status_code for i in range(3)] == [200] * 3
            assert join("s0").status_code == 200  # a known session: used again
            refused = join("s3")
            assert refused.status_code == 429, refused.text
            assert "too many sessions (3 from 127.0.0.1" in refused.json()["detail"]
            assert set(held) == {"s0", "s1", "s2"}
            assert settles(lambda: not queue.event_ids_to_events)  # a running one's is kept
            time.sleep(1.2)  # idle past serve.session_age
            assert join("s3").status_code == 200
            assert set(held) == {"s3"} and set(queue.pending_messages_per_session) == {"s3"}
    finally:
        server.stop()


def test_gradios_empty_leftovers_are_removed_once_old_enough(tmp_path):
    """What Gradio leaves in its folder once it has deleted a file it kept: the file's directory,
    and its multipart parser's empty `tmp*` file; nothing newer, nothing with content."""
    import os

    from crm.app.page import remove_empty

    old = time.time() - 100
    for name in ("old-dir", "fresh-dir", "full-dir"):
        (tmp_path / name).mkdir()
    (tmp_path / "full-dir" / "leaderboard.csv").write_text("a,b\n")
    for name, text in (("tmpold", ""), ("tmpfresh", ""), ("tmpfull", "x"), ("notes", "")):
        (tmp_path / name).write_text(text)
    for name in ("old-dir", "full-dir", "tmpold", "tmpfull", "notes"):
        os.utime(tmp_path / name, (old, old))
    remove_empty(tmp_path, until=time.time() - 50)
    assert {p.name for p in tmp_path.iterdir()} == {"fresh-dir", "full-dir", "tmpfresh",
                                                    "tmpfull", "notes"}


# -- the command ----------------------------------------------------------------------------------

def test_crm_usl_serves_the_demo_by_default_and_says_how_to_make_it(tmp_path, monkeypatch):
    from hydra import compose, initialize_config_module

    from crm.cli.usl import basic_auth, check_inputs
    from crm.core.errors import ConfigError

    monkeypatch.setenv("CRM_ROOT", str(tmp_path))
    with initialize_config_module(version_base="1.3", config_module="crm_configs"):
        cfg = compose("usl")
    assert cfg.checkpoint == f"{tmp_path}/outputs/demo/export"
    assert cfg.bench == f"{tmp_path}/.cache/demo/raw/bench.jsonl"
    assert (cfg.host, cfg.baseline, cfg.torch_threads) == ("127.0.0.1", "baseline", 1)
    with pytest.raises(ConfigError, match=r"outputs/demo/export.*`make demo` makes them"):
        check_inputs(cfg)
    monkeypatch.setenv("USL_TEST_AUTH", "ann:s3:cret")
    assert basic_auth("USL_TEST_AUTH") == ("ann", "s3:cret")
    monkeypatch.setenv("USL_TEST_AUTH", "ann")
    with pytest.raises(ConfigError, match=r"\$USL_TEST_AUTH: expected user:password"):
        basic_auth("USL_TEST_AUTH")
    monkeypatch.setenv("USL_TEST_AUTH", "")
    assert basic_auth("USL_TEST_AUTH") is None


def test_an_upload_of_votes_for_other_criteria_or_another_bench_is_refused(tmp_path):
    """The page's votes carry their board: uploaded on a board under other criteria, or over
    another benchmark, they are refused in one line naming both; on their own board, kept."""
    from crm.app.calibrate import votes_text

    lb = service(tmp_path)
    brief, long = ("be brief",), ("be long",)
    lines = lb.suggestions(brief, lb.choose(["travel"]), 3)
    assert len(lines) == 3 and {line["model"] for line in lines} == {"m1", "m2", "m3"}
    votes = {(line["idx"], line["model"]): "win" for line in lines}
    path = tmp_path / "votes.jsonl"
    path.write_text(votes_text(votes, brief, lb.selection.fingerprint))
    assert lb.read_votes(str(path), brief) == votes
    with pytest.raises(BoardError, match=r"line:1: criteria: this vote was given under the "
                       r"criteria \['be brief'\]; this board's are \['be long'\]"):
        lb.read_votes(str(path), long)
    path.write_text(votes_text(votes, brief, "sha256:0000000000000000"))
    with pytest.raises(BoardError, match="given on the benchmark 'sha256:0000000000000000'; this "
                                         "board's .*bench.jsonl is 'sha256:"):
        lb.read_votes(str(path), brief)


def test_the_bootstrap_intervals_stay_until_ppi_has_its_votes(tmp_path):
    """A first vote does not take the board's intervals away: below 20 votes they stay the
    bootstrap's, each cell saying so; from 20 on they are PPI's."""
    lb = service(tmp_path)
    criteria, choice = ("be brief",), lb.choose(["cooking", "travel", "music"])
    lines = lb.suggestions(criteria, choice, 18)
    few = {(line["idx"], line["model"]): "win" for line in lines[:5]}
    doc = lb.calibrated(criteria, choice, few)
    assert doc["interval"]["method"] == "bootstrap" and doc["votes"]["used"] == 5
    overall = doc["rows"][0]["overall"]
    assert overall["ci_low"] is not None
    assert overall["interval_note"].endswith("until PPI has 20 votes: 5 so far")
