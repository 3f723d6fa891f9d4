"""The User-centric Subjective Leaderboard (docs/DESIGN.md section 8): models ranked for one user's criteria.

For every benchmark query in the selected topics, each model's response is judged against the
baseline's under the user's criteria (baseline in slot A, so criteria + query + baseline is a prefix
the scorer computes once per query). A model wins an example when the CRM prefers its response;
a score tie or the tie class is a tie, reported apart from wins. The win rate per topic is
wins / examples; Overall is micro-averaged over all selected examples (wins / examples).

Every win rate carries a 95% interval, reported as Arena-Hard does, "(-x / +y)": without the
user's votes a percentile bootstrap over the benchmark's queries (seeded), which takes the CRM's
verdict for the user's and says so; with them prediction-powered inference (crm.evaluation.ppi),
which carries the CRM's error. Each row also has LMArena's rank upper bound (1 + the number of
models whose Overall interval lies wholly above this one's) and a rank set, the ranks it can hold
given simultaneous intervals.

Benchmark lines that cannot be used are never skipped silently: a line that does not parse, or that
lacks the baseline's or a ranked model's response, is rejected for every model (so all models are
ranked on the same examples) and listed with file, line, field and reason; lines read = used +
left out (queries whose pairs cannot fit the CRM's tokens, under the user's criteria) +
rejected + outside the selected topics.
"""
from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from crm.core.errors import ConfigError
from crm.core.examples import LABEL_A, LABEL_B, LABEL_TIE, PairExample, verdict
from crm.core.files import file_digest
from crm.core.records import BenchRecord, RecordError, read_lines
from crm.evaluation.ppi import (MIN_VOTES, CellData, Estimate, ppi_separate, ppi_topics,
                                rank_sets)
from crm.evaluation.slot_bias import judge_both_orders, measure_slot_bias

log = logging.getLogger(__name__)

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
    outside_idx: tuple[str, ...] = ()  # their idx (a vote on one is counted, not used)
    rejected_idx: tuple[str, ...] = ()  # the idx of parsed lines rejected for a missing response
    fingerprint: str = ""  # of the file's bytes (`bench_fingerprint`): what a vote names

    @property
    def counts(self) -> dict:
        used, rejected = len(self.records), len(self.rejects)
        return {"read": used + rejected + self.outside_topics, "used": used, "rejected": rejected,
                "outside_topics": self.outside_topics}


def bench_fingerprint(path: str | Path) -> str:
    """A benchmark file's identity wherever it lies: the start of its bytes' SHA-256."""
    return "sha256:" + file_digest(path)[:16]


def select(path: str | Path, baseline: str, topics: Sequence[str] | None = None,
           models: Sequence[str] | None = None) -> Selection:
    """Read a benchmark file and select the examples to rank `models` (None: all) against `baseline`.

    Raises ValueError when nothing can be ranked: the baseline, a requested model or a requested
    topic appears nowhere, or no line is usable.
    """
    path = str(path)
    parsed, rejects, first_line = [], [], {}
    for line in read_lines(path, "bench"):
        if line.error:
            rejects.append(line.error.as_dict())
        elif line.record.idx in first_line:  # a vote or a suggested pair names its query by idx
            rejects.append(RecordError(f"idx {line.record.idx!r} is line {first_line[line.record.idx]}'s "
                                       "too: each query once", "idx", path, line.number).as_dict())
        else:
            first_line[line.record.idx] = line.number
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
    records, outside, rejected_idx = [], [], []
    for number, record in parsed:
        if record.topic not in topics:
            outside.append(record.idx)
            continue
        absent = [m for m in (baseline, *models) if m not in record.responses]
        if absent:
            role = "the baseline" if absent[0] == baseline else "a ranked model"
            reason = (f"no response from {role} {absent[0]!r}; the line is left out for every "
                      "model, so that all are ranked on the same examples")
            rejects.append(RecordError(reason, f"responses.{absent[0]}", path, number).as_dict())
            rejected_idx.append(record.idx)
            continue
        records.append(record)
    if not records:
        raise ValueError(f"{path}: no usable line for baseline {baseline!r} in topics "
                         f"{list(topics)} ({len(rejects)} rejected)")
    return Selection(path, baseline, models, tuple(topics), tuple(records), tuple(rejects),
                     len(outside), tuple(outside), tuple(rejected_idx), bench_fingerprint(path))


# -- judging --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    model: str
    topic: str
    result: str  # WIN, TIE or LOSS against the baseline
    p_win: float  # P(the model's response is preferred)
    idx: str = ""  # the benchmark query it answers
    p_tie: float = 0.0  # after idx: callers pass idx by position; 0 from a head without a tie class

    @property
    def p_loss(self) -> float:
        # The three sum to one (a softmax, or the mean of two); max: rounding must not make a
        # probability negative.
        return max(0.0, 1.0 - self.p_win - self.p_tie)


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
          both_orders: bool = False, unscorable: list[str] | None = None) -> list[Outcome]:
    """One outcome per (example, model): the model's response against the baseline's.

    The baseline sits in slot A, the model in slot B (`both_orders` also judges the swapped
    order: crm.evaluation.slot_bias.both_orders makes one verdict of the two). A model must not
    lose (or win) an example by being too long to read: a pair the length policy cannot fit is
    an error that names it, or, given an `unscorable` list, its key goes there and its query is
    left out for every model (all models are still ranked on the same examples).
    """
    owners = pairs(selection, criteria)
    examples = [e for _, _, e in owners]
    verdicts = None
    if both_orders:
        probs, verdicts = judge_both_orders(scorer, examples)
    else:
        probs = scorer.pair_probabilities(examples, unfit="nan")
    # One test over the whole tensor: a test per row costs time at scale (docs/PERFORMANCE.md 12).
    unscored = probs.isnan().any(dim=1).tolist()
    unfit = [e.key for e, nan in zip(examples, unscored) if nan]
    left_out = {idx for (idx, _, _), nan in zip(owners, unscored) if nan}
    if unfit and unscorable is not None:
        unscorable.extend(unfit)
    elif unfit:
        raise ValueError(f"{selection.path}: {len(unfit)} pairs (benchmark idx/model) cannot fit "
                         f"in {scorer.encoder.max_tokens} tokens even with shortened responses: "
                         f"{', '.join(unfit[:5])}{' ...' if len(unfit) > 5 else ''}")
    outcomes = []
    for k, ((idx, model, e), p) in enumerate(zip(owners, probs.tolist())):
        if idx in left_out:
            continue
        v = verdict(p) if verdicts is None else verdicts[k]
        result = WIN if v == LABEL_B else LOSS if v == LABEL_A else TIE
        outcomes.append(Outcome(model, e.topic, result, p[LABEL_B], idx, p[LABEL_TIE]))
    return outcomes


# -- the arithmetic -------------------------------------------------------------------------------


INTERVAL_METHODS = ("auto", "bootstrap", "ppi")
# What a board without votes must say on every output: its intervals know nothing of the CRM's
# own error, only of which queries the benchmark happened to hold.
CRM_IS_USER = ("intervals assume the CRM's verdict is the user's: they carry none of the CRM's "
               "error (give votes=FILE for intervals that do)")
PPI_ASSUMES = ("votes a random sample of each model's pairs (uniform, or drawn with the inclusion "
               "probabilities they carry): each model's Overall interval holds at its level for "
               "that model and the rank sets for all models together; topic cells pool the CRM's "
               "error across the board's cells and hold on average over them")


@dataclass(frozen=True)
class Bootstrap:
    """How win-rate intervals are computed (the config's `interval`).

    `method`: `bootstrap`, a percentile bootstrap over the benchmark's queries, which takes the
    CRM's verdicts as the user's; `ppi`, prediction-powered intervals from the CRM's verdicts and
    the user's votes (crm.evaluation.ppi); `auto`, ppi when votes are given, else bootstrap.
    Percentile rather than BCa: BCa is undefined for a cell whose outcomes are all equal (every
    example won), common on small topics. Arena-Hard and LMArena use percentile intervals too.
    `tie_value`: what a tie is worth in a win rate, the CRM's verdicts and the user's votes alike
    (0: not a win; 0.5: half a win, as LMArena's ratings count it).
    """

    level: float = 0.95
    resamples: int = 1000
    seed: int = 0
    method: str = "auto"
    tie_value: float = 0.0

    def value(self, result: str) -> float:
        """A verdict's worth in a win rate."""
        return 1.0 if result == WIN else self.tie_value if result == TIE else 0.0


def interval_doc(spec: Bootstrap, method: str) -> dict:
    """leaderboard.json's `interval`: the settings, the method used and what it assumes."""
    return {**asdict(spec), "method": method, "min_votes": MIN_VOTES,
            "assumes": PPI_ASSUMES if method == "ppi" else CRM_IS_USER}


def board_method(spec: Bootstrap, votes, outcomes: Iterable[Outcome]) -> str:
    """The method a board's intervals use: `interval_method`'s, except that until PPI has
    MIN_VOTES votes on the judged pairs the bootstrap's stay (and each cell says so)."""
    method = interval_method(spec, votes)
    if method == "ppi" and sum((o.idx, o.model) in votes for o in outcomes) < MIN_VOTES:
        return "bootstrap"
    return method


def interval_method(spec: Bootstrap, votes) -> str:
    """The method `spec` asks for, given whether votes were given (None: not given)."""
    if spec.method not in INTERVAL_METHODS:
        raise ValueError(f"interval.method={spec.method!r}: one of {', '.join(INTERVAL_METHODS)}")
    if not 0.0 <= spec.tie_value <= 1.0:
        raise ValueError(f"interval.tie_value={spec.tie_value}: what a tie is worth, between 0 "
                         "(not a win) and 1 (0.5: half a win)")
    if spec.method == "auto":
        return "bootstrap" if votes is None else "ppi"
    if spec.method == "ppi" and votes is None:
        raise ValueError("interval.method=ppi needs the user's votes (votes=FILE)")
    return spec.method


def bootstrap_intervals(samples: Sequence[Sequence[float]], spec: Bootstrap = Bootstrap()
                        ) -> list[tuple[float, float] | None]:
    """(low, high) of the mean of each sample (each verdict's worth), None below 2 values.

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


def _cell(results: list[Outcome], tie_value: float = 0.0) -> dict:
    n = len(results)
    wins = sum(o.result == WIN for o in results)
    ties = sum(o.result == TIE for o in results)
    return {"n": n, "wins": wins, "ties": ties, "losses": n - wins - ties,
            "win_rate": round((wins + tie_value * ties) / n, 4) if n else None,
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
              interval: Bootstrap = Bootstrap(),
              votes: Mapping[tuple[str, str], str] | None = None,
              weights: Mapping[tuple[str, str], float] | None = None) -> list[dict]:
    """Rows {rank, rank_ub, rank_set, model, overall, topics: {topic: cell}}, best first.

    Overall is micro-averaged: all of a model's wins (a tie worth `interval.tie_value`) over all
    its examples (a topic with more examples weighs more). Ranked by overall win rate, equal
    rates sharing a rank (listed by mean P(win), then name). Each cell has its interval (ci_low,
    ci_high) by `interval.method` and the votes it used; with votes ((idx, model) -> verdict, the
    user's; `weights`, each vote's inverse inclusion probability when they were not drawn
    uniformly), a cell's win_rate is PPI's estimate and crm_win_rate the CRM's. rank_ub is the
    rank upper bound, rank_set [best, worst] the ranks the model can hold given simultaneous
    intervals.
    """
    outcomes = list(outcomes)
    method = board_method(interval, votes, outcomes)
    by_model = defaultdict(list)
    for o in outcomes:
        by_model[o.model].append(o)
    rows, cells, parts = [], [], []
    for model in models:
        results = by_model[model]
        per_topic = {t: [o for o in results if o.topic == t] for t in topics}
        row = {"model": model, "overall": _cell(results, interval.tie_value),
               "topics": {t: _cell(per_topic[t], interval.tie_value) for t in topics}}
        rows.append(row)
        for cell, part in [(row["overall"], results),
                           *((row["topics"][t], per_topic[t]) for t in topics)]:
            cells.append(cell)
            parts.append(part)
    overall = [r["overall"] for r in rows]
    if method == "bootstrap":
        simultaneous = _bootstrap(cells, parts, interval, overall)
        if votes:
            _too_few_votes(cells, parts, votes, overall)
    else:
        simultaneous = _ppi(cells, parts, interval, votes, weights or {}, overall)
    sets = rank_sets([span or (0.0, 1.0) for span in simultaneous])
    for row, best_worst in zip(rows, sets):
        row["rank_set"] = list(best_worst)
    rows.sort(key=lambda r: (-(r["overall"]["win_rate"] or 0), -(r["overall"]["mean_p_win"] or 0),
                             r["model"]))
    rates = [r["overall"]["win_rate"] or 0 for r in rows]
    # Competition ranking ("1, 2, 2, 4"): a rank is the board's claim of an order, and two equal
    # win rates are not one; mean P(win) and the name only order the listing.
    return [{"rank": 1 + sum(other > rate for other in rates), "rank_ub": ub, **row}
            for rate, row, ub in zip(rates, rows, rank_upper_bounds(rows))]


def _simultaneous_level(level: float, models: int) -> float:
    # Bonferroni: each of the M Overall intervals at 1 - alpha / M, so all hold together at least
    # at 1 - alpha, and with them every true rank lies in its rank set.
    return 1 - (1 - level) / max(models, 1)


def _bootstrap(cells, parts, interval: Bootstrap, overall) -> list:
    samples = [[interval.value(o.result) for o in part] for part in parts]
    for cell, span in zip(cells, bootstrap_intervals(samples, interval)):
        cell["votes"] = 0
        if span:
            cell["ci_low"], cell["ci_high"] = span
    wide = replace(interval, level=_simultaneous_level(interval.level, len(overall)))
    index = [next(i for i, c in enumerate(cells) if c is cell) for cell in overall]
    return bootstrap_intervals([samples[i] for i in index], wide)


def _too_few_votes(cells, parts, votes, overall) -> None:
    """Each cell's votes, and why its interval is still the bootstrap's."""
    counts = [sum((o.idx, o.model) in votes for o in part) for part in parts]
    heads = {id(c) for c in overall}
    total = sum(n for cell, n in zip(cells, counts) if id(cell) in heads)
    for cell, n in zip(cells, counts):
        cell["votes"] = n
        if cell["n"]:
            cell["interval_note"] = (f"bootstrap interval (the CRM taken as the user) until PPI "
                                     f"has {MIN_VOTES} votes: {total} so far")


def _ppi(cells, parts, interval: Bootstrap, votes, weights, overall) -> list:
    """Each cell's win rate and interval by PPI (crm.evaluation.ppi): the Overall cells each
    valid for its model (`ppi_separate`), its topic cells nested in it (`ppi_topics`). `cells`
    and `parts` go model by model, the Overall cell then its topics'."""
    def predicted(o: Outcome) -> float:
        return o.p_win + interval.tie_value * o.p_tie

    data = []
    for part in parts:
        voted = [o for o in part if (o.idx, o.model) in votes]
        data.append(CellData([predicted(o) for o in part], [predicted(o) for o in voted],
                             [interval.value(votes[o.idx, o.model]) for o in voted],
                             [weights.get((o.idx, o.model), 1.0) for o in voted]))
    per_model = len(cells) // len(overall)  # the Overall cell and its topics'
    heads = list(range(0, len(cells), per_model))
    estimates: dict[int, Estimate | None] = dict(zip(heads, ppi_separate([data[i] for i in heads])))
    nested = ppi_topics([data[i] for i in heads],
                        [[data[i] for i in range(h + 1, h + per_model)] for h in heads])
    for h, row in zip(heads, nested):
        estimates.update(zip(range(h + 1, h + per_model), row))
    for i, cell in enumerate(cells):
        cell["votes"] = len(data[i].votes)
        cell["crm_win_rate"] = cell["win_rate"]
        estimate = estimates[i]
        if estimate is None:
            if cell["n"]:
                cell["interval_note"] = ("no interval: no vote on this model, and its interval "
                                         "borrows none (the CRM's win rate shown)")
            continue
        if i not in heads and not cell["votes"]:
            cell["interval_note"] = ("no vote in this topic: the CRM's rate corrected by its "
                                     "model's votes, as its Overall is")
        low, high = estimate.interval(interval.level)
        cell["win_rate"] = round(estimate.win_rate, 4)
        cell["ci_low"], cell["ci_high"] = round(low, 4), round(high, 4)
    wide = _simultaneous_level(interval.level, len(overall))
    return [None if estimates[i] is None else estimates[i].interval(wide) for i in heads]


def kendall_tau(rows_a: list[dict], rows_b: list[dict]) -> dict:
    """Kendall tau-b between two rankings of the same models (-1: one reverses the other)."""
    from scipy.stats import kendalltau

    rank_b = {r["model"]: r["rank"] for r in rows_b}
    models = [r["model"] for r in rows_a]
    ranks_a, ranks_b = [r["rank"] for r in rows_a], [rank_b[m] for m in models]
    # Undefined (NaN, which JSON has no word for) with fewer than two models or one ranking
    # all ties: null, and the reason.
    if len(models) < 2:
        return {"tau": None, "p_value": None, "models": len(models),
                "reason": "one model: no order to compare"}
    if len(set(ranks_a)) < 2 or len(set(ranks_b)) < 2:
        return {"tau": None, "p_value": None, "models": len(models),
                "reason": "every model tied in one ranking: no order to compare"}
    tau, p_value = kendalltau(ranks_a, ranks_b)
    return {"tau": round(float(tau), 4), "p_value": float(p_value), "models": len(models)}


@dataclass
class Board:
    """One ranking: the criteria it was judged under, its rows, how its intervals were made, the
    orders it was judged in and its slot-bias measurement."""

    label: str
    criteria: tuple[str, ...]
    rows: list[dict] = field(default_factory=list)
    method: str = "bootstrap"
    both_orders: bool = False
    slot_bias: dict | None = None
    unscorable: dict | None = None  # pairs too long to fit, their queries left out (`judge`)
    used: int = 0  # the queries it ranks on: the selection's, less those left out
    outcomes: list[Outcome] = field(default_factory=list, repr=False)  # judgments.jsonl's

    def as_dict(self) -> dict:
        return {"label": self.label, "criteria": list(self.criteria), "used": self.used,
                "rows": self.rows,
                "interval_method": self.method,
                "assumes": PPI_ASSUMES if self.method == "ppi" else CRM_IS_USER,
                "both_orders": self.both_orders, "slot_bias": self.slot_bias,
                "unscorable": self.unscorable}


def rank(scorer, selection: Selection, criteria: Sequence[str], label: str = "criteria",
         both_orders: bool | str = False, interval: Bootstrap = Bootstrap(),
         votes: Mapping[tuple[str, str], str] | None = None, slot_sample: int = 0,
         weights: Mapping[tuple[str, str], float] | None = None) -> Board:
    """One board. `slot_sample` > 0 first judges that many of its pairs in both orders
    (crm.evaluation.slot_bias); `both_orders="auto"` then judges every pair in both orders when
    the verdicts follow the slot."""
    bias = (measure_slot_bias(scorer, [e for _, _, e in pairs(selection, criteria)], slot_sample,
                              interval.seed) if slot_sample else None)
    if both_orders == "auto":
        both_orders = bool(bias and bias["biased"])
    elif not isinstance(both_orders, bool):
        raise ValueError(f"both_orders={both_orders!r}: true, false or auto")
    unfit: list[str] = []
    outcomes = judge(scorer, selection, criteria, both_orders=both_orders, unscorable=unfit)
    unscorable = None
    if unfit:
        keys = set(unfit)  # idx and model names may hold "/": the queries from the pairs
        queries = {idx for idx, _, e in pairs(selection, criteria) if e.key in keys}
        if not outcomes:
            raise ConfigError(f"{selection.path}: no benchmark query fits in "
                              f"{scorer.encoder.max_tokens} tokens under the {label} criteria, "
                              "even with shortened responses: shorten the criteria")
        unscorable = {"pairs": len(unfit), "queries": len(queries), "first": unfit[:5]}
        log.warning("%s board: %d pairs (%d queries) cannot fit in %d tokens even with shortened "
                    "responses: those queries are left out for every model (first: %s)", label,
                    len(unfit), len(queries), scorer.encoder.max_tokens, ", ".join(unfit[:5]))
    return Board(label, tuple(criteria),
                 win_rates(outcomes, selection.models, selection.topics, interval, votes,
                           weights),
                 board_method(interval, votes, outcomes), both_orders, bias, unscorable,
                 len(selection.records) - (unscorable["queries"] if unscorable else 0), outcomes)


def judgment(board: str, o: Outcome) -> dict:
    """A line of judgments.jsonl: the verdict the board `board` counted for one pair."""
    return {"board": board, "idx": o.idx, "topic": o.topic, "model": o.model, "verdict": o.result,
            "p_win": round(o.p_win, 6), "p_tie": round(o.p_tie, 6), "p_loss": round(o.p_loss, 6)}


def outcome(line: dict) -> Outcome:
    """A line of judgments.jsonl back as the Outcome it was written from (`judgment`)."""
    return Outcome(line["model"], line["topic"], line["verdict"], line["p_win"], line["idx"],
                   line["p_tie"])


def examples_counts(selection: Selection, boards: Sequence[Board]) -> dict:
    """The selection's counts with the first (the user's) board's left-out queries taken out of
    `used`, so that read = used + left_out + rejected + outside_topics and `used` is its rows'
    n. A contrast board that leaves out another number says so in its own `used`."""
    counts = dict(selection.counts)
    counts["left_out"] = counts["used"] - boards[0].used
    counts["used"] = boards[0].used
    return counts


def leaderboard(scorer, selection: Selection, criteria: Sequence[str],
                contrast: Sequence[str] | None = None, both_orders: bool = False,
                labels: tuple[str, str] = ("criteria", "contrast"),
                interval: Bootstrap = Bootstrap(), votes=None, slot_sample: int = 0,
                judgments: list[dict] | None = None) -> dict:
    """The leaderboard.json document: counts, rejects, one board per criteria set and, with a
    contrast set, the Kendall tau between the two rankings. Given a `judgments` list, the lines
    of judgments.jsonl go there: a `judgment` per judged pair, board by board.

    `votes` (crm.evaluation.user_votes.Votes) are the user's verdicts under `criteria`: they make that
    board's intervals PPI's (interval.method auto or ppi). A contrast board has no votes of its
    own, so its intervals are the bootstrap's and say that they assume the CRM is the user.
    `slot_sample` pairs per board are judged in both orders first (crm.evaluation.slot_bias); a
    board whose verdicts follow the slot says so, and `both_orders="auto"` judges it in both.
    """
    if not criteria:
        raise ValueError("no criteria: give the user's criteria (one line each), or use the "
                         "default criteria")
    used = None if votes is None else votes.used
    boards = [rank(scorer, selection, criteria, labels[0], both_orders, interval, used,
                   slot_sample, None if votes is None else votes.weights)]
    if votes is not None:  # `used`: the votes that reached the estimator
        votes = votes.scored({(o.idx, o.model) for o in boards[0].outcomes})
    if contrast:
        boards.append(rank(scorer, selection, contrast, labels[1], both_orders,
                           replace(interval, method="bootstrap"), slot_sample=slot_sample))
    out = {"bench": selection.path, "baseline": selection.baseline,
           "topics": list(selection.topics), "models": list(selection.models),
           "both_orders": both_orders, "examples": examples_counts(selection, boards),
           "interval": interval_doc(interval, boards[0].method),
           "votes": None if votes is None else votes.counts,
           "rejects": list(selection.rejects), "boards": [b.as_dict() for b in boards]}
    if contrast:
        out["kendall_tau"] = kendall_tau(boards[0].rows, boards[1].rows)
    if judgments is not None:
        judgments.extend(judgment(b.label, o) for b in boards for o in b.outcomes)
    return out
