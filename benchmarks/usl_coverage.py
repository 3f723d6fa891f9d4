"""Do the leaderboard's intervals hold for a user? Simulated users on the demo benchmark
(docs/EVALUATION.md section 7, docs/DESIGN.md section 8.3).

The demo benchmark's responses are rendered from known style attributes (crm.data.demo), so a
user whose criteria name some poles has a known verdict on every (query, model) pair against the
baseline. The rule (crm.data.demo.rule_verdict, the demo's training label for such criteria):
for each criterion's pole, a response scores 1 when it has that pole; the model wins when its
score beats the baseline's, loses when it is below. When the criteria do not tell the two apart,
two kinds of user: `even` calls it a tie; `taste` falls back on the demo's
crowd taste (crm.data.demo.CROWD_TASTE, what the demo's voters follow) over the attributes on
which the two differ, a tie only when they differ on none. Each criteria set gets `--users` users
of each kind. The user is not a rule: on each pair, with probability `--noise` (0.10), their
verdict is instead drawn uniformly from win / tie / loss, once per user and pair. A user's true
win rate for a model is then wins / pairs over all the bench's pairs.

Criteria sets: `--sets` drawn from the demo's training wordings and as many from its held-out
wordings, each naming 1-3 poles of distinct attributes. The CRM judges the bench once per
criteria set (`crm.evaluation.leaderboard.judge`); `--users` users per set each vote on the
pairs `crm-leaderboard suggest_votes` would give them (crm.evaluation.suggest, a seed per user),
for each of `--votes` (a list) and each `--strategies` (uniform, active), and their board is
`crm.evaluation.leaderboard.win_rates` with those votes (PPI). Beside it: today's
bootstrap board (no votes: the CRM taken as the user) and Wilson intervals from the votes alone.
Reported per wording kind and overall: the share of (user, model) cases whose interval holds the
true Overall win rate (and the worst model's share: each model's interval must hold for that
model), the mean width, PPI's width over the votes-only width, the share whose
rank set holds the true rank (strict: every rank the model's true win rate could hold, ties in
truth counted as the whole tied range), the share of boards whose rank sets all hold together,
and the mean rank-set size. The top level's `even_user` and `taste_user` are the first strategy
at the first vote count; `strategies` holds every (strategy, votes) with its width over
uniform's.

Beside them, why PPI is as wide as it is (docs/EVALUATION.md section 7): the CRM's agreement with
the user on the win indicator PPI uses (a tie is not a win), rho^2 (the share of the user's win
indicator's variance within a model that the CRM's P(win) explains; a model's own rectifier
then has sqrt(1 - rho^2) of its votes-only sd), PPI's intervals at the oracle tau^2 (the true
spread of the CRM's error across models, which the votes only bound), and the CRM's agreement
with the user's rule by how the criteria meet the pair (`pair_shapes`: `exact` is the paper's
training shape) and by what the rule says (`crm_verdict_agreement`: every pair, the pairs it gives
a side, and its ties: tie recall). `--synthetic-crm ERROR` replaces the CRM by the user's own rule
with its win verdict flipped on that share of the pairs: what the same estimator gives with a CRM
that fits.

    nice -n 5 python benchmarks/usl_coverage.py [--checkpoint outputs/demo/export]
        [--bench .cache/demo/raw/bench.jsonl] [--sets 20] [--users 6] [--votes 50,30,100]
        [--strategies uniform,active] [--level 0.95]
        [--noise 0.1] [--seed 0] [--threads 1] [--synthetic-crm ERROR] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np

from crm.data.demo import (ATTRIBUTES, BENCH_BASELINE, CAVEAT_MARKERS, CROWD_TASTE,
                           EXAMPLE_MARKERS, HELDOUT_WORDINGS, POLES, STRUCTURE, TRAIN_WORDINGS,
                           bench_styles, rule_verdict)
from crm.evaluation.leaderboard import (LOSS, TIE, WIN, Bootstrap, Outcome, judge, select,
                                        win_rates)
from crm.evaluation.ppi import CellData, ppi_pooled, wilson
from crm.evaluation.suggest import suggest_pairs

VERDICTS = (WIN, TIE, LOSS)
RULE = {"model_a": WIN, "model_b": LOSS, "tie": TIE}  # rule_verdict's first side is the model


def draw_criteria(rng: np.random.Generator, wordings: dict) -> tuple[list[str], list[str]]:
    """(criteria lines, the poles they name): 1-3 poles of distinct attributes."""
    k = int(rng.integers(1, 4))
    attributes = rng.choice(len(ATTRIBUTES), size=k, replace=False)
    poles = [ATTRIBUTES[a].poles[int(rng.integers(2))] for a in attributes]
    return [str(rng.choice(wordings[p])) for p in poles], poles


def rule_verdicts(styles: dict, records, models, poles, taste: bool) -> dict:
    """(idx, model) -> the verdict the criteria's poles give, model against the baseline
    (crm.data.demo.rule_verdict, the demo's training label); when they do not separate the two,
    a tie, or with `taste` the crowd's taste's verdict."""
    wanted = [POLES[p] for p in poles]
    out = {}
    for q, record in enumerate(records):
        baseline = styles[BENCH_BASELINE][q]
        for model in models:
            style = styles[model][q]
            verdict = RULE[rule_verdict(style, baseline, wanted)]
            if verdict == TIE and taste:
                score = sum(weight if style[a] == favoured else -weight
                            for a, (favoured, weight) in CROWD_TASTE.items() if style[a] != baseline[a])
                verdict = WIN if score > 0 else LOSS if score < 0 else TIE
            out[record.idx, model] = verdict
    return out


SHAPES = ("exact", "unanimous", "partial", "mixed", "unseparated")


def pair_shapes(styles: dict, records, models, poles) -> dict:
    """(idx, model) -> how the criteria's poles meet the pair, against the demo's training pairs,
    whose criteria name exactly the attributes on which the two responses differ, every one in
    favour of one side (crm.data.demo). `exact`: that shape; `unanimous`: every named attribute
    differs, all for one side, and unnamed ones differ too; `partial`: some named attributes do
    not differ, the others all favour one side; `mixed`: the named attributes that differ favour
    both sides; `unseparated`: no named attribute differs. The demo CRM has seen only `exact`."""
    wanted = [POLES[p] for p in poles]
    named = {a for a, _ in wanted}
    out = {}
    for q, record in enumerate(records):
        baseline = styles[BENCH_BASELINE][q]
        for model in models:
            style = styles[model][q]
            sides = {style[a] == side for a, side in wanted if style[a] != baseline[a]}
            differing = sum(style[a] != baseline[a] for a, _ in wanted)
            others = any(style[a] != baseline[a] for a in range(len(ATTRIBUTES)) if a not in named)
            out[record.idx, model] = (
                "unseparated" if not sides else "mixed" if len(sides) > 1
                else "partial" if differing < len(wanted) else "unanimous" if others else "exact")
    return out


def within_model_r2(y: np.ndarray, f: np.ndarray, model_of: np.ndarray) -> float:
    """The share of the user's win indicator's variance within models that the CRM's P(win)
    explains (one slope, an intercept per model): rho^2 of PPI's within-cell regression. A model's
    own rectifier then has sd sqrt(1 - rho^2) of its votes' alone, whatever lambda is."""
    yc, fc = y.astype(float).copy(), f.astype(float).copy()
    for m in np.unique(model_of):
        at = model_of == m
        yc[at] -= yc[at].mean()
        fc[at] -= fc[at].mean()
    if not (fc ** 2).sum() or not (yc ** 2).sum():
        return 0.0
    return float((yc @ fc) ** 2 / ((fc @ fc) * (yc @ yc)))


def oracle_spread(y: np.ndarray, f: np.ndarray, model_of: np.ndarray, models) -> float:
    """The true tau^2: the spread across models of their true win rate less lambda times the
    CRM's mean P(win), lambda PPI++'s over all pairs (what the votes estimate)."""
    lam = float(np.clip(np.cov(y, f)[0, 1] / np.var(f, ddof=1), 0.0, 1.0)) if np.var(f) else 0.0
    rect = [y[model_of == m].mean() - lam * f[model_of == m].mean() for m in models]
    return float(np.var(rect, ddof=1))


def synthetic_outcomes(rule: dict, records, models, error: float,
                       rng: np.random.Generator) -> list:
    """A CRM that is the user's rule, its verdict flipped between win and not-win on a share
    `error` of the pairs (P(win) 1 or 0): what PPI gives with a CRM that fits its user."""
    out = []
    for record in records:
        for model in models:
            won = (rule[record.idx, model] == WIN) != (rng.random() < error)
            out.append(Outcome(model, record.topic, WIN if won else LOSS, float(won), record.idx))
    return out


def check_styles(styles: dict, records) -> None:
    """The styles regenerated from the seed are the bench file's: the visible marks agree."""
    for q, record in enumerate(records):
        for model, conversation in record.responses.items():
            text = conversation[-1].content
            marks = {STRUCTURE: "\n- " in text,
                     3: any(m in text for m in EXAMPLE_MARKERS),
                     5: any(m in text for m in CAVEAT_MARKERS)}
            for attribute, seen in marks.items():
                if bool(styles[model][q][attribute]) != seen:
                    raise SystemExit(f"{record.idx} {model}: attribute {attribute} does not match "
                                     "the demo generator's styles (another seed or n_bench?)")


def true_ranks(truth: dict[str, float]) -> dict[str, tuple[int, int]]:
    m = len(truth)
    return {k: (1 + sum(v > x for v in truth.values()), m - sum(v < x for v in truth.values()))
            for k, x in truth.items()}


def summarise(cases: list[dict]) -> dict:
    def mean(key):
        return round(float(np.mean([c[key] for c in cases])), 4)

    by_model: dict[str, list[bool]] = {}
    by_board: dict[int, list[bool]] = {}
    for c in cases:
        by_model.setdefault(c["model"], []).append(c["ppi_covers"])
        by_board.setdefault(c["board"], []).append(c["ppi_rank_covers"])
    worst = min(by_model, key=lambda m: np.mean(by_model[m]))
    return {"cases": len(cases),
            "coverage": {"ppi": mean("ppi_covers"), "bootstrap": mean("boot_covers"),
                         "votes_only": mean("votes_covers")},
            "ppi_worst_model": {"model": worst, "coverage": round(float(np.mean(by_model[worst])),
                                                                   4)},
            "rank_sets_all_hold": round(float(np.mean([all(b) for b in by_board.values()])), 4),
            "mean_width": {"ppi": mean("ppi_width"), "bootstrap": mean("boot_width"),
                           "votes_only": mean("votes_width")},
            "ppi_over_votes_only_width": round(mean("ppi_width") / mean("votes_width"), 4),
            "rank_set_coverage": {"ppi": mean("ppi_rank_covers"),
                                  "bootstrap": mean("boot_rank_covers")},
            "rank_set_mean_size": {"ppi": mean("ppi_rank_size"), "bootstrap": mean("boot_rank_size")},
            "crm_agreement_with_user": mean("agreement"),
            "crm_win_agreement_with_user": mean("win_agreement"),
            "within_model_rho2": mean("within_r2"),
            "unpooled_width_bound_sqrt_1_minus_rho2": round(float(np.mean(
                [np.sqrt(1 - c["within_r2"]) for c in cases])), 4),
            "oracle_spread": {"coverage": mean("oracle_covers"), "mean_width": mean("oracle_width"),
                              "over_votes_only_width": round(mean("oracle_width")
                                                             / mean("votes_width"), 4)},
            "mean_votes_per_model": mean("votes")}


def draw_user(rng, args, keys, rule, records, models) -> tuple[dict, dict, dict]:
    """One user: (their verdict per pair, their true win rate per model, their true ranks)."""
    noisy = rng.random(len(keys)) < args.noise
    drawn = rng.integers(0, 3, len(keys))
    user = {k: VERDICTS[drawn[i]] if noisy[i] else rule[k] for i, k in enumerate(keys)}
    truth = {m: float(np.mean([user[r.idx, m] == WIN for r in records])) for m in models}
    return user, truth, true_ranks(truth)


def simulate(seed: int, board: int, args, keys, user, truth, ranks, models, topics, outcomes,
             crm, boot, ppi_spec, strategy: str, n_votes: int, cases: list) -> None:
    """One user's board from `n_votes` votes drawn by `strategy` (crm.evaluation.suggest); beside
    it the CRM's fit to this user (win agreement, within-model rho^2) and PPI's pooled intervals
    had the CRM's spread of error across models been known (the oracle tau^2)."""
    drawn = suggest_pairs(outcomes, models, n_votes, seed, strategy=strategy)
    votes = {(s.idx, s.model): user[s.idx, s.model] for s in drawn}
    weights = {(s.idx, s.model): 1 / s.p for s in drawn if s.p is not None}
    rows = {r["model"]: r for r in win_rates(outcomes, models, topics, ppi_spec, votes, weights)}
    agreement = float(np.mean([crm[k].result == user[k] for k in keys]))
    y = np.array([user[k] == WIN for k in keys], dtype=float)
    f = np.array([crm[k].p_win for k in keys])
    model_of = np.array([k[1] for k in keys])
    win_agreement = float(np.mean([(crm[k].result == WIN) == (user[k] == WIN) for k in keys]))
    r2 = within_model_r2(y, f, model_of)
    cells = []
    for m in models:
        at = [i for i, k in enumerate(keys) if k[1] == m]
        mine = [i for i in at if keys[i] in votes]
        cells.append(CellData(f[at], f[mine], y[mine], [weights.get(keys[i], 1.0) for i in mine]))
    oracle = dict(zip(models, ppi_pooled(cells, spread=oracle_spread(y, f, model_of, models))))
    for m in models:
        ppi, bt = rows[m]["overall"], boot[m]["overall"]
        mine = [user[k] == WIN for k in votes if k[1] == m]
        only = wilson(mine, args.level) or (0.0, 1.0)
        lo, hi = ranks[m]
        best = oracle[m].interval(args.level)
        # a model without an interval (no vote on it) counts as the whole range
        ci = (0.0, 1.0) if ppi["ci_low"] is None else (ppi["ci_low"], ppi["ci_high"])
        cases.append({
            "model": m, "board": board,
            "oracle_covers": best[0] <= truth[m] <= best[1], "oracle_width": best[1] - best[0],
            "win_agreement": win_agreement, "within_r2": r2,
            "ppi_covers": ci[0] <= truth[m] <= ci[1], "ppi_width": ci[1] - ci[0],
            "boot_covers": bt["ci_low"] <= truth[m] <= bt["ci_high"],
            "boot_width": bt["ci_high"] - bt["ci_low"],
            "votes_covers": only[0] <= truth[m] <= only[1],
            "votes_width": only[1] - only[0],
            "ppi_rank_covers": rows[m]["rank_set"][0] <= lo and rows[m]["rank_set"][1] >= hi,
            "ppi_rank_size": rows[m]["rank_set"][1] - rows[m]["rank_set"][0] + 1,
            "boot_rank_covers": boot[m]["rank_set"][0] <= lo and boot[m]["rank_set"][1] >= hi,
            "boot_rank_size": boot[m]["rank_set"][1] - boot[m]["rank_set"][0] + 1,
            "agreement": agreement, "votes": len(mine)})


def strategy_table(cases: dict, plans: list) -> list[dict]:
    """Per (strategy, votes) and user kind, over both wording kinds: PPI's coverage, worst
    model's coverage, rank sets holding together, mean width, and that width over uniform's at
    the same vote count."""
    out = []
    for strategy, n in plans:
        for user in ("even", "taste"):
            mine = cases["train", user, (strategy, n)] + cases["heldout", user, (strategy, n)]
            summary = summarise(mine)
            row = {"strategy": strategy, "votes": n, "user": user,
                   "coverage": summary["coverage"]["ppi"],
                   "worst_model_coverage": summary["ppi_worst_model"]["coverage"],
                   "rank_sets_all_hold": summary["rank_sets_all_hold"],
                   "mean_width": summary["mean_width"]["ppi"],
                   "over_votes_only_width": summary["ppi_over_votes_only_width"]}
            if ("uniform", n) in plans:
                base = summarise(cases["train", user, ("uniform", n)]
                                 + cases["heldout", user, ("uniform", n)])
                row["width_over_uniform"] = round(row["mean_width"]
                                                  / base["mean_width"]["ppi"], 4)
            out.append(row)
    return out


def _share(hits: list[bool]) -> float | None:
    return round(float(np.mean(hits)), 4) if hits else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", default="outputs/demo/export")
    parser.add_argument("--bench", default=".cache/demo/raw/bench.jsonl")
    parser.add_argument("--sets", type=int, default=20, help="criteria sets per wording kind")
    parser.add_argument("--users", type=int, default=6, help="users per criteria set")
    parser.add_argument("--votes", default="50", help="vote counts per user, comma-separated")
    parser.add_argument("--strategies", default="uniform",
                        help="suggest_votes strategies, comma-separated (uniform, active)")
    parser.add_argument("--level", type=float, default=0.95)
    parser.add_argument("--noise", type=float, default=0.10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--demo-seed", type=int, default=0, help="the bench's generator seed")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--spread-level", type=float, default=None,
                        help="the confidence level of PPI's tau^2 bound (crm.evaluation.ppi."
                             "SPREAD_LEVEL, 0.95): a study of the estimator, not a setting")
    parser.add_argument("--synthetic-crm", type=float, default=None, metavar="ERROR",
                        help="no CRM: each user kind's rule with its win verdict flipped on this "
                             "share of pairs stands in for it (a study of the estimator)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    vote_counts = [int(v) for v in str(args.votes).split(",")]
    strategies = str(args.strategies).split(",")
    plans = [(strategy, n) for strategy in strategies for n in vote_counts]
    if args.spread_level is not None:
        import crm.evaluation.ppi

        crm.evaluation.ppi.SPREAD_LEVEL = args.spread_level

    import torch

    from crm.inference.scorer import CRMScorer

    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    scorer = (None if args.synthetic_crm is not None else
              CRMScorer.load(args.checkpoint, batch_size=32, device=torch.device("cpu")))
    synthetic_rng = np.random.default_rng([args.seed, 1])  # the users' draws stay the real run's
    selection = select(args.bench, BENCH_BASELINE)
    records, models, topics = selection.records, selection.models, selection.topics
    styles = bench_styles(args.demo_seed, len(records))
    check_styles(styles, records)
    keys = [(r.idx, m) for r in records for m in models]
    rng = np.random.default_rng(args.seed)
    ppi_spec = Bootstrap(level=args.level, method="ppi")
    boot_spec = Bootstrap(level=args.level, method="bootstrap")
    cases = {(kind, user, plan): [] for kind in ("train", "heldout") for user in ("even", "taste")
             for plan in plans}
    boards = 0
    sets, tie_verdicts = [], []
    by_shape = {(kind, user, shape): [] for kind in ("train", "heldout")
                for user in ("even", "taste") for shape in SHAPES}
    by_rule = {(kind, user, verdict): [] for kind in ("train", "heldout")
               for user in ("even", "taste") for verdict in ("decided", "tie")}
    for kind, wordings in (("train", TRAIN_WORDINGS), ("heldout", HELDOUT_WORDINGS)):
        for _ in range(args.sets):
            criteria, poles = draw_criteria(rng, wordings)
            if scorer is not None:
                outcomes = judge(scorer, selection, criteria)  # once per criteria set
            sets.append({"kind": kind, "criteria": criteria, "poles": poles})
            shapes = pair_shapes(styles, records, models, poles)
            for user_kind in ("even", "taste"):
                rule = rule_verdicts(styles, records, models, poles, user_kind == "taste")
                if scorer is None:
                    outcomes = synthetic_outcomes(rule, records, models, args.synthetic_crm,
                                                  synthetic_rng)
                crm = {(o.idx, o.model): o for o in outcomes}
                tie_verdicts.extend(o.result for o in outcomes)
                boot = {r["model"]: r for r in win_rates(outcomes, models, topics, boot_spec)}
                for k in keys:
                    by_shape[kind, user_kind, shapes[k]].append(crm[k].result == rule[k])
                    by_rule[kind, user_kind, "tie" if rule[k] == TIE else "decided"].append(
                        crm[k].result == rule[k])
                for _ in range(args.users):
                    user, truth, ranks = draw_user(rng, args, keys, rule, records, models)
                    seed = int(rng.integers(2**31))
                    boards += 1
                    for plan in plans:
                        simulate(seed, boards, args, keys, user, truth, ranks, models, topics,
                                 outcomes, crm, boot, ppi_spec, *plan,
                                 cases[kind, user_kind, plan])
    result = {
        "benchmark": "usl_coverage",
        "command": "python benchmarks/usl_coverage.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
        "checkpoint": None if scorer is None else args.checkpoint, "bench": args.bench,
        "synthetic_crm_error": args.synthetic_crm,
        "pairs": len(keys), "models": len(models), "queries": len(records),
        "users_per_kind": {"train_wordings": args.users * args.sets,
                           "heldout_wordings": args.users * args.sets},
        "votes_per_user": vote_counts[0], "strategy": strategies[0], "level": args.level,
        "user_noise": args.noise,
        "spread_level": args.spread_level or 0.95,
        "criteria_sets": len(sets), "crm_sequences": int(scorer.counts["sequences"]) if scorer else 0,
        **{f"{user}_user": {
            "train_wordings": summarise(cases["train", user, plans[0]]),
            "heldout_wordings": summarise(cases["heldout", user, plans[0]]),
            "all": summarise(cases["train", user, plans[0]] + cases["heldout", user, plans[0]])}
           for user in ("even", "taste")},
        "strategies": strategy_table(cases, plans),
        # the CRM's verdict against the user's rule (before their noise), by how the criteria meet
        # the pair: what separates the README's 0.95 (test pairs of the `exact` shape) from here
        "crm_agreement_by_pair_shape": {
            f"{kind}_wordings": {shape: {
                "pairs": len(by_shape[kind, "even", shape]),
                **{f"{user}_user": round(float(np.mean(by_shape[kind, user, shape])), 4)
                   if by_shape[kind, user, shape] else None for user in ("even", "taste")}}
                for shape in SHAPES} for kind in ("train", "heldout")},
        # the CRM's win / tie / loss verdict against the user's rule (before their noise): on
        # every pair, where the rule gives a side, and where it gives a tie (tie recall)
        "crm_verdict_agreement": {
            f"{kind}_wordings": {f"{user}_user": {
                "all": _share(by_rule[kind, user, "decided"] + by_rule[kind, user, "tie"]),
                "decided": _share(by_rule[kind, user, "decided"]),
                "tie": _share(by_rule[kind, user, "tie"]),
                "rule_ties": len(by_rule[kind, user, "tie"])}
                for user in ("even", "taste")} for kind in ("train", "heldout")},
        "crm_tie_verdicts": round(float(np.mean([o == TIE for o in tie_verdicts])), 4),
        "cpu": platform.processor() or platform.machine(), "torch_threads": args.threads,
        "wall_seconds": round(time.perf_counter() - started, 1),
        "criteria": sets,
    }
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
