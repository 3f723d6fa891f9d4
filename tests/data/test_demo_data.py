"""The embedded demo data: deterministic, valid, and labelled consistently with its criteria."""
from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from crm.core.records import load_records, read_lines
from crm.data import demo

FILES = {"train.jsonl": "train", "test/in_distribution.jsonl": "test",
         "test/heldout_topics.jsonl": "test", "test/heldout_wordings.jsonl": "test",
         "test/contradictory.jsonl": "test", "test/noisy_contradictory.jsonl": "test",
         "bench.jsonl": "bench"}
VOTED_TEST_FILES = ("test/in_distribution.jsonl", "test/heldout_topics.jsonl",
                    "test/heldout_wordings.jsonl")
SIZES = {"n_train": 1000, "n_test": 200, "n_bench": 60, "n_user": 600}


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("demo")
    counts = demo.write_demo(path, seed=0, **SIZES)
    assert counts == {"train.jsonl": 1600, "test/in_distribution.jsonl": 200,
                      "test/heldout_topics.jsonl": 200, "test/heldout_wordings.jsonl": 200,
                      "test/contradictory.jsonl": 200, "test/noisy_contradictory.jsonl": 200,
                      "bench.jsonl": 60}
    return path


def _records(out: Path, name: str) -> list:
    return load_records(out / name, FILES[name])


# ---------------------------------------------------------------------------------------------
# an independent reader of the style marks, and a judge that reads the criteria

WORDING_POLE = {text: demo.POLES[pole]
                for table in (demo.TRAIN_WORDINGS, demo.HELDOUT_WORDINGS)
                for pole, texts in table.items() for text in texts}


def _poles(text: str) -> tuple[int, ...]:
    """The pole of every attribute, read from the text alone."""
    lines = text.split("\n")
    bullets = any(line.startswith("- ") for line in lines)
    if bullets:
        opener, sentences = lines[0], [line[2:] for line in lines[1:]]
    else:
        opener, *sentences = re.split(r"(?<=[.!?])\s+", text)
    examples = sum(s.startswith(demo.EXAMPLE_MARKERS) for s in sentences)
    vivid = sum(s.startswith(demo.IMAGE_MARKERS) for s in sentences)
    cautious = sum(s.startswith(demo.CAVEAT_MARKERS) for s in sentences)
    core = len(sentences) - examples - vivid - cautious
    return (int(core >= 3), int(bullets), int(opener in demo.OPENERS[1]),
            int(examples > 0), int(vivid > 0), int(cautious > 0))


def _last_answer(conversation) -> str:
    return conversation[-1].content


def _rule_judge(criteria, model_a, model_b) -> str:
    """Majority vote of the criteria; each favours the side that shows its pole."""
    a, b = _poles(_last_answer(model_a)), _poles(_last_answer(model_b))
    votes = 0
    for text in criteria:
        attr, pole = WORDING_POLE[text]
        votes += (a[attr] == pole) - (b[attr] == pole)
    return "model_a" if votes > 0 else "model_b" if votes < 0 else "tie"


def _crowd_judge(model_a, model_b) -> str:
    """Criteria-blind: the crowd's taste, read from the texts."""
    a, b = _poles(_last_answer(model_a)), _poles(_last_answer(model_b))
    score = sum(w * ((a[attr] == fav) - (b[attr] == fav))
                for attr, (fav, w) in demo.CROWD_TASTE.items())
    return "model_a" if score > 0 else "model_b"


def _accuracy(records, judge) -> float:
    return sum(judge(r) == r.preference for r in records) / len(records)


# ---------------------------------------------------------------------------------------------
# files


def test_same_seed_same_bytes_other_seed_differs(tmp_path):
    small = {"n_train": 60, "n_test": 20, "n_bench": 10}
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        demo.write_demo(tmp_path / name, seed=seed, **small)
    for rel in FILES:
        first = (tmp_path / "a" / rel).read_bytes()
        assert first == (tmp_path / "b" / rel).read_bytes(), rel
        assert first != (tmp_path / "c" / rel).read_bytes(), rel


def test_independent_of_hash_seed(tmp_path):
    # string hashing is salted per process: a set iterated anywhere would change the output
    script = "import sys; from crm.data.demo import write_demo; write_demo(sys.argv[1], 3, 40, 10, 5)"
    for name, hash_seed in (("a", "1"), ("b", "2")):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed)
        subprocess.run([sys.executable, "-c", script, str(tmp_path / name)], env=env, check=True)
    for rel in FILES:
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes(), rel


def test_every_line_parses(out):
    for rel, fmt in FILES.items():
        lines = list(read_lines(out / rel, fmt))
        assert lines, rel
        assert [str(line.error) for line in lines if line.error] == [], rel


def test_ids_are_unique(out):
    for rel in FILES:
        ids = [r.idx for r in _records(out, rel)]
        assert len(ids) == len(set(ids)), rel


@pytest.mark.parametrize("rel", ["test/contradictory.jsonl", "test/noisy_contradictory.jsonl"])
def test_contradictory_pairs_appear_twice_with_opposite_labels(out, rel):
    groups: dict[tuple, list] = {}
    for r in _records(out, rel):
        groups.setdefault((r.prompt, r.model_a, r.model_b), []).append(r)
    assert len(groups) == SIZES["n_test"] // 2
    for twins in groups.values():
        assert len(twins) == 2
        assert {t.preference for t in twins} == {"model_a", "model_b"}
        if rel == "test/contradictory.jsonl":
            assert set(twins[0].criteria).isdisjoint(twins[1].criteria)


def test_noisy_criteria_add_distractors_to_the_clean_ones(out):
    clean = {(r.prompt, r.preference): len(r.criteria) for r in _records(out, "test/contradictory.jsonl")}
    noisy = _records(out, "test/noisy_contradictory.jsonl")
    # Another draw of pairs, so compare the distributions: every noisy list is longer than a clean
    # list of the same pair would be (at least one distractor).
    assert sum(len(r.criteria) for r in noisy) / len(noisy) > sum(clean.values()) / len(clean) + 1
    assert all(len(r.criteria) >= 2 for r in noisy)


def test_heldout_topics_and_wordings_stay_out_of_training(out):
    train = _records(out, "train.jsonl")
    assert {r.topic for r in train} == set(demo.TRAIN_TOPICS)
    assert {r.topic for r in _records(out, "test/heldout_topics.jsonl")} == set(demo.HELDOUT_TOPICS)
    heldout = {t for texts in demo.HELDOUT_WORDINGS.values() for t in texts}
    train_criteria = {c for r in train for c in r.a_criteria + r.b_criteria}
    assert train_criteria.isdisjoint(heldout)
    assert set(WORDING_POLE) - heldout >= train_criteria
    for r in _records(out, "test/heldout_wordings.jsonl"):
        assert set(r.criteria) <= heldout
    for rel in ("test/in_distribution.jsonl", "test/contradictory.jsonl"):
        assert all(set(r.criteria).isdisjoint(heldout) for r in _records(out, rel))


def test_every_pole_is_visible_in_the_text():
    rng = random.Random(0)
    for _ in range(2000):
        topic = rng.choice(demo.TOPICS)
        style = tuple(rng.randrange(2) for _ in demo.ATTRIBUTES)
        assert _poles(demo.render_response(topic, style, rng)) == style


def test_wording_tables():
    assert set(demo.TRAIN_WORDINGS) == set(demo.HELDOUT_WORDINGS) == set(demo.POLES)
    for pole in demo.POLES:
        assert len(set(demo.TRAIN_WORDINGS[pole])) >= 6
        assert len(set(demo.HELDOUT_WORDINGS[pole])) >= 2
    assert len(WORDING_POLE) == sum(len(t) for t in demo.TRAIN_WORDINGS.values()) + sum(
        len(t) for t in demo.HELDOUT_WORDINGS.values())  # no wording serves two poles


def test_criteria_match_their_topic_ids(out):
    n_seen = Counter()
    for r in _records(out, "train.jsonl"):
        assert len(r.a_criteria) == len(r.a_topics) == len(r.b_criteria) == len(r.b_topics)
        assert sorted(r.a_topics) == sorted(r.b_topics)  # one attribute set, named for each side
        for text, topic in zip(r.a_criteria + r.b_criteria, r.a_topics + r.b_topics):
            assert WORDING_POLE[text][0] == topic
        n_seen[len(r.a_criteria)] += 1
    assert {1, 2, 3, 5} <= set(n_seen)


def _shapes(out: Path) -> list[str]:
    return [json.loads(line).get("shape", "decides") for line in open(out / "train.jsonl")]


def test_each_sides_criteria_give_it_the_pair_and_a_ties_give_a_tie(out):
    # Read from the texts by the independent judge, for every record of every shape: so the
    # winner's criteria give the label, and direction=reverse (the loser's) gives a true one too.
    for r in _records(out, "train.jsonl"):
        expected = ("tie", "tie") if r.human_winner == "tie" else ("model_a", "model_b")
        assert (_rule_judge(r.a_criteria, r.model_a, r.model_b),
                _rule_judge(r.b_criteria, r.model_a, r.model_b)) == expected, r.idx


def test_user_criteria_are_drawn_apart_from_the_pair(out):
    train, shapes = _records(out, "train.jsonl"), _shapes(out)
    assert Counter(shapes)["user"] == SIZES["n_user"]
    user = [r for r, shape in zip(train, shapes) if shape == "user"]
    labels = Counter(r.human_winner for r in user)
    assert 0.3 <= labels["tie"] / len(user) <= 0.5  # unseparated pairs and even splits
    assert abs(labels["model_a"] - labels["model_b"]) < 0.1 * len(user)
    assert {len(r.a_criteria) for r in user} == {1, 2, 3}
    # mixed through the file, not appended: every shard of 1000 holds both kinds
    assert 0.2 < Counter(shapes[:len(shapes) // 2])["user"] / (len(shapes) // 2) < 0.55
    # the crowd's ties are under criteria the two sides share, the only other tie label
    assert {shape for r, shape in zip(train, shapes) if r.human_winner == "tie"} == {"user", "tie"}


def test_ties_and_multi_turn_are_present(out):
    train = [r for r, shape in zip(_records(out, "train.jsonl"), _shapes(out)) if shape != "user"]
    ties = sum(r.human_winner == "tie" for r in train) / len(train)
    multi = [r for r in train if len(r.model_a) > 2]
    assert 0.01 <= ties <= 0.06
    assert 0.02 <= len(multi) / len(train) <= 0.09
    for r in multi:
        assert len(r.model_a) == len(r.model_b) == 4
        assert r.model_a[2] == r.model_b[2]  # the same follow-up on both sides


def test_labels_are_balanced(out):
    for rel in VOTED_TEST_FILES:
        share = Counter(r.preference for r in _records(out, rel))["model_a"] / SIZES["n_test"]
        assert 0.35 <= share <= 0.65, rel


def test_bench_has_every_model_and_reversed_length_profiles(out):
    names = set(demo.BENCH_MODELS) | {demo.BENCH_BASELINE}
    bench = _records(out, "bench.jsonl")
    assert all(set(r.responses) == names for r in bench)
    assert len({r.topic for r in bench}) == len(demo.TOPICS)
    p_detailed = [p["length"] for p in demo.BENCH_MODELS.values()]
    assert len(set(p_detailed)) == len(p_detailed)
    # the realized share of detailed answers follows the profile strictly
    realized = {name: sum(_poles(_last_answer(r.responses[name]))[demo.LENGTH] for r in bench)
                for name in names}
    by_profile = sorted(demo.BENCH_MODELS, key=lambda m: demo.BENCH_MODELS[m]["length"])
    shares = [realized[m] for m in by_profile]
    assert shares == sorted(set(shares))
    assert realized[demo.BENCH_BASELINE] == len(bench) // 2


# ---------------------------------------------------------------------------------------------
# what a model can and cannot learn from it


def test_criteria_blind_judges_score_exactly_half_on_contradictory(out):
    records = _records(out, "test/contradictory.jsonl")

    def length(conversation):
        return sum(len(m.content) for m in conversation)

    blind = {
        "always model_a": lambda r: "model_a",
        "longer": lambda r: "model_a" if length(r.model_a) > length(r.model_b) else "model_b",
        "crowd taste": lambda r: _crowd_judge(r.model_a, r.model_b),
    }
    for name, judge in blind.items():
        assert _accuracy(records, judge) == 0.5, name


def test_crowd_taste_is_a_shortcut_only_in_distribution(out):
    records = _records(out, "test/in_distribution.jsonl")
    accuracy = _accuracy(records, lambda r: _crowd_judge(r.model_a, r.model_b))
    assert 0.65 <= accuracy <= 0.85


def test_labels_follow_the_criteria(out):
    judge = lambda r: _rule_judge(r.criteria, r.model_a, r.model_b)  # noqa: E731
    for rel in ("test/in_distribution.jsonl", "test/heldout_topics.jsonl",
                "test/heldout_wordings.jsonl", "test/contradictory.jsonl",
                "test/noisy_contradictory.jsonl"):
        assert _accuracy(_records(out, rel), judge) >= 0.95, rel
    # training records: test_each_sides_criteria_give_it_the_pair_and_a_ties_give_a_tie


def test_prompts_stay_short(out):
    def words(r) -> int:
        texts = list(r.criteria) + [m.content for m in r.model_a] + [m.content for m in r.model_b[1:]]
        return len(" ".join(texts).split())

    counts = [words(r) for r in _records(out, "test/in_distribution.jsonl")]
    assert 90 <= sum(counts) / len(counts) <= 180
    assert max(counts) <= 420


def test_a_cache_of_other_settings_is_regenerated(tmp_path):
    settings = demo.DemoConfig(str(tmp_path), n_train=30, n_test=4, n_bench=2, n_user=0)
    train = tmp_path / "raw" / "train.jsonl"
    demo.prepare_demo(settings)
    written = train.stat().st_mtime_ns
    demo.prepare_demo(settings)
    assert train.stat().st_mtime_ns == written  # the same settings: the cache is used
    settings.n_user = 20
    manifest = json.loads((demo.prepare_demo(settings) / "manifest.json").read_text())
    assert sum(1 for _ in open(train)) == 50
    assert manifest["counts"]["written"] == 50


def test_a_negative_size_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(ValueError, match="n_user=-3: expected a number of records >= 0"):
        demo.write_demo(tmp_path / "raw", n_user=-3)
    with pytest.raises(ValueError, match="data.demo.n_train=-1"):
        demo.DemoConfig(str(tmp_path), n_train=-1)
    assert not (tmp_path / "raw").exists()
