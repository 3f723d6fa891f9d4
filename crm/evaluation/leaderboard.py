"""The User-centric Subjective Leaderboard (docs/DESIGN.md section 8): models ranked for one user's criteria.

For every benchmark query in the selected topics, each model's response is judged against the
baseline's under the user's criteria (baseline in slot A, so criteria + query + baseline is a prefix
the scorer computes once per query). A model wins an example when the CRM prefers its response;
a score tie or the tie class is a tie, reported apart from wins. The win rate per topic is
wins / examples; Overall is micro-averaged over all selected examples (wins / examples).

Every win rate carries a 95% interval: a percentile bootstrap over the benchmark's queries (seeded),
reported as Arena-Hard does, "(-x / +y)". Each row also has LMArena's rank upper bound: 1 + the
number of models whose Overall interval lies wholly above this one's, so that ranks the intervals
cannot tell apart share a bound.

Benchmark lines that cannot be used are never skipped silently: a line that does not parse, or that
lacks the baseline's or a ranked model's response, is rejected for every model (so all models are
ranked on the same examples) and listed with file, line, field and reason; lines read = used +
rejected + outside the selected topics.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from crm.core.examples import LABEL_A, LABEL_B, PairExample
from crm.core.records import BenchRecord, RecordError, read_lines
from crm.evaluation.accuracy import verdict

# The criteria-blind setting: what the reference leaderboard used for its crowd ranking. A CRM
# reads it as "no particular taste": whatever preference it holds without criteria, which for a
# model trained on crowd votes is the crowd's average preference.
DEFAULT_CRITERIA = ("General user preference",)

WIN, TIE, LOSS = "win", "tie", "loss"


# -- the benchmark ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Selection:
    """The benchmark examples a leaderboard ranks on, and what was left out and why."""

    path: str
    baseline: str
    models: tuple[str, ...]  # ranked models, in the benchmark's order (the baseline excluded)
    topics: tuple[str, ...]  # selected topics, in the benchmark's order
    records: tuple[BenchRecord, ...]
    rejects: tuple[dict, ...] = ()  # {file, line, field, reason}
    outside_topics: int = 0  # lines of topics not selected

    @property
    def counts(self) -> dict:
        used, rejected = len(self.records), len(self.rejects)
        return {"read": used + rejected + self.outside_topics, "used": used, "rejected": rejected,
                "outside_topics": self.outside_topics}


def select(path: str | Path, baseline: str, topics: Sequence[str] | None = None,
           models: Sequence[str] | None = None) -> Selection:
    """Read a benchmark file and select the examples to rank `models` (None: all) against `baseline`.

    Raises ValueError when nothing can be ranked: the baseline, a requested model or a requested
    topic appears nowhere, or no line is usable.
    """
    path = str(path)
    parsed, rejects = [], []
    for line in read_lines(path, "bench"):
        if line.error:
            rejects.append(line.error.as_dict())
        else:
            parsed.append((line.number, line.record))
    in_file = list(dict.fromkeys(name for _, r in parsed for name in r.responses))
    if baseline not in in_file:
        raise ValueError(f"{path}: baseline {baseline!r} has no response in any line "
                         f"(models: {', '.join(in_file) or 'none'})")
    if models is None:
        models = [m for m in in_file if m != baseline]
    unknown = [m for m in models if m not in in_file]
    if unknown:
        raise ValueError(f"{path}: models={list(unknown)} have no response in any line "
                         f"(models: {', '.join(in_file)})")
    models = tuple(m for m in dict.fromkeys(models) if m != baseline)
    if not models:
        raise ValueError(f"{path}: no model to rank besides the baseline {baseline!r}")
    file_topics = list(dict.fromkeys(r.topic for _, r in parsed))
    if topics is None:
        topics = file_topics
    else:
        missing = [t for t in topics if t not in file_topics]
        if missing:
            raise ValueError(f"{path}: topics={list(missing)} not in the benchmark "
                             f"(topics: {', '.join(file_topics)})")
        topics = [t for t in file_topics if t in set(topics)]
    records, outside = [], 0
    for number, record in parsed:
        if record.topic not in topics:
            outside += 1
            continue
        absent = [m for m in (baseline, *models) if m not in record.responses]
        if absent:
            role = "the baseline" if absent[0] == baseline else "a ranked model"
            reason = (f"no response from {role} {absent[0]!r}; the line is left out for every "
                      "model, so that all are ranked on the same examples")
            rejects.append(RecordError(reason, f"responses.{absent[0]}", path, number).as_dict())
            continue
        records.append(record)
    if not records:
        raise ValueError(f"{path}: no usable line for baseline {baseline!r} in topics "
                         f"{list(topics)} ({len(rejects)} rejected)")
    return Selection(path, baseline, models, tuple(topics), tuple(records), tuple(rejects), outside)


# -- judging --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    model: str
    topic: str
    result: str  # WIN, TIE or LOSS against the baseline
    p_win: float  # P(the model's response is preferred)
    idx: str = ""  # the benchmark query it answers


def pairs(selection: Selection, criteria: Sequence[str]) -> list[tuple[str, str, PairExample]]:
    """(idx, model, pair) per example and model: the baseline's response in slot A, the model's
    in slot B."""
    criteria = tuple(criteria)
    out = []
    for record in selection.records:
        base = record.responses[selection.baseline]
        for model in selection.models:
            out.append((record.idx, model, PairExample(
                f"{record.idx}/{model}", criteria, base[0].content, base[1:],
                record.responses[model][1:], LABEL_A, record.topic)))
    return out


def judge(scorer, selection: Selection, criteria: Sequence[str],
          both_orders: bool = False) -> list[Outcome]:
    """One outcome per (example, model): the model's response against the baseline's.

    The baseline sits in slot A, the model in slot B (`both_orders` also judges the swapped
    order and averages the probabilities). A pair the length policy cannot fit is an error that
    names it: a model must not lose (or win) an example by being too long to read.
    """
    owners = pairs(selection, criteria)
    examples = [e for _, _, e in owners]
    probs = scorer.pair_probabilities(examples, unfit="nan", both_orders=both_orders)
    unfit = [e.key for e, p in zip(examples, probs) if p.isnan().any()]
    if unfit:
        raise ValueError(f"{selection.path}: {len(unfit)} pairs (benchmark idx/model) cannot fit "
                         f"in {scorer.encoder.max_tokens} tokens even with shortened responses: "
                         f"{', '.join(unfit[:5])}{' ...' if len(unfit) > 5 else ''}")
    outcomes = []
    for (idx, model, e), p in zip(owners, probs.tolist()):
        v = verdict(p)
        result = WIN if v == LABEL_B else LOSS if v == LABEL_A else TIE
        outcomes.append(Outcome(model, e.topic, result, p[LABEL_B], idx))
    return outcomes


# -- the arithmetic -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Bootstrap:
    """How win-rate intervals are computed: a percentile bootstrap over the benchmark's queries.

    Percentile rather than BCa: BCa is undefined for a cell whose outcomes are all equal (every
    example won), common on small topics. Arena-Hard and LMArena use percentile intervals too.
    """

    level: float = 0.95
    resamples: int = 1000
    seed: int = 0


def bootstrap_intervals(samples: Sequence[Sequence[float]], spec: Bootstrap = Bootstrap()
                        ) -> list[tuple[float, float] | None]:
    """(low, high) of the mean of each sample (1 per win, 0 per tie or loss), None below 2 values.

    Samples of one length go through one vectorised scipy call, and so through the same resampled
    queries: a board's models, judged on the same examples, are resampled together.
    """
    from scipy.stats import bootstrap

    out: list[tuple[float, float] | None] = [None] * len(samples)
    by_length = defaultdict(list)
    for i, sample in enumerate(samples):
        if len(sample) >= 2:
            by_length[len(sample)].append(i)
    for index in by_length.values():
        data = np.asarray([samples[i] for i in index], dtype=float)
        ci = bootstrap((data,), np.mean, axis=-1, n_resamples=spec.resamples,
                       confidence_level=spec.level, method="percentile",
                       rng=np.random.default_rng(spec.seed)).confidence_interval
        for i, low, high in zip(index, np.atleast_1d(ci.low), np.atleast_1d(ci.high)):
            out[i] = (round(float(low), 4), round(float(high), 4))
    return out


def _cell(results: list[Outcome]) -> dict:
    n = len(results)
    wins = sum(o.result == WIN for o in results)
    ties = sum(o.result == TIE for o in results)
    return {"n": n, "wins": wins, "ties": ties, "losses": n - wins - ties,
            "win_rate": round(wins / n, 4) if n else None,
            "ci_low": None, "ci_high": None,
            "tie_rate": round(ties / n, 4) if n else None,
            "mean_p_win": round(sum(o.p_win for o in results) / n, 4) if n else None}


def rank_upper_bounds(rows: list[dict]) -> list[int]:
    """LMArena's rank upper bound per row: 1 + the models whose Overall interval lies wholly above
    this row's (their lower bound exceeds its upper bound). Rows without an interval count as
    points."""
    def bounds(row):
        o = row["overall"]
        return ((o["ci_low"], o["ci_high"]) if o["ci_low"] is not None
                else (o["win_rate"] or 0, o["win_rate"] or 0))

    spans = [bounds(r) for r in rows]
    return [1 + sum(low > high for low, _ in spans) for _, high in spans]


def win_rates(outcomes: Iterable[Outcome], models: Sequence[str], topics: Sequence[str],
              interval: Bootstrap = Bootstrap()) -> list[dict]:
    """Rows {rank, rank_ub, model, overall, topics: {topic: cell}}, best first.

    Overall is micro-averaged: all of a model's wins over all its examples (a topic with more
    examples weighs more). Ranked by overall win rate, then mean P(win), then name. Each cell has
    its bootstrap interval (ci_low, ci_high); rank_ub is the rank upper bound.
    """
    by_model = defaultdict(list)
    for o in outcomes:
        by_model[o.model].append(o)
    rows, cells, samples = [], [], []
    for model in models:
        results = by_model[model]
        per_topic = {t: [o for o in results if o.topic == t] for t in topics}
        row = {"model": model, "overall": _cell(results),
               "topics": {t: _cell(per_topic[t]) for t in topics}}
        rows.append(row)
        for cell, part in [(row["overall"], results),
                           *((row["topics"][t], per_topic[t]) for t in topics)]:
            cells.append(cell)
            samples.append([o.result == WIN for o in part])
    for cell, span in zip(cells, bootstrap_intervals(samples, interval)):
        if span:
            cell["ci_low"], cell["ci_high"] = span
    rows.sort(key=lambda r: (-(r["overall"]["win_rate"] or 0), -(r["overall"]["mean_p_win"] or 0),
                             r["model"]))
    return [{"rank": rank, "rank_ub": ub, **row}
            for rank, (row, ub) in enumerate(zip(rows, rank_upper_bounds(rows)), start=1)]


def kendall_tau(rows_a: list[dict], rows_b: list[dict]) -> dict:
    """Kendall tau-b between two rankings of the same models (-1: one reverses the other)."""
    from scipy.stats import kendalltau

    rank_b = {r["model"]: r["rank"] for r in rows_b}
    models = [r["model"] for r in rows_a]
    tau, p_value = kendalltau([r["rank"] for r in rows_a], [rank_b[m] for m in models])
    return {"tau": round(float(tau), 4), "p_value": float(p_value), "models": len(models)}


@dataclass
class Board:
    """One ranking: the criteria it was judged under and its rows."""

    label: str
    criteria: tuple[str, ...]
    rows: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"label": self.label, "criteria": list(self.criteria), "rows": self.rows}


def rank(scorer, selection: Selection, criteria: Sequence[str], label: str = "criteria",
         both_orders: bool = False, interval: Bootstrap = Bootstrap()) -> Board:
    outcomes = judge(scorer, selection, criteria, both_orders=both_orders)
    return Board(label, tuple(criteria),
                 win_rates(outcomes, selection.models, selection.topics, interval))


def leaderboard(scorer, selection: Selection, criteria: Sequence[str],
                contrast: Sequence[str] | None = None, both_orders: bool = False,
                labels: tuple[str, str] = ("criteria", "contrast"),
                interval: Bootstrap = Bootstrap()) -> dict:
    """The leaderboard.json document: counts, rejects, one board per criteria set and, with a
    contrast set, the Kendall tau between the two rankings."""
    if not criteria:
        raise ValueError("no criteria: give the user's criteria (one line each), or use the "
                         "default criteria")
    boards = [rank(scorer, selection, criteria, labels[0], both_orders, interval)]
    if contrast:
        boards.append(rank(scorer, selection, contrast, labels[1], both_orders, interval))
    out = {"bench": selection.path, "baseline": selection.baseline,
           "topics": list(selection.topics), "models": list(selection.models),
           "both_orders": both_orders, "examples": selection.counts,
           "interval": {**asdict(interval), "method": "percentile bootstrap over queries"},
           "rejects": list(selection.rejects), "boards": [b.as_dict() for b in boards]}
    if contrast:
        out["kendall_tau"] = kendall_tau(boards[0].rows, boards[1].rows)
    return out
