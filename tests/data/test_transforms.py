"""crm.data.transforms: direction, ties, A/B swap, criteria noise and seeding (docs/DESIGN.md section 4)."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import subprocess
import sys
from collections import Counter

import pytest

from crm.core.examples import LABEL_A, LABEL_B, LABEL_TIE, eval_example, swap
from crm.core.records import NO_TOPIC, parse_test, parse_train
from crm.data.transforms import (CriteriaPool, TransformConfig, apply_noise, check_one_sided, record_rng,
                                 tie_policy, train_example)

QUERY = "Plan a weekend in Lisbon"
LABEL_OF_SIDE = {"model_a": LABEL_A, "model_b": LABEL_B}


def record_dict(n_a: int, n_b: int, winner: str = "model_a", idx: str = "r") -> dict:
    """Side A's criteria carry topics 10.., side B's 20..: distinct per side."""
    return {
        "idx": idx,
        "topic": "travel",
        "human_winner": winner,
        "model_a": [{"role": "user", "content": QUERY}, {"role": "assistant", "content": "A: museums"},
                    {"role": "user", "content": "cheaper?"}, {"role": "assistant", "content": "A: walk"}],
        "model_b": [{"role": "user", "content": QUERY}, {"role": "assistant", "content": "B: beaches"}],
        "a_criteria": [f"{idx} a{i}" for i in range(n_a)],
        "b_criteria": [f"{idx} b{i}" for i in range(n_b)],
        "a_broad_criteria_topic": [10 + i for i in range(n_a)],
        "b_broad_criteria_topic": [20 + i for i in range(n_b)],
    }


def make_record(n_a: int, n_b: int, winner: str = "model_a", idx: str = "r"):
    return parse_train(record_dict(n_a, n_b, winner, idx))


def side_criteria(record, side):
    return record.a_criteria if side == "model_a" else record.b_criteria


def other(side):
    return "model_b" if side == "model_a" else "model_a"


def extra_pool_dicts() -> list[dict]:
    """Records whose criteria are on topics 30..39: outside both sides of make_record."""
    out = []
    for j in range(5):
        d = record_dict(0, 0, idx=f"p{j}")
        d["a_criteria"] = [f"pool {j} x", f"pool {j} y"]
        d["b_criteria"] = [f"pool {j} z"]
        d["a_broad_criteria_topic"] = [30 + j, 35 + j]
        d["b_broad_criteria_topic"] = [30 + j]
        out.append(d)
    return out


NS = (1, 2, 3, 5)
CASES = [(n, winner) for n in NS for winner in ("model_a", "model_b")]


def build(n: int, winner: str):
    """n criteria on the winning side, n + 1 on the losing side (so the sides are told apart by n)."""
    n_a, n_b = (n, n + 1) if winner == "model_a" else (n + 1, n)
    return make_record(n_a, n_b, winner, idx=f"n{n}-{winner}")


# ---------------------------------------------------------------------------------------------
# direction and swap


@pytest.mark.parametrize("n, winner", CASES)
def test_original_direction_shows_the_winners_criteria_and_label(n, winner):
    record = build(n, winner)
    cfg = TransformConfig(direction="original", swap_prob=0.0)
    for key in ("k0", "k1", "k2"):
        ex = train_example(record, key, cfg, record_rng(0, 0, key))
        assert ex.criteria == side_criteria(record, winner)
        assert ex.label == LABEL_OF_SIDE[winner]
        assert (ex.key, ex.query, ex.topic) == (key, QUERY, "travel")
        assert ex.conv_a == record.model_a[1:] and ex.conv_b == record.model_b[1:]


@pytest.mark.parametrize("n, winner", CASES)
def test_reverse_direction_shows_the_losers_criteria_and_label(n, winner):
    record = build(n, winner)
    ex = train_example(record, "k", TransformConfig(direction="reverse", swap_prob=0.0),
                       record_rng(0, 0, "k"))
    assert ex.criteria == side_criteria(record, other(winner))
    assert ex.label == LABEL_OF_SIDE[other(winner)]  # the label follows the criteria, not the vote


@pytest.mark.parametrize("winner", ("model_a", "model_b"))
def test_random_direction_is_half_and_half_and_consistent(winner):
    record = build(3, winner)
    cfg = TransformConfig(direction="random", swap_prob=0.0)
    outcomes = Counter()
    for i in range(1000):
        ex = train_example(record, f"k{i}", cfg, record_rng(7, 0, f"k{i}"))
        shown = "model_a" if ex.criteria == record.a_criteria else "model_b"
        assert ex.criteria == side_criteria(record, shown)
        assert ex.label == LABEL_OF_SIDE[shown]
        outcomes["original" if shown == winner else "reverse"] += 1
    assert 430 <= outcomes["original"] <= 570, outcomes  # ~6 sigma around 500


@pytest.mark.parametrize("direction", ("original", "reverse"))
@pytest.mark.parametrize("n, winner", CASES)
def test_swap_exchanges_conversations_and_the_label_follows(n, winner, direction):
    record = build(n, winner)
    plain = train_example(record, "k", TransformConfig(direction=direction, swap_prob=0.0),
                          record_rng(0, 0, "k"))
    swapped = train_example(record, "k", TransformConfig(direction=direction, swap_prob=1.0),
                            record_rng(0, 0, "k"))
    assert swapped.conv_a == plain.conv_b == record.model_b[1:]
    assert swapped.conv_b == plain.conv_a == record.model_a[1:]
    assert swapped.criteria == plain.criteria
    assert {plain.label, swapped.label} == {LABEL_A, LABEL_B} and plain.label != swapped.label
    # in both orders the label points at the conversation whose criteria are shown
    shown = winner if direction == "original" else other(winner)
    shown_conv = (record.model_a if shown == "model_a" else record.model_b)[1:]
    for ex in (plain, swapped):
        assert (ex.conv_a if ex.label == LABEL_A else ex.conv_b) == shown_conv


def test_swap_prob_half_swaps_some_and_keeps_the_label_on_the_shown_side():
    record = build(2, "model_a")
    cfg = TransformConfig(direction="random", swap_prob=0.5)
    swaps = 0
    for i in range(400):
        ex = train_example(record, f"k{i}", cfg, record_rng(1, 0, f"k{i}"))
        swapped = ex.conv_a == record.model_b[1:]
        swaps += swapped
        shown_conv = record.model_a[1:] if ex.criteria == record.a_criteria else record.model_b[1:]
        assert (ex.conv_a if ex.label == LABEL_A else ex.conv_b) == shown_conv
    assert 140 <= swaps <= 260


# ---------------------------------------------------------------------------------------------
# noise


def rngs(count=30):
    return [random.Random(s) for s in range(count)]


@pytest.mark.parametrize("n", range(1, 8))
def test_noise_remove_keeps_at_least_one_criterion_from_the_chosen_side(n):
    chosen = [f"c{i}" for i in range(n)]
    for rng in rngs():
        out = apply_noise(chosen, ["r0", "r1"], [99], "remove", None, rng)
        assert len(out) == max(1, n // 2)
        assert len(set(out)) == len(out) and set(out) <= set(chosen)


@pytest.mark.parametrize("n", range(1, 8))
def test_noise_remove_reference_arithmetic_keeps_floor_half(n):
    chosen = [f"c{i}" for i in range(n)]
    out = apply_noise(chosen, ["r0"], [99], "remove", None, random.Random(0), arithmetic="reference")
    assert len(out) == n // 2  # 0 for n = 1, as the reference
    assert set(out) <= set(chosen)


@pytest.mark.parametrize("n, winner", CASES)
def test_noise_remove_through_train_example(n, winner):
    record = build(n, winner)
    cfg = TransformConfig(direction="original", noise="remove", swap_prob=0.0)
    for i in range(10):
        ex = train_example(record, f"k{i}", cfg, record_rng(0, 0, f"k{i}"))
        assert len(ex.criteria) == max(1, n // 2)
        assert set(ex.criteria) <= set(side_criteria(record, winner))
        assert ex.label == LABEL_OF_SIDE[winner]


@pytest.mark.parametrize("n, winner", CASES)
def test_noise_add_appends_half_from_topics_outside_the_rejected_side(n, winner):
    record = build(n, winner)
    pool_records = [record] + [parse_train(d) for d in extra_pool_dicts()]
    pool = CriteriaPool.from_records(pool_records)
    topic_of = dict(zip(pool.criteria, pool.topics))
    chosen = side_criteria(record, winner)
    rejected_topics = record.b_topics if winner == "model_a" else record.a_topics
    cfg = TransformConfig(direction="original", noise="add", swap_prob=0.0)
    orders = set()
    for i in range(40):
        ex = train_example(record, f"k{i}", cfg, record_rng(0, 0, f"k{i}"), pool=pool)
        out = list(ex.criteria)
        assert len(out) == n + n // 2
        assert len(set(out)) == len(out)  # no duplicates at all
        assert set(chosen) <= set(out)  # the original criteria are all still there
        added = [c for c in out if c not in chosen]
        assert len(added) == n // 2
        assert all(topic_of[c] not in rejected_topics for c in added)
        assert ex.label == LABEL_OF_SIDE[winner]
        orders.add(tuple(c in chosen for c in out))
    if n >= 2:
        assert len(orders) > 1  # shuffled: the added criteria are not always at the end


def test_noise_add_draws_only_what_the_pool_has_and_needs_a_pool():
    pool = CriteriaPool(("keep me", "banned", "also banned", "mine"), (1, 2, 2, 3))
    chosen = ["mine", "c1", "c2", "c3", "c4", "c5"]  # n = 6: wants 3, only "keep me" qualifies
    for rng in rngs(10):
        out = apply_noise(chosen, ["r"], [2], "add", pool, rng)
        assert sorted(out) == sorted(chosen + ["keep me"])
    with pytest.raises(ValueError, match="pool"):
        apply_noise(chosen, ["r"], [2], "add", None, random.Random(0))


def test_noise_add_never_adds_the_same_text_twice():
    # the same criterion text may be pooled under two topics; it must be added at most once
    pool = CriteriaPool(("dup", "dup", "other"), (5, 6, 7))
    for rng in rngs(50):
        out = apply_noise(["c1", "c2", "c3", "c4"], [], [1], "add", pool, rng)
        assert len(out) == 6 and sorted(out) == ["c1", "c2", "c3", "c4", "dup", "other"]


@pytest.mark.parametrize("n", range(1, 8))
def test_noise_replace_keeps_the_chosen_side_a_strict_majority(n):
    chosen = [f"c{i}" for i in range(n)]
    rejected = [f"r{i}" for i in range(7)]
    k = (n - 1) // 2
    for rng in rngs():
        out = apply_noise(chosen, rejected, [99], "replace", None, rng)
        assert len(out) == n
        from_rejected = [c for c in out if c in rejected]
        kept = [c for c in out if c in chosen]
        assert len(from_rejected) == k and len(set(from_rejected)) == k
        assert len(kept) == n - k and 2 * len(kept) > n  # strict majority
        # replaced in place: the criteria that stay keep their positions
        assert all(out[i] == chosen[i] for i in range(n) if out[i] in chosen)


@pytest.mark.parametrize("n", range(1, 8))
def test_noise_replace_reference_arithmetic(n):
    chosen = [f"c{i}" for i in range(n)]
    rejected = [f"r{i}" for i in range(7)]
    out = apply_noise(chosen, rejected, [99], "replace", None, random.Random(n),
                      arithmetic="reference")  # n = 1 must not crash
    assert len(out) == n
    assert sum(c in rejected for c in out) == max(0, n // 2 - 1)


def test_noise_replace_with_few_rejected_criteria_replaces_what_there_is():
    out = apply_noise([f"c{i}" for i in range(7)], ["r0"], [99], "replace", None, random.Random(0))
    assert sorted(c for c in out if c.startswith("r")) == ["r0"] and len(out) == 7


@pytest.mark.parametrize("n, winner", CASES)
def test_noise_replace_through_train_example_uses_the_rejected_sides_criteria(n, winner):
    record = build(n, winner)
    cfg = TransformConfig(direction="original", noise="replace", swap_prob=0.0)
    chosen, rejected = side_criteria(record, winner), side_criteria(record, other(winner))
    for i in range(10):
        ex = train_example(record, f"k{i}", cfg, record_rng(0, 0, f"k{i}"))
        assert len(ex.criteria) == n
        assert sum(c in rejected for c in ex.criteria) == (n - 1) // 2
        assert 2 * sum(c in chosen for c in ex.criteria) > n


def test_noise_random_uses_all_four_modes():
    chosen = ["c0", "c1", "c2", "c3"]  # n = 4: none 4 kept, remove 2, add 6, replace 1 swapped
    pool = CriteriaPool(tuple(f"p{i}" for i in range(10)), tuple(range(100, 110)))
    modes = Counter()
    for rng in rngs(800):
        out = apply_noise(chosen, ["r0", "r1", "r2"], [1], "random", pool, rng)
        if out == chosen:
            modes["none"] += 1
        elif len(out) == 2 and set(out) <= set(chosen):
            modes["remove"] += 1
        elif len(out) == 6 and set(chosen) <= set(out):
            modes["add"] += 1
        else:
            assert len(out) == 4 and sum(c.startswith("r") for c in out) == 1, out
            modes["replace"] += 1
    assert set(modes) == {"none", "remove", "add", "replace"}
    assert all(130 <= count <= 270 for count in modes.values()), modes  # ~25% each


def test_unknown_noise_is_an_error():
    with pytest.raises(ValueError, match="shuffle"):
        apply_noise(["c"], [], [], "shuffle", None, random.Random(0))


# ---------------------------------------------------------------------------------------------
# ties


def test_ties_are_dropped_by_default_and_a_kept_tie_is_a_third_label():
    drop, keep = TransformConfig(), TransformConfig(ties="keep")
    assert drop.ties == "drop" and drop.num_labels == 2 and keep.num_labels == 3


def test_a_kept_tie_has_the_tie_label_and_one_sides_criteria():
    tie = make_record(2, 3, winner="tie")
    shown = Counter()
    for swap_prob in (0.0, 1.0):
        cfg = TransformConfig(ties="keep", direction="original", swap_prob=swap_prob)
        for i in range(100):
            ex = train_example(tie, f"k{i}", cfg, record_rng(0, 0, f"k{i}"))
            assert ex.label == LABEL_TIE
            assert ex.criteria in (tie.a_criteria, tie.b_criteria)
            shown[ex.criteria] += 1
    assert set(shown) == {tie.a_criteria, tie.b_criteria}


def test_auto_keeps_ties_for_a_pairwise_crm_and_drops_them_for_a_pointwise_one():
    assert tie_policy("auto", "pairwise") == "keep" and tie_policy("auto", "pointwise") == "drop"
    assert tie_policy("drop", "pairwise") == "drop" and tie_policy("keep", "pairwise") == "keep"
    with pytest.raises(ValueError, match="auto"):
        TransformConfig(ties="auto").num_labels


@pytest.mark.parametrize("noise", ["add", "remove", "replace", "random"])
@pytest.mark.parametrize("shape", ["tie", "user"])
def test_noise_leaves_criteria_that_were_not_written_for_the_pair_alone(noise, shape):
    d = record_dict(3, 3, winner="tie" if shape == "tie" else "model_a", idx=shape)
    if shape == "tie":
        d["b_criteria"], d["b_broad_criteria_topic"] = d["a_criteria"], d["a_broad_criteria_topic"]
    record = parse_train({**d, "shape": shape})
    decides = parse_train(record_dict(3, 3))
    pool = CriteriaPool.from_records([parse_train(p) for p in extra_pool_dicts()])
    cfg = TransformConfig(ties="keep", noise=noise, swap_prob=0.0)
    changed = 0
    for i in range(40):
        ex = train_example(record, f"k{i}", cfg, record_rng(0, 0, f"k{i}"), pool)
        assert ex.criteria == record.a_criteria
        changed += train_example(decides, f"k{i}", cfg, record_rng(0, 0, f"k{i}"),
                                 pool).criteria != decides.a_criteria
    assert changed  # the same noise does change criteria that decide the pair


def test_a_tie_reaching_the_transforms_under_drop_raises():
    tie = make_record(2, 2, winner="tie", idx="tie-7")
    with pytest.raises(ValueError, match="tie-7"):
        train_example(tie, "tie-7", TransformConfig(ties="drop"), record_rng(0, 0, "tie-7"))


# ---------------------------------------------------------------------------------------------
# determinism

# The child process imports this very module, so both sides run the same code.
CHILD = """
import json, sys
sys.path.insert(0, sys.argv[1])
from test_transforms import _draws_and_examples
print(json.dumps(_draws_and_examples(json.load(sys.stdin))))
"""


def _draws_and_examples(spec):
    records = [parse_train(d) for d in spec["records"]]
    pool = CriteriaPool.from_records(records)
    cfg = TransformConfig(direction="random", noise="random", swap_prob=0.5)
    out = {
        "draws": [[record_rng(s, e, k).random() for k in spec["keys"]] for s, e in spec["seeds"]],
        "examples": [],
        "pool": pool.as_dict(),
    }
    for epoch in (0, 1):
        for r in records:
            ex = train_example(r, r.idx, cfg, record_rng(42, epoch, r.idx), pool)
            out["examples"].append([list(ex.criteria), ex.label, ex.conv_a[0].content])
    return out


def test_record_rng_is_the_same_in_another_process_with_another_hash_seed():
    spec = {
        "records": [record_dict(n, n + 2, w, idx=f"rec-{n}-{w}") for n in NS
                    for w in ("model_a", "model_b")] + extra_pool_dicts(),
        "keys": ["a", "rec-1-model_a", "ünïcode key", ""],
        "seeds": [[42, 0], [42, 1], [0, 0]],
    }
    expected = _draws_and_examples(spec)
    for hash_seed in ("1", "4242"):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed)
        child = subprocess.run([sys.executable, "-c", CHILD, os.path.dirname(__file__)],
                               input=json.dumps(spec), env=env, capture_output=True, text=True,
                               timeout=60, check=True)
        assert json.loads(child.stdout) == expected


def test_record_rng_same_inputs_same_draws_and_epochs_differ():
    keys = [f"key-{i}" for i in range(20)]
    first = [record_rng(42, 0, k).random() for k in keys]
    assert first == [record_rng(42, 0, k).random() for k in keys]
    assert len(set(first)) == len(keys)  # keys get their own streams
    next_epoch = [record_rng(42, 1, k).random() for k in keys]
    other_seed = [record_rng(43, 0, k).random() for k in keys]
    assert sum(a != b for a, b in zip(first, next_epoch)) >= 15
    assert sum(a != b for a, b in zip(first, other_seed)) >= 15
    # and the transform re-draws: some record changes its example from epoch 0 to epoch 1
    cfg = TransformConfig(direction="random", noise="remove", swap_prob=0.5)
    record = build(5, "model_a")
    per_epoch = [[train_example(record, k, cfg, record_rng(42, e, k)) for k in keys] for e in (0, 1)]
    assert any(x != y for x, y in zip(*per_epoch))


# ---------------------------------------------------------------------------------------------
# the criteria pool


def test_criteria_pool_dedupes_and_keeps_topics_aligned():
    r1 = parse_train({**record_dict(0, 0, idx="x"), "a_criteria": ["clear", "short"],
                      "a_broad_criteria_topic": [1, 2], "b_criteria": ["funny"],
                      "b_broad_criteria_topic": [3]})
    r2 = parse_train({**record_dict(0, 0, idx="y"), "a_criteria": ["funny", "clear"],
                      "a_broad_criteria_topic": [3, 1], "b_criteria": ["clear", "deep"],
                      "b_broad_criteria_topic": [4, 5]})
    pool = CriteriaPool.from_records([r1, r2])
    # first appearance order; ("clear", 1) and ("funny", 3) once; ("clear", 4) is a distinct pair
    assert list(zip(pool.criteria, pool.topics)) == [
        ("clear", 1), ("short", 2), ("funny", 3), ("clear", 4), ("deep", 5)]
    assert pool.outside([1, 2]) == ["funny", "clear", "deep"]
    assert pool.outside([4], exclude=["funny"]) == ["clear", "short", "deep"]
    assert CriteriaPool.from_records([r2, r1]).topics == (3, 1, 4, 5, 2)


def test_criteria_pool_pairs_each_side_with_its_own_topics():
    # a side whose topic list is shorter than its criteria must not shift the other side's topics
    # (parse_train refuses such a line; a record built in code may still be one)
    record = dataclasses.replace(
        parse_train({**record_dict(0, 0), "a_criteria": ["a0", "a1", "a2"],
                     "a_broad_criteria_topic": [1, 2, 3], "b_criteria": ["b0", "b1"],
                     "b_broad_criteria_topic": [7, 8]}), a_topics=(1,))
    pool = CriteriaPool.from_records([record])
    assert ("b0", 7) in zip(pool.criteria, pool.topics)
    assert ("b1", 8) in zip(pool.criteria, pool.topics)
    assert ("a1", 7) not in zip(pool.criteria, pool.topics)


def test_criteria_pool_round_trips_through_a_dict_and_json():
    pool = CriteriaPool.from_records([build(n, "model_a") for n in NS])
    d = pool.as_dict()
    assert d == {"criteria": list(pool.criteria), "topics": list(pool.topics)}
    assert len(d["criteria"]) == len(d["topics"]) == sum(n + n + 1 for n in NS)
    assert CriteriaPool.from_dict(d) == pool
    assert CriteriaPool.from_dict(json.loads(json.dumps(d))) == pool


# ---------------------------------------------------------------------------------------------
# config and evaluation


@pytest.mark.parametrize("field, value", [
    ("direction", "sideways"), ("noise", "shuffle"), ("ties", "maybe"), ("arithmetic", "ref"),
    ("swap_prob", 1.5), ("swap_prob", -0.1), ("swap_prob", math.nan), ("swap_prob", "0.5"),
    ("swap_prob", None),
])
def test_transform_config_rejects_unknown_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"transform {field}="):
        TransformConfig(**{field: value})


def test_transform_config_defaults_and_valid_values():
    cfg = TransformConfig()
    assert (cfg.direction, cfg.noise, cfg.arithmetic, cfg.swap_prob, cfg.ties) == (
        "original", "none", "fixed", 0.5, "drop")
    assert TransformConfig(direction="random", noise="random", arithmetic="reference",
                           swap_prob=1, ties="keep").swap_prob == 1


@pytest.mark.parametrize("preference, label, swapped_label", [
    ("model_a", LABEL_A, LABEL_B), ("model_b", LABEL_B, LABEL_A), ("tie", LABEL_TIE, LABEL_TIE)])
def test_eval_example_swapped_exchanges_conversations_and_flips_the_label(preference, label,
                                                                         swapped_label):
    record = parse_test({
        "idx": 17, "prompt": QUERY, "topic": "travel", "preference": preference,
        "model_a": str([{"role": "user", "content": QUERY}, {"role": "assistant", "content": "A"}]),
        "model_b": [{"role": "user", "content": QUERY}, {"role": "assistant", "content": "B"}],
        "criteria": ["is cheap", "is walkable"]})
    plain, swapped = eval_example(record), eval_example(record, swapped=True)
    assert (plain.key, plain.query, plain.topic) == ("17", QUERY, "travel")
    assert plain.criteria == swapped.criteria == ("is cheap", "is walkable")
    assert [m.content for m in plain.conv_a] == ["A"] and [m.content for m in plain.conv_b] == ["B"]
    assert swapped.conv_a == plain.conv_b and swapped.conv_b == plain.conv_a
    assert (plain.label, swapped.label) == (label, swapped_label)
    assert swap(swapped) == plain


def test_direction_warmup_switches_at_the_batch_count():
    cfg = TransformConfig(direction="random", warmup_direction="reverse", warmup_batches=3)
    assert [cfg.at_batch(i).direction for i in range(5)] == ["reverse"] * 3 + ["random"] * 2
    assert cfg.at_batch(0).at_batch(0).direction == "reverse"  # warmup_batches is spent
    with pytest.raises(ValueError, match="warmup_direction"):
        TransformConfig(warmup_direction="sideways", warmup_batches=1)
    with pytest.raises(ValueError, match="warmup_batches"):
        TransformConfig(warmup_batches=-1)


# ---------------------------------------------------------------------------------------------
# README-format records (criteria + preference): one side's criteria


def readme_record(n: int, preference: str, idx: str = "rm"):
    """A README-format record with `n` criteria on a two-turn conversation pair."""
    d = record_dict(0, 0, idx=idx)
    return parse_train({"idx": idx, "prompt": QUERY, "model_a": d["model_a"], "model_b": d["model_b"],
                        "criteria": [f"{idx} c{i}" for i in range(n)], "preference": preference,
                        "topic": "travel"})


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("preference", ["model_a", "model_b"])
def test_readme_record_shows_its_criteria_and_the_label_is_the_preference(n, preference):
    record = readme_record(n, preference)
    for swap_prob in (0.0, 1.0):
        cfg = TransformConfig(direction="original", swap_prob=swap_prob)
        ex = train_example(record, "k", cfg, record_rng(0, 0, "k"))
        assert ex.criteria == tuple(f"rm c{i}" for i in range(n))
        label = LABEL_OF_SIDE[preference]
        assert ex.label == (label if swap_prob == 0 else 1 - label)
        preferred = (record.model_a if preference == "model_a" else record.model_b)[1:]
        assert (ex.conv_a if ex.label == LABEL_A else ex.conv_b) == preferred


def test_readme_tie_follows_the_tie_policy():
    tie = readme_record(2, "tie")
    with pytest.raises(ValueError, match="a tie reached the transforms"):
        train_example(tie, "k", TransformConfig(), record_rng(0, 0, "k"))
    for i in range(20):
        ex = train_example(tie, f"k{i}", TransformConfig(ties="keep"), record_rng(0, 0, f"k{i}"))
        assert ex.label == LABEL_TIE and ex.criteria == ("rm c0", "rm c1")


@pytest.mark.parametrize("cfg, field", [
    (TransformConfig(direction="reverse"), "direction='reverse'"),
    (TransformConfig(direction="random"), "direction='random'"),
    (TransformConfig(warmup_direction="reverse", warmup_batches=10), "warmup_direction='reverse'"),
    (TransformConfig(direction="random", warmup_batches=10), "direction='random'"),  # the curriculum
])
def test_directions_that_need_the_losers_criteria_are_refused_at_start(cfg, field):
    with pytest.raises(ValueError, match=rf"transform {field} shows the losing side's criteria.*"
                                         "direction=original"):
        check_one_sided(cfg)
    # and, should a record get that far, at the record
    record = readme_record(2, "model_a", idx="rm-9")
    with pytest.raises(ValueError, match="record k: direction 'reverse' needs the losing side's"):
        train_example(record, "k", TransformConfig(direction="reverse"), record_rng(0, 0, "k"))


def test_original_direction_and_every_noise_pass_the_start_check():
    for noise in ("none", "add", "remove", "replace", "random"):
        check_one_sided(TransformConfig(noise=noise))
    check_one_sided(TransformConfig(warmup_direction="reverse", warmup_batches=0))


def test_readme_criteria_join_the_pool_under_no_topic():
    records = [readme_record(2, "model_b", idx="x"), readme_record(1, "tie", idx="y"), build(1, "model_a")]
    pool = CriteriaPool.from_records(records)
    assert dict(zip(pool.criteria, pool.topics)) == {
        "x c0": NO_TOPIC, "x c1": NO_TOPIC, "y c0": NO_TOPIC,
        "n1-model_a a0": 10, "n1-model_a b0": 20, "n1-model_a b1": 21}


@pytest.mark.parametrize("n", NS)
def test_readme_noise_add_and_replace_draw_from_the_pool(n):
    record = readme_record(n, "model_a")
    others = [parse_train(d) for d in extra_pool_dicts()]
    pool = CriteriaPool.from_records([record, *others])
    foreign = {c for r in others for c in r.a_criteria + r.b_criteria}
    own = set(record.a_criteria)
    for i in range(30):
        rng = record_rng(0, 0, f"k{i}")
        add = train_example(record, f"k{i}", TransformConfig(noise="add", swap_prob=0.0), rng, pool)
        assert own <= set(add.criteria) and len(add.criteria) == n + n // 2
        assert set(add.criteria) - own <= foreign  # no topic is banned: the loser's are unknown
        rep = train_example(record, f"k{i}", TransformConfig(noise="replace", swap_prob=0.0),
                            record_rng(0, 0, f"k{i}"), pool)
        assert len(rep.criteria) == n
        replaced = [c for c in rep.criteria if c not in own]
        assert len(replaced) == (n - 1) // 2 and set(replaced) <= foreign
        rem = train_example(record, f"k{i}", TransformConfig(noise="remove", swap_prob=0.0),
                            record_rng(0, 0, f"k{i}"), pool)
        assert set(rem.criteria) <= own and len(rem.criteria) == max(1, n // 2)
        assert add.label == rep.label == rem.label == LABEL_A
    with pytest.raises(ValueError, match="'replace' of a README-format record draws from a criteria pool"):
        apply_noise(["a", "b", "c"], None, (), "replace", None, random.Random(0))
