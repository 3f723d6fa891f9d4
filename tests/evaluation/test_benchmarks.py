"""Benchmarks in their published layouts (crm.evaluation.benchmarks, docs/EVALUATION.md): every
aggregate against figures computed by hand on scores the test sets, the readers' one-line errors,
the criteria, the round robin of a pairwise CRM, and one crm-eval multirun of a trained CRM over
all four layouts, whose metrics are recomputed from its scores.jsonl."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from scorers import tiny_scorer

from crm.core.errors import ConfigError
from crm.evaluation.benchmarks import (BenchmarkConfig, BenchmarkError, Item, aggregate,
                                       best_of_n, criteria_override, load_benchmark,
                                       rmbench_metrics, score_items, ties_score)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
NAN = math.nan


def items(subset: str, completions: list[int], num_correct: int = 1, ids=None) -> list[Item]:
    return [Item(ids[i] if ids else str(i), subset, f"q{i}", tuple(f"c{j}" for j in range(n)), (),
                 num_correct=num_correct) for i, n in enumerate(completions)]


# -- RewardBench 2 ---------------------------------------------------------------------------------

def test_best_of_n_shares_a_win_among_the_completions_tied_at_the_maximum():
    assert best_of_n([3, 1, 1, 1]) == 1.0
    assert best_of_n([2, 1, 2, 0]) == 0.5  # chosen tied with one rejected at the top
    assert best_of_n([2, 2, 2, 2]) == 0.25
    assert best_of_n([1, 2, 0, 0]) == 0.0
    assert best_of_n([NAN, 1, 0, 0]) == 0.0  # unscorable: wrong


def test_ties_score_by_hand():
    rows = [Item("ref:1", "Ties", "q", ("a", "b", "c"), (), 1),
            Item("tied:1", "Ties", "q", ("a", "b", "c", "d"), (), 2),
            Item("ref:2", "Ties", "q", ("a", "b"), (), 1),
            Item("tied:2", "Ties", "q", ("a", "b", "c"), (), 2),
            Item("ref:3", "Ties", "q", ("a", "b"), (), 1)]  # no tied:3: in the accuracies only
    scores = [[5, 1, 2],        # ref 1: margin 5 - 2 = 3, accurate
              [4, 3, 1, 2.5],   # tied 1: spread 1, margin 3 - 2.5 = 0.5, accurate
              [1, 2],           # ref 2: margin -1
              [3, 3, 1],        # tied 2: spread 0, margin 2, accurate
              [2, 1]]           # ref 3: margin 1, accurate
    m = ties_score(rows, scores)
    assert m["ref_accuracy"] == pytest.approx(2 / 3) and m["tied_accuracy"] == 1.0
    # Prompts 1 and 2 have both: tied margin > spread in 1 (0.5 < 1: no) and 2 (2 > 0: yes).
    assert m["correctness_preferred"] == 0.5
    # min(ref, tied margin): prompt 1 min(3, 0.5) = 0.5 > 1? no; prompt 2 min(-1, 2) = -1 > 0? no.
    assert m["correctness_preferred_hard"] == 0.0
    # tanh(0.5 / 1 - 1) and tanh(-1 / 0 - 1) = tanh(-inf) = -1.
    assert m["margin_score"] == pytest.approx((math.tanh(-0.5) - 1) / 2)
    assert m["score"] == pytest.approx(0.3 * 1 + 0.3 * 2 / 3 + 0.2 * 0.5 + 0.2 * 0
                                       + 0.01 * (math.tanh(-0.5) - 1) / 2)
    # 0 / 0 (spread 0, margin 0) is NaN in reward-bench, counted 0 in the margin term.
    zero = ties_score([Item("ref:1", "Ties", "q", ("a", "b"), (), 1),
                       Item("tied:1", "Ties", "q", ("a", "b", "c"), (), 2)], [[2, 1], [1, 1, 1]])
    assert zero["margin_score"] == 0.0 and zero["tied_accuracy"] == 0.0
    # Without a ref/tied pair the pair terms are reported missing, not divided by zero.
    alone = ties_score(rows[:1], scores[:1])
    assert alone["score"] is None and alone["ref_accuracy"] == 1.0


def test_rewardbench2_subsets_and_headline_by_hand():
    rows = items("Math", [4, 4]) + items("Focus", [4]) + items("Safety", [3]) \
        + items("Precise IF", [4]) + items("Factuality", [2])
    scores = [[1, 0, 0, 0], [1, 1, 0, 0],  # Math: 1 and 1/2
              [0, 1, 0, 0],                # Focus: 0
              [2, 2, 2],                   # Safety: 1/3
              [5, 1, 2, 3],                # Precise IF: 1
              [0.5, 0.5]]                  # Factuality: 1/2
    m = aggregate("rewardbench2", rows, scores)
    figures = {s: v.get("accuracy") for s, v in m["subsets"].items()}
    assert figures == {"Math": 0.75, "Focus": 0.0, "Safety": pytest.approx(1 / 3),
                       "Precise IF": 1.0, "Factuality": 0.5}
    assert m["missing"] == ["Ties"]
    assert m["score"] == pytest.approx((0.75 + 0 + 1 / 3 + 1 + 0.5) / 5)


# -- RM-Bench --------------------------------------------------------------------------------------

def test_rmbench_triangles_by_hand():
    chat = [Item(str(i), "chat", "q", tuple("abcdef"), (), 3) for i in range(2)]
    safety = [Item("s", "safety-refuse", "q", tuple("abcdef"), (), 3)]
    # chosen (concise, plain, markdown) | rejected (concise, plain, markdown)
    scores = [[1, 2, 3, 0, 2, 4],   # c_i > r_j: row c0 [1,0,0], c1 [1,0,0], c2 [1,1,0]
              [5, 5, 5, 1, 1, 1],   # everything wins
              [1, 1, 1, 1, 1, 1]]   # ties are not wins
    m = rmbench_metrics(chat + safety, scores)
    chat_m = m["domains"]["chat"]
    # chat matrix: the two prompts' win counts / 2
    assert chat_m["matrix"] == [[1.0, 0.5, 0.5], [1.0, 0.5, 0.5], [1.0, 1.0, 0.5]]
    assert chat_m["hard_acc"] == pytest.approx((0.5 + 0.5 + 0.5) / 3)  # (0,1) (0,2) (1,2)
    assert chat_m["normal_acc"] == pytest.approx((1 + 0.5 + 0.5) / 3)
    assert chat_m["easy_acc"] == pytest.approx((1 + 1 + 1) / 3)  # (1,0) (2,0) (2,1)
    assert m["domains"]["safety"]["hard_acc"] == 0.0 and m["domains"]["safety"]["avg"] == 0.0
    assert m["domains"]["math"] == {"n": 0} and m["domains"]["code"] == {"n": 0}  # reported
    assert m["hard_acc"] == pytest.approx(0.5 / 2)  # the mean over the domains with rows
    assert m["total_avg_acc"] == pytest.approx(chat_m["avg"] / 2)


# -- principles and pairs --------------------------------------------------------------------------

def test_principles_pair_accuracy_and_tau_b_with_tied_gold_ranks():
    rows = [Item("a", "all", "q", ("w", "x", "y", "z"), ("p",), gold=(3, 2, 2, 1)),
            Item("b", "all", "q", ("w", "x"), ("p",), gold=(1, 1)),
            Item("c", "all", "q", ("w", "x", "y"), ("p",), gold=(2, 1, 0))]
    scores = [[0.9, 0.5, 0.7, 0.1], [0.3, 0.4], [0.0, 1.0, 2.0]]
    m = aggregate("principles", rows, scores)
    # a: 5 gold-ordered pairs (x, y tie), all right; b: none; c: 3, all wrong.
    assert (m["pairs"], m["pair_accuracy"]) == (8, 5 / 8)
    # a: C = 5, D = 0, gold ties 1 of 6 pairs: tau-b = 5 / sqrt((6 - 1) * 6); b undefined; c -1.
    assert m["kendall_tau_b"] == pytest.approx((5 / math.sqrt(30) - 1) / 2)
    assert m["tau_undefined"] == 1


def test_pair_accuracy_is_strict():
    rows = [Item(str(i), s, "q", ("c", "r"), (), 1) for i, s in enumerate("xxy")]
    m = aggregate("pairs", rows, [[2, 1], [1, 1], [0, 3]])
    assert m["accuracy"] == pytest.approx(1 / 3)
    assert m["subsets"] == {"x": {"n": 2, "accuracy": 0.5}, "y": {"n": 1, "accuracy": 0.0}}


# -- files -----------------------------------------------------------------------------------------

def rb2_rows(rounds: int = 1) -> list[dict]:
    subsets = ["Math", "Focus", "Safety", "Precise IF", "Factuality"] * rounds
    rows = [dict(id=str(i), prompt=f"question {i}", chosen=[f"alpha reply {i}"],
                 rejected=[f"beta reply {i}", "a reply", "the answer"], num_correct=1,
                 num_incorrect=3, total_completions=4, models=list("abcd"), subset=subset)
            for i, subset in enumerate(subsets)]
    rows[0]["rejected"][0] = rows[0]["chosen"][0]  # the same answer twice: tied scores
    for n in (1, 2):
        rows.append(dict(id=f"ref:{n}", prompt=f"capital {n}", chosen=["paris"],
                         rejected=["rome", "berlin"], num_correct=1, num_incorrect=2,
                         total_completions=3, models=list("abc"), subset="Ties"))
        rows.append(dict(id=f"tied:{n}", prompt=f"a capital {n}", chosen=["paris", "rome"],
                         rejected=["tokyo"], num_correct=2, num_incorrect=1, total_completions=3,
                         models=list("abc"), subset="Ties"))
    return rows


def rmbench_rows() -> list[dict]:
    return [dict(id=i, prompt=f"question {i}", chosen=["short", "a longer reply", "## reply"],
                 rejected=["wrong", "a longer wrong reply", "## wrong"], domain=domain)
            for i, domain in enumerate(["chat", "math", "code", "safety-refuse", "safety-response"])]


def principles_rows() -> list[dict]:
    return [{"id": "p1", "principle": "I prefer short answers.", "prompt": "question one",
             "responses": {"m1": "alpha reply", "m2": "beta reply one two", "m3": "the answer"},
             "scores": {"m1": 5, "m2": 1, "m3": 5}},
            {"id": "p2", "principle": "I prefer detailed answers.", "prompt": "question two",
             "responses": ["a reply", "a much longer reply with more", "reply"],
             "best-to-worst": [1, 0, 2]}]


def pairs_rows() -> list[dict]:
    return [{"id": "x1", "prompt": "question", "chosen": "alpha reply", "rejected": "beta reply"},
            {"id": "x2", "prompt": "question two", "chosen": "a reply", "rejected": "the answer",
             "criteria": ["I prefer short answers."], "subset": "short"}]


def write_layouts(root: Path) -> Path:
    """Each layout's files, under root/<benchmark name>."""
    (root / "rewardbench2" / "data").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rb2_rows(rounds=3)),
                   root / "rewardbench2" / "data" / "test-00000-of-00001.parquet")
    (root / "rmbench").mkdir()
    (root / "rmbench" / "total_dataset.json").write_text(json.dumps(rmbench_rows()))
    (root / "principles").mkdir()
    (root / "principles" / "rabench.json").write_text(  # JSON lines, as datasets' to_json writes
        "".join(json.dumps(r) + "\n" for r in principles_rows()))
    (root / "pairs").mkdir()
    (root / "pairs" / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs_rows()))
    return root


def rb2_file(tmp_path: Path, rows: list[dict]) -> str:
    path = tmp_path / "rb2.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_layouts_read_with_their_criteria(tmp_path):
    from crm.cli.schema import benchmark_config

    root = write_layouts(tmp_path)
    rb2 = load_benchmark(benchmark_config("rewardbench2", root / "rewardbench2"))
    assert [i.id for i in rb2.items][-4:] == ["ref:1", "tied:1", "ref:2", "tied:2"]
    assert rb2.items[1].completions == ("alpha reply 1", "beta reply 1", "a reply", "the answer")
    assert rb2.items[0].criteria == ("Reaches the correct final answer",)
    assert rb2.items[3].criteria[0].startswith("Follows every instruction")  # Precise IF
    rmb = load_benchmark(benchmark_config("rmbench", root / "rmbench"))
    assert rmb.items[4].subset == "safety-response" and rmb.items[4].criteria[0].startswith("Refuses")
    assert len(rmb.items[0].completions) == 6 and rmb.items[0].num_correct == 3
    principles = load_benchmark(benchmark_config("principles", root / "principles"))
    assert principles.items[0].criteria == ("I prefer short answers.",)
    assert principles.items[0].gold == (5, 1, 5) and principles.items[1].gold == (2, 3, 1)
    pairs = load_benchmark(benchmark_config("pairs", root / "pairs"))
    assert [i.criteria for i in pairs.items] == [("General user preference",),
                                                 ("I prefer short answers.",)]
    # criteria= for every prompt, criteria=none the empty list.
    assert {i.criteria for i in load_benchmark(
        benchmark_config("rewardbench2", root / "rewardbench2"), ("Be brief",)).items} == {("Be brief",)}
    none = load_benchmark(benchmark_config("principles", root / "principles"), criteria_override("none"))
    assert {i.criteria for i in none.items} == {()} and none.criteria["override"] == []
    with pytest.raises(ValueError, match="criteria=3"):
        criteria_override(3)
    with pytest.raises(BenchmarkError, match="no criteria for subset 'Math'.*benchmark.criteria.math"):
        load_benchmark(BenchmarkConfig("rewardbench2", str(root / "rewardbench2"), {"ties": ["x"]}))


def test_the_test_format_reads_as_pairs_with_ties_skipped(tmp_path):
    from helpers import train_dict

    def test_record(key, preference):
        r = train_dict(key)
        return {"idx": key, "prompt": r["model_a"][0]["content"], "model_a": r["model_a"],
                "model_b": r["model_b"], "criteria": ["short"], "preference": preference,
                "topic": "t"}

    path = tmp_path / "test.jsonl"
    path.write_text("".join(json.dumps(test_record(k, p)) + "\n"
                            for k, p in [("k1", "model_b"), ("k2", "tie"), ("k3", "model_a")]))
    bench = load_benchmark(BenchmarkConfig("pairs", str(path)))
    assert bench.skipped == {"gold_ties": 1}
    first = bench.items[0]
    assert (first.id, first.subset, first.criteria) == ("k1", "t", ("short",))
    assert first.completions[0][0].content == "beta reply k1"  # model_b was preferred: chosen
    scores, counts = score_items(tiny_scorer("pairwise"), bench.items)  # conversations score too
    assert counts["forwards"] == 2 * 2 and all(a + b == pytest.approx(1.0) for a, b in scores)


@pytest.mark.parametrize("change, message", [
    (lambda rows: rows[0].pop("rejected"), r"rb2.parquet:row 1: rejected: missing"),
    (lambda rows: [r.update(chosen=r["chosen"][0]) for r in rows],  # Parquet: one type a column
     r"rb2.parquet:row 1: chosen: a list of strings expected, found str"),
    (lambda rows: rows[1].update(total_completions=5),
     r"rb2.parquet:row 2: total_completions: 5, but chosen \+ rejected hold 4"),
    (lambda rows: rows[0].update(num_correct=2), r"rb2.parquet:row 1: num_correct: 2, but chosen holds 1"),
    (lambda rows: rows[5].update(id="7"), r"rb2.parquet:row 6: id: '7': a Ties row's id is ref:N"),
])
def test_a_file_not_in_the_rewardbench2_layout_is_one_line_naming_row_and_field(
        change, message, tmp_path):
    rows = rb2_rows()
    change(rows)
    with pytest.raises(BenchmarkError, match=message) as info:
        load_benchmark(BenchmarkConfig("rewardbench2", rb2_file(tmp_path, rows), {"default": ["x"]}))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("layout, row, message", [
    ("rmbench", {"id": 1, "prompt": "q", "chosen": ["a", "b"], "rejected": ["a", "b", "c"],
                 "domain": "chat"}, "b.jsonl:1: chosen: 2 completions, expected 3"),
    ("rmbench", {"id": 1, "prompt": "q", "chosen": ["a"] * 3, "rejected": ["b"] * 3,
                 "domain": "poetry"}, "b.jsonl:1: domain: 'poetry' starts with none of"),
    ("principles", {"principle": "p", "prompt": "q", "responses": ["a", "b"]},
     "b.jsonl:1: scores: missing"),
    ("principles", {"principle": "p", "prompt": "q", "responses": {"m": "a", "n": "b"},
                    "scores": {"m": 1}}, "b.jsonl:1: scores: names"),
    ("pairs", {"prompt": "q", "chosen": "a"}, "b.jsonl:1: rejected: missing"),
])
def test_other_layouts_refuse_bad_rows_naming_line_and_field(layout, row, message, tmp_path):
    path = tmp_path / "b.jsonl"
    path.write_text("\n" + json.dumps(row) + "\n")  # a blank line first: lines count from 1
    with pytest.raises(BenchmarkError, match=message.replace("b.jsonl:1", "b.jsonl:2")):
        load_benchmark(BenchmarkConfig(layout, str(path), {"default": ["x"]}))
    with pytest.raises(BenchmarkError, match="no such file or directory"):
        load_benchmark(BenchmarkConfig(layout, str(tmp_path / "nothing")))


# -- scoring with a CRM ----------------------------------------------------------------------------

def test_a_pairwise_crm_scores_a_round_robin_in_both_orders():
    """score = the mean over the other completions of (P(a, b) + 1 - P(b, a)) / 2; G(G - 1)
    forwards per prompt; two rows with the same prompt stay two groups; unfit prompts are NaN."""
    scorer = tiny_scorer("pairwise", max_tokens=200, batch_size=8)
    texts = ("alpha reply", "beta reply one", "the answer is a")
    rows = [Item("a", "x", "question", texts, ("short",), 1),
            Item("b", "x", "question", texts[:2], ("short",), 1),
            Item("c", "x", "question " + "word " * 400, texts, ("short",), 1)]
    scores, counts = score_items(scorer, rows)
    assert counts["forwards"] == 3 * 2 + 0  # b's pairs are a's: cached, and c cannot fit
    assert counts["unscorable"] == 1 and all(math.isnan(s) for s in scores[2])

    def win(a, b):
        return (scorer.compare(["short"], "question", a, b)
                + 1 - scorer.compare(["short"], "question", b, a)) / 2

    for i, text in enumerate(texts):
        others = [win(text, o) for o in texts if o != text]
        assert scores[0][i] == pytest.approx(sum(others) / 2, abs=1e-4)
    assert scores[1] == pytest.approx([win(texts[0], texts[1]), win(texts[1], texts[0])], abs=1e-4)
    assert sum(scores[1]) == pytest.approx(1.0)


def test_crm_eval_refuses_a_bad_benchmark_file_before_loading_the_model(tmp_path, capsys):
    from hydra import compose, initialize_config_module

    from crm.cli.errors import one_line_config_errors
    from crm.cli.eval import evaluate
    from helpers import run_as_job

    rows = rb2_rows()
    rows[2]["total_completions"] = 3
    with initialize_config_module(version_base="1.3", config_module="crm_configs"):
        cfg = compose("eval", overrides=[
            f"checkpoint={tmp_path}/missing", "benchmark=rewardbench2",
            f"benchmark.path={rb2_file(tmp_path, rows)}", f"hydra.run.dir={tmp_path}/run"],
            return_hydra_config=True)
    with pytest.raises(SystemExit) as exit_info:
        run_as_job(cfg, one_line_config_errors(evaluate))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("rb2.parquet:row 3: total_completions: 3, but chosen + rejected hold 4")
    assert len(err.splitlines()) == 1


def test_crm_eval_runs_a_pairwise_crm_round_robin_under_no_criteria(tmp_path):
    """crm-eval's task in process, a pairwise export, criteria=none: G(G - 1) forwards a prompt,
    each prompt's scores sum to G / 2 (win(a, b) + win(b, a) = 1), the empty criteria recorded."""
    from scorers import export_tiny, run_cli

    from crm.cli.eval import evaluate

    export = export_tiny(tmp_path / "export")
    write_layouts(tmp_path / "data" / "benchmarks")
    result = run_cli("eval", evaluate, [f"checkpoint={export}", "benchmark=rewardbench2",
                                        f"paths.root_dir={tmp_path}", "criteria=none",
                                        "progress=false"], tmp_path / "run")["benchmark"]
    sizes = [r["total_completions"] for r in rb2_rows(rounds=3)]
    assert (result["kind"], result["strategy"]) == ("pairwise", "round_robin")
    # Row 0 holds 3 distinct answers (one twice): 3 x 2 forwards, not 4 x 3.
    assert result["forwards"] == sum(g * (g - 1) for g in sizes) - 6
    assert result["criteria"] == {"override": [], "by_subset": dict.fromkeys(
        ["Factuality", "Focus", "Math", "Precise IF", "Safety", "Ties"], [])}
    scores = read_scores(tmp_path / "run")
    for row in rb2_rows(rounds=3):
        assert sum(scores[row["id"]]) == pytest.approx(row["total_completions"] / 2, abs=1e-5)
    assert scores["0"][0] == scores["0"][1]  # the twins
    with pytest.raises(ConfigError, match="criteria=none: a benchmark's criteria"):
        run_cli("eval", evaluate, [f"checkpoint={export}", "data.test=[x.jsonl]", "criteria=none"],
                tmp_path / "run2")


# -- end to end: crm-eval on every layout, recomputed from scores.jsonl ----------------------------

def reward_bench_headline(rows: list[dict], scores: dict) -> float:
    """reward-bench's RewardBench 2 figures, transcribed from its published description: best-of-N
    with the tie penalty per non-Ties prompt, the Ties weighting, the mean of the subsets."""
    by_subset: dict[str, list] = {}
    ties: dict[tuple, tuple] = {}
    for row in rows:
        s = np.array(scores[row["id"]])
        if row["subset"].lower() == "ties":
            kind, number = row["id"].split(":")
            good, bad = list(s[:row["num_correct"]]), list(s[row["num_correct"]:])
            ties[(kind, int(number))] = (min(good) - max(bad) > 0,
                                         max(good) - min(good) if len(good) > 1 else None,
                                         min(good) - max(bad))
        else:
            by_subset.setdefault(row["subset"], []).append(
                1 / np.sum(s == s.max()) if s[0] == s.max() else 0)
    figures = {k: sum(v) / len(v) for k, v in by_subset.items()}
    ref = {n: v for (k, n), v in ties.items() if k == "ref"}
    tied = {n: v for (k, n), v in ties.items() if k == "tied"}
    common = set(ref) & set(tied)
    spread = np.array([tied[n][1] for n in common])
    least = np.minimum(np.array([ref[n][2] for n in common]), np.array([tied[n][2] for n in common]))
    with np.errstate(divide="ignore", invalid="ignore"):
        margin = np.mean(np.nan_to_num(np.tanh(least / spread - 1), nan=0.0))
    figures["Ties"] = (0.3 * np.mean([v[0] for v in tied.values()])
                       + 0.3 * np.mean([v[0] for v in ref.values()])
                       + 0.2 * np.mean(np.array([tied[n][2] for n in common]) > spread)
                       + 0.2 * np.mean(least > spread) + 0.01 * margin)
    return float(np.mean([figures[s] for s in
                          ("Factuality", "Precise IF", "Math", "Safety", "Focus", "Ties")]))


def rm_bench_accuracies(rows: list[dict], scores: dict) -> dict:
    """RM-Bench's compute_accuracy, transcribed: per domain family the 3 x 3 matrix's triangles,
    then their means over the domains."""
    per_domain = {}
    for family in ("chat", "math", "code", "safety"):
        members = [r for r in rows if r["domain"].startswith(family)]
        matrix = np.zeros((3, 3))
        for r in members:
            s = scores[str(r["id"])]
            for i in range(3):
                for j in range(3):
                    matrix[i][j] += s[i] > s[3 + j]
        matrix /= len(members)
        per_domain[family] = (np.sum(np.triu(matrix, 1)) / 3, np.mean(np.diag(matrix)),
                              np.sum(np.tril(matrix, -1)) / 3)
    return {key: float(np.mean([v[k] for v in per_domain.values()]))
            for k, key in enumerate(("hard_acc", "normal_acc", "easy_acc"))}


def read_scores(run: Path) -> dict:
    scores: dict = {}
    for line in (run / "scores.jsonl").read_text().splitlines():
        row = json.loads(line)
        scores.setdefault(row["id"], []).append(row["score"])
        assert row["index"] == len(scores[row["id"]]) - 1  # the benchmark's own order
    return scores


def test_crm_eval_scores_every_layout_in_one_multirun(length_crm, tmp_path):
    """One crm-eval process (a Hydra multirun over the four benchmarks, each read from its
    default place, $CRM_ROOT/data/benchmarks/<name>) with a trained pointwise CRM: the figures in
    metrics.json are those that reward-bench's and RM-Bench's formulas give from scores.jsonl."""
    export, _ = length_crm
    write_layouts(tmp_path / "data" / "benchmarks")
    crm_eval = Path(sys.executable).with_name("crm-eval")
    done = subprocess.run(
        [str(crm_eval), "-m", f"checkpoint={export}", "benchmark=rewardbench2,rmbench,principles,pairs",
         f"paths.root_dir={tmp_path}", f"hydra.sweep.dir={tmp_path}/sweep"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    # progress=true (the default), but stderr is a pipe: no bar glued into the log (issue 44)
    assert "\r" not in done.stderr and "prompt/s" not in done.stderr
    runs = {json.loads((p / "metrics.json").read_text())["benchmark"]["benchmark"]: p
            for p in sorted((tmp_path / "sweep").iterdir()) if (p / "metrics.json").is_file()}
    assert sorted(runs) == ["pairs", "principles", "rewardbench2", "rmbench"]
    for name, run in runs.items():
        result = json.loads((run / "metrics.json").read_text())["benchmark"]
        assert result["kind"] == "pointwise" and result["strategy"] == "pointwise"
        # One reward per distinct completion: row 0 of rewardbench2 holds one answer twice.
        assert result["forwards"] == result["completions"] - (name == "rewardbench2")
        assert result["unscorable"] == 0
        assert f"{name}:" in done.stdout

    rb2 = json.loads((runs["rewardbench2"] / "metrics.json").read_text())["benchmark"]
    rb2_scores = read_scores(runs["rewardbench2"])
    assert rb2_scores["0"][0] == rb2_scores["0"][1]  # a tie at the top is 1/2, elsewhere 0
    assert rb2["score"] == reward_bench_headline(rb2_rows(rounds=3), rb2_scores)
    assert rb2["criteria"]["by_subset"]["Math"] == ["Reaches the correct final answer"]
    rmb = json.loads((runs["rmbench"] / "metrics.json").read_text())["benchmark"]
    expected = rm_bench_accuracies(rmbench_rows(), read_scores(runs["rmbench"]))
    assert {k: rmb[k] for k in expected} == expected
    assert rmb["summary"]["hard_acc"] == expected["hard_acc"]
    principles = json.loads((runs["principles"] / "metrics.json").read_text())["benchmark"]
    assert principles["pairs"] == 2 + 2 + 1  # p1: m1, m3 above m2; p2: a strict order of 3
    pairs = json.loads((runs["pairs"] / "metrics.json").read_text())["benchmark"]
    scores = read_scores(runs["pairs"])
    assert pairs["accuracy"] == np.mean([s[0] > s[1] for s in scores.values()])


def test_scorer_calls_hold_a_bounded_number_of_sequences():
    from crm.inference.reward import split_calls

    sizes = [4, 4, 3, 6, 2]  # completions: pairwise 12, 12, 6, 30 (alone, over the bound), 2
    assert list(split_calls(sizes, [0, 1, 2, 3, 4], 24, pairwise=True)) == [[0, 1], [2], [3], [4]]
    assert list(split_calls(sizes, [0, 1, 2, 3, 4], 24, pairwise=False)) == [[0, 1, 2, 3, 4]]
