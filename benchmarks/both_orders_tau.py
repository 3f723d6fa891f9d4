"""Does judging both orders cost a board its ranking? Kendall tau between contradictory boards,
one order against both (docs/EVALUATION.md section 8, issue 57 item 4).

For each CRM (an export directory) every benchmark pair is judged under each criteria set in
both orders once (the baseline in slot A, then in slot B); the boards are then made from those
probabilities by each rule below, and the Kendall tau (tau-b on the boards' competition ranks,
as `crm.evaluation.leaderboard.kendall_tau`) between the boards of two contradictory criteria
sets is reported per rule: a ranking that follows the criteria gives tau near -1. Beside it,
each board's tau with the ranking the demo's rule gives under its criteria
(crm.data.demo.rule_verdict, the demo's training label: the model wins a query when it has the
named pole and the baseline does not), the two criteria sets' mean, and that rule's own tau
between the two (what a perfect CRM would give).

Rules: `one` (slot A holds the baseline: `both_orders=false`); `both` (what `both_orders=true`
does: crm.evaluation.slot_bias.both_orders); and, for the record, the rules tried: `mean` (the
argmax of the two orders' averaged probabilities, what both_orders did before), `consistent`
(the side both orders name, else a tie: what a tie class that takes the pairs the orders split
does), `mean_p_win` (models ranked by their mean averaged P(win), no verdict). Beside the taus,
each criteria set's slot-bias measurement (`crm-leaderboard`'s 64-pair sample) and the share of
all pairs whose verdict follows the slot. `both - one` is the difference of the mean tau over
the training wordings' pairs, with a 95% percentile interval over `--resamples` resamples of the
benchmark's queries (the same resample for both rules).

    python benchmarks/both_orders_tau.py --bench .cache/demo/raw/bench.jsonl \\
        --crm demo=outputs/demo/export --out benchmarks/results/both_orders_tau.json

Criteria: the demo's pair ("detailed" against "concise", the Makefile's) and one pair per style
attribute of the demo, in its first training wording of each pole and in its first held-out
wording (words the CRM never trained on, as users write their own).
"""
from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import numpy as np
import torch
from scipy.stats import kendalltau

from crm.core.examples import LABEL_A, LABEL_B, swap, verdict
from crm.core.files import write_json
from crm.data.demo import (ATTRIBUTES, BENCH_BASELINE, HELDOUT_WORDINGS, POLES, TRAIN_WORDINGS,
                           bench_styles, rule_verdict)
from crm.evaluation.leaderboard import pairs, select
from crm.evaluation.slot_bias import both_orders, measure_slot_bias
from crm.inference.scorer import CRMScorer, unswap

DEMO_PAIR = ("make demo: detailed", ("I prefer detailed answers that cover everything.",),
             "concise", ("I prefer short, to-the-point answers.",))
RULES = ("one", "both", "mean", "consistent", "mean_p_win")


def criteria_pairs() -> list[tuple]:
    out = [DEMO_PAIR]
    for kind, wordings in (("training", TRAIN_WORDINGS), ("held-out", HELDOUT_WORDINGS)):
        for attribute in ATTRIBUTES:
            low, high = attribute.poles
            out.append((f"{kind}: {high}", (wordings[high][0],), low, (wordings[low][0],)))
    return out


def pole(label: str) -> str:
    return label.split(": ")[-1]


def scores(first: list, second: list, rule: str) -> float:
    """A pair's worth to the model under `rule`: 1 a win, 0 a tie or a loss; P(win) for
    mean_p_win."""
    if rule == "one":
        return float(verdict(first) == LABEL_B)
    mean = [(p + q) / 2 for p, q in zip(first, second)]
    if rule == "both":
        return float(both_orders(first, second)[1] == LABEL_B)
    if rule == "mean":
        return float(verdict(mean) == LABEL_B)
    if rule == "consistent":
        return float(verdict(first) == verdict(second) == LABEL_B)
    return mean[LABEL_B]


def judged(scorer, selection, criteria) -> dict:
    """(models x queries) arrays of each rule's score, the slot-bias sample and the share of
    pairs whose verdict follows the slot."""
    owners = pairs(selection, criteria)
    examples = [e for _, _, e in owners]
    first = scorer.pair_probabilities(examples, unfit="nan").tolist()
    second = unswap(scorer.pair_probabilities([swap(e) for e in examples], unfit="nan")).tolist()
    models, queries = list(selection.models), [r.idx for r in selection.records]
    arrays = {rule: np.zeros((len(models), len(queries))) for rule in RULES}
    follows = 0
    for (idx, model, _), p, q in zip(owners, first, second):
        for rule in RULES:
            arrays[rule][models.index(model), queries.index(idx)] = scores(p, q, rule)
        # the same slot in both orders: opposite sides in the first order's frame
        follows += {verdict(p), verdict(q)} == {LABEL_A, LABEL_B}
    return {"scores": arrays, "slot_bias": measure_slot_bias(scorer, examples, seed=0),
            "follow_slot_all": round(follows / len(examples), 4)}


def truth(selection, label: str, styles: dict) -> np.ndarray:
    """(models x queries) wins by the demo's rule under one pole's criteria."""
    return np.array([[float(rule_verdict(styles[m][q], styles[BENCH_BASELINE][q],
                                         [POLES[pole(label)]]) == "model_a")
                      for q in range(len(selection.records))] for m in selection.models])


def ranks(rates: np.ndarray) -> list[int]:
    """Competition ranks, as the boards give them ("1, 2, 2, 4")."""
    return [1 + int((rates > r).sum()) for r in rates]


def tau(a: np.ndarray, b: np.ndarray) -> float:
    ra, rb = ranks(a), ranks(b)
    if len(set(ra)) < 2 or len(set(rb)) < 2:
        return float("nan")
    return float(kendalltau(ra, rb)[0])


def measure(name: str, export: str, bench: str, batch_size: int, resamples: int) -> dict:
    started = time.perf_counter()
    scorer = CRMScorer.load(export, batch_size=batch_size)
    selection = select(bench, "baseline")
    styles = bench_styles(n=len(selection.records))  # the demo bench's (write_demo's seed 0)
    cache, result = {}, {"crm": name, "export": export, "kind": scorer.kind, "pairs": []}
    for label_a, crit_a, label_b, crit_b in criteria_pairs():
        for crit in (crit_a, crit_b):
            if crit not in cache:
                cache[crit] = judged(scorer, selection, crit)
        ja, jb = cache[crit_a], cache[crit_b]
        ta, tb = truth(selection, label_a, styles), truth(selection, label_b, styles)
        result["pairs"].append({
            "criteria": [label_a, label_b],
            "tau": {r: round(tau(ja["scores"][r].mean(1), jb["scores"][r].mean(1)), 4)
                    for r in RULES},
            "tau_to_rule": {r: round((tau(ja["scores"][r].mean(1), ta.mean(1))
                                      + tau(jb["scores"][r].mean(1), tb.mean(1))) / 2, 4)
                            for r in RULES},
            "tau_of_the_rule": round(tau(ta.mean(1), tb.mean(1)), 4),
            "slot_bias": [j["slot_bias"] and j["slot_bias"]["rate"] for j in (ja, jb)],
            "follow_slot_all": [j["follow_slot_all"] for j in (ja, jb)],
            "_scores": (ja["scores"], jb["scores"])})
        print(f"{name} {label_a}/{label_b}: "
              + " ".join(f"{r}={t}" for r, t in result["pairs"][-1]["tau"].items()), flush=True)
    for kind in ("training", "held-out"):
        chosen = [p for p in result["pairs"] if p["criteria"][0].startswith(kind)]
        for key in ("tau", "tau_to_rule"):
            result[f"mean_{key}_{kind}"] = {
                r: round(float(np.nanmean([p[key][r] for p in chosen])), 4) for r in RULES}
    result["both_minus_one_training"] = difference(
        [p for p in result["pairs"] if p["criteria"][0].startswith("training")], resamples)
    for p in result["pairs"]:
        del p["_scores"]
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def difference(chosen: list[dict], resamples: int) -> dict:
    """The mean tau over `chosen` pairs, both orders minus one, and its 95% percentile interval
    over resamples of the queries."""
    def mean_tau(rule: str, q: np.ndarray) -> float:
        return float(np.nanmean([tau(a[rule][:, q].mean(1), b[rule][:, q].mean(1))
                                 for a, b in (p["_scores"] for p in chosen)]))

    n = chosen[0]["_scores"][0]["one"].shape[1]
    every = np.arange(n)
    rng = np.random.default_rng(0)
    draws = []
    for _ in range(resamples):
        q = rng.integers(0, n, n)
        draws.append(mean_tau("both", q) - mean_tau("one", q))
    low, high = np.nanpercentile(draws, [2.5, 97.5])
    return {"tau": round(mean_tau("both", every) - mean_tau("one", every), 4),
            "ci95": [round(float(low), 4), round(float(high), 4)], "resamples": resamples}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bench", required=True)
    parser.add_argument("--crm", action="append", required=True, help="NAME=EXPORT_DIR")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--resamples", type=int, default=1000)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not Path(args.bench).is_file():
        parser.error(f"--bench: {args.bench}: no such file")
    for spec in args.crm:
        name, equals, export = spec.partition("=")
        if not (name and equals and export and Path(export).is_dir()):
            parser.error(f"--crm: {spec}: expected NAME=EXPORT_DIR, an existing directory")
    torch.set_num_threads(1)
    crms = [measure(*spec.split("=", 1), args.bench, args.batch_size, args.resamples)
            for spec in args.crm]
    doc = {"bench": args.bench, "machine": platform.processor() or platform.machine(),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "crms": crms}
    for c in crms:
        print(c["crm"], "demo pair:", c["pairs"][0]["tau"], "mean, training wordings:",
              c["mean_tau_training"], "to the rule:", c["mean_tau_to_rule_training"],
              "both - one:", c["both_minus_one_training"])
    if args.out:
        write_json(args.out, doc)


if __name__ == "__main__":
    main()
