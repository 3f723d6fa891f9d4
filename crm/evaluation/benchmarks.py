"""A CRM on the benchmarks the field judges reward models by (docs/EVALUATION.md): RewardBench 2,
RM-Bench, criteria-conditioned ranking sets (`principles`) and prompt / chosen / rejected pairs.

Three steps, each its own function so that the arithmetic can be checked on scores a test sets:

- `load_benchmark`: a local copy in its published layout (Parquet through pyarrow, JSON, JSONL)
  as `Item`s, every defect one line naming the file, the row and the field, before any model call;
  each item carries the criteria it is judged under (the row's own, the config's per subset, or
  the run's override; `criteria=none` is the empty list).
- `score_items`: one scalar per completion. A pointwise CRM gives its reward; a pairwise CRM a
  round robin among the prompt's completions in both orders, the mean win probability
  (`crm.inference.reward.CRMReward.score_groups`: prefix reuse, length-sorted batches across
  prompts, verdict cache).
- `aggregate`: the benchmark's own figures, pure functions of (items, scores), computed as the
  benchmark's published scoring code computes them (ties included); the formulas are in
  docs/EVALUATION.md.

A completion whose prompt cannot fit the CRM (criteria and query alone exceed its length) scores
NaN: every comparison with NaN is false, so it counts as wrong, and `unscorable` says how many.
"""
from __future__ import annotations

import json
import logging
import math
import re
import warnings
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from crm.core.errors import ConfigError

LAYOUTS = ("rewardbench2", "rmbench", "principles", "pairs")
# RewardBench 2's headline is the mean of these six subsets' figures.
RB2_SUBSETS = ("Factuality", "Precise IF", "Math", "Safety", "Focus", "Ties")
RMBENCH_DOMAINS = ("chat", "math", "code", "safety")  # a row's domain starts with one of them
# RewardBench 2's Ties score exists in two versions; crm computes reward-bench's GitHub main
# (docs/EVALUATION.md section 5), and metrics.json says so.
TIES_FORMULA = ("reward-bench main since PR #244: a prompt whose correct answers all score alike "
                "(spread 0) counts tanh(+-inf) = +-1 in margin_score; the PyPI package rewardbench "
                "0.1.4 leaves such a prompt out")
NO_CRITERIA = "none"  # criteria=none: every prompt judged under the empty criteria list
DEFAULT = "default"  # the criteria key for a subset the config does not name
FILE_SUFFIXES = (".parquet", ".jsonl", ".json")
# Sequences per scorer call: their token ids are held at once (a Ties prompt of 30 completions is
# 870 sequences for a pairwise CRM), and the batches sort by length within a call.
SEQUENCES_PER_CALL = 4096

log = logging.getLogger(__name__)


class BenchmarkError(ConfigError):
    """A benchmark file that is not its layout: one line naming the file, the row and the field."""


@dataclass
class BenchmarkConfig:
    """configs/benchmark/<name>.yaml: which layout, where its local copy is, its default criteria."""

    name: str = "pairs"  # rewardbench2 | rmbench | principles | pairs
    path: str = "???"  # a file, or a directory whose .parquet / .json / .jsonl files are read
    criteria: dict[str, list[str]] = field(default_factory=dict)  # subset key -> criteria

    def __post_init__(self):
        if self.name not in LAYOUTS:
            raise ValueError(f"benchmark={self.name}: expected one of {', '.join(LAYOUTS)}")
        for key, value in self.criteria.items():
            if not value or not all(isinstance(c, str) and c.strip() for c in value):
                raise ValueError(f"benchmark.criteria.{key}: a non-empty list of non-empty strings")


def criteria_override(value) -> tuple[str, ...] | None:
    """The run's `criteria=`: None (each subset's default), `none` (the empty list, to measure
    what the criteria add), one string or a list of strings (for every prompt)."""
    if value is None:
        return None
    if value == NO_CRITERIA:
        return ()
    if isinstance(value, str):
        value = [value]
    if (not isinstance(value, (list, tuple)) or not value
            or not all(isinstance(c, str) and c.strip() for c in value)):
        raise ValueError(f"criteria={value!r}: null (the benchmark's defaults), none (no criteria) "
                         "or a non-empty list of non-empty strings")
    return tuple(c.strip() for c in value)


def subset_key(name: str) -> str:
    """A subset's key in `benchmark.criteria`: lower case, runs of other characters as `_`
    ("Precise IF" -> precise_if, "safety-refuse" -> safety_refuse)."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


@dataclass(frozen=True)
class Item:
    """One benchmark prompt with its completions in the benchmark's own order."""

    id: str
    subset: str  # RM-Bench: the row's domain
    query: str
    completions: tuple  # texts (or message lists for `pairs`), chosen first where there are any
    criteria: tuple[str, ...]
    num_correct: int = 0  # the first num_correct completions are the chosen (correct) ones
    gold: tuple[float, ...] = ()  # principles: a gold score per completion, higher is better


@dataclass
class Benchmark:
    name: str
    path: str
    items: list[Item]
    criteria: dict  # what each subset was judged under, for metrics.json
    skipped: dict = field(default_factory=dict)  # rows read but not scored, by reason


# -- reading ---------------------------------------------------------------------------------------

def data_files(path: str | Path) -> list[Path]:
    """The file, or a directory's data files (a `huggingface-cli download` snapshot), sorted."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise BenchmarkError(f"benchmark.path={path}: no such file or directory")
    files = sorted(p for p in path.rglob("*") if p.suffix in FILE_SUFFIXES and p.is_file()
                   and not any(part.startswith(".") for part in p.relative_to(path).parts))
    if not files:
        raise BenchmarkError(f"benchmark.path={path}: no {', '.join(FILE_SUFFIXES)} file there")
    return files


def read_rows(path: str | Path) -> list[tuple[str, dict]]:
    """(where, row) for every row of the benchmark's files; `where` reads FILE:row N (Parquet, a
    JSON list, 1-based) or FILE:N (the line of a JSONL file)."""
    rows = []
    for file in data_files(path):
        if file.suffix == ".parquet":
            import pyarrow.parquet as pq

            try:
                table = pq.read_table(file).to_pylist()
            except Exception as exc:  # pyarrow's ArrowInvalid and such: not a Parquet file
                raise BenchmarkError(f"{file}: not a readable Parquet file ({exc})") from None
            rows += [(f"{file}:row {i}", r) for i, r in enumerate(table, 1)]
        elif file.suffix == ".jsonl" or _json_lines(file):
            with open(file, "rb") as f:
                for n, raw in enumerate(f, 1):
                    try:
                        line = raw.decode("utf-8-sig" if n == 1 else "utf-8")
                    except UnicodeDecodeError:
                        raise BenchmarkError(f"{file}:{n}: not UTF-8") from None
                    if line.strip():
                        rows.append((f"{file}:{n}", _json(line, f"{file}:{n}")))
        else:
            data = _json(file.read_text(encoding="utf-8-sig"), str(file))
            if not isinstance(data, list):
                raise BenchmarkError(f"{file}: a JSON list of rows expected, found "
                                     f"{type(data).__name__}")
            rows += [(f"{file}:row {i}", r) for i, r in enumerate(data, 1)]
    for where, row in rows:
        if not isinstance(row, dict):
            raise BenchmarkError(f"{where}: a row is an object, found {type(row).__name__}")
    return rows


def _json_lines(file: Path) -> bool:
    """Whether a .json file holds JSON lines (what `datasets`' to_json writes) rather than a list."""
    with open(file, "rb") as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    return head.startswith(b"{")


def _json(text: str, where: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise BenchmarkError(f"{where}: not JSON ({exc.msg} at character {exc.pos})") from None


def _field(row: dict, where: str, name: str):
    if name not in row or row[name] is None:
        raise BenchmarkError(f"{where}: {name}: missing (the row has {', '.join(sorted(row))})")
    return row[name]


def _text(row: dict, where: str, name: str) -> str:
    value = _field(row, where, name)
    if not isinstance(value, str) or not value.strip():
        raise BenchmarkError(f"{where}: {name}: a non-empty string expected, found {value!r:.60}")
    return value


def _texts(row: dict, where: str, name: str, length: int | None = None) -> tuple[str, ...]:
    value = _field(row, where, name)
    if not isinstance(value, (list, tuple)):
        raise BenchmarkError(f"{where}: {name}: a list of strings expected, found "
                             f"{type(value).__name__}")
    if not all(isinstance(v, str) for v in value):
        odd = next(v for v in value if not isinstance(v, str))
        raise BenchmarkError(f"{where}: {name}: a list of strings expected, found an item of "
                             f"type {type(odd).__name__}")
    if not value or (length is not None and len(value) != length):
        raise BenchmarkError(f"{where}: {name}: {len(value)} completions, expected "
                             f"{length if length is not None else 'at least one'}")
    return tuple(value)


def _count(row: dict, where: str, name: str) -> int:
    value = _field(row, where, name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise BenchmarkError(f"{where}: {name}: an integer expected, found {value!r}")
    return value


def _own_criteria(row: dict, where: str, name: str) -> tuple[str, ...] | None:
    if row.get(name) is None:
        return None
    value = row[name]
    value = [value] if isinstance(value, str) else value
    if (not isinstance(value, (list, tuple)) or not value
            or not all(isinstance(c, str) and c.strip() for c in value)):
        raise BenchmarkError(f"{where}: {name}: a non-empty string or list of non-empty strings")
    return tuple(c.strip() for c in value)


class _Criteria:
    """Which criteria a subset is judged under: the run's override, else a row's own, else the
    config's for the subset (or its RM-Bench domain family), else the config's default."""

    def __init__(self, config: BenchmarkConfig, override: tuple[str, ...] | None):
        self.config, self.override = config, override
        self.used: dict[str, list[str]] = {}

    def __call__(self, subset: str, own: tuple[str, ...] | None = None) -> tuple[str, ...]:
        if self.override is not None:
            chosen = self.override
        elif own is not None:
            self.used.setdefault(subset, "each row's own")
            return own
        else:
            keys = [subset_key(subset), subset_key(subset).split("_")[0], DEFAULT]
            found = next((k for k in keys if k in self.config.criteria), None)
            if found is None:
                raise BenchmarkError(
                    f"benchmark {self.config.name}: no criteria for subset {subset!r}: set "
                    f"benchmark.criteria.{subset_key(subset)}=[...], benchmark.criteria."
                    f"{DEFAULT}=[...] or criteria=[...]")
            chosen = tuple(self.config.criteria[found])
        self.used.setdefault(subset, list(chosen))
        return chosen


def load_benchmark(config: BenchmarkConfig, override: tuple[str, ...] | None = None) -> Benchmark:
    """The benchmark's items, checked whole before any model call."""
    criteria = _Criteria(config, override)
    rows = read_rows(config.path)
    if not rows:
        raise BenchmarkError(f"benchmark.path={config.path}: no rows")
    skipped: Counter = Counter()
    reader = {"rewardbench2": _rewardbench2, "rmbench": _rmbench, "principles": _principles,
              "pairs": _pairs}[config.name]
    items = [item for where, row in rows
             if (item := reader(row, where, criteria, skipped)) is not None]
    if config.name == "rewardbench2":
        _check_ties_ids(items, rows)
    return Benchmark(config.name, str(config.path), items,
                     {"override": None if override is None else list(override),
                      "by_subset": dict(sorted(criteria.used.items()))}, dict(skipped))


def _rewardbench2(row: dict, where: str, criteria: _Criteria, skipped: Counter) -> Item:
    subset = _text(row, where, "subset")
    chosen, rejected = _texts(row, where, "chosen"), _texts(row, where, "rejected")
    num_correct = _count(row, where, "num_correct")
    if num_correct != len(chosen):
        raise BenchmarkError(f"{where}: num_correct: {num_correct}, but chosen holds {len(chosen)}")
    if row.get("num_incorrect") is not None and row["num_incorrect"] != len(rejected):
        raise BenchmarkError(f"{where}: num_incorrect: {row['num_incorrect']}, but rejected holds "
                             f"{len(rejected)}")
    total = _count(row, where, "total_completions")
    if total != len(chosen) + len(rejected):
        raise BenchmarkError(f"{where}: total_completions: {total}, but chosen + rejected hold "
                             f"{len(chosen) + len(rejected)}")
    row_id = str(_field(row, where, "id"))
    if subset_key(subset) == "ties":
        kind = _ties_id(row_id, where)
        if kind == "tied" and num_correct < 2:
            raise BenchmarkError(f"{where}: num_correct: a tied: prompt holds several correct "
                                 f"answers, found {num_correct}")
    return Item(row_id, subset, _text(row, where, "prompt"), chosen + rejected,
                criteria(subset), num_correct=num_correct)


def _ties_id(row_id: str, where: str) -> str:
    kind, _, number = row_id.partition(":")
    if kind not in ("ref", "tied") or not number.isdigit():
        raise BenchmarkError(f"{where}: id: {row_id!r}: a Ties row's id is ref:N or tied:N")
    return kind


def _check_ties_ids(items: list[Item], rows: list[tuple[str, dict]]) -> None:
    """A Ties id appears once: reward-bench pools the completions of rows sharing an id."""
    seen: dict[str, str] = {}
    for item, (where, _) in zip(items, rows):
        if subset_key(item.subset) == "ties":
            if item.id in seen:
                raise BenchmarkError(f"{where}: id: {item.id!r} again (first at {seen[item.id]})")
            seen[item.id] = where


def _rmbench(row: dict, where: str, criteria: _Criteria, skipped: Counter) -> Item:
    domain = _text(row, where, "domain") if "domain" in row else _file_domain(where)
    if not domain.startswith(RMBENCH_DOMAINS):
        raise BenchmarkError(f"{where}: domain: {domain!r} starts with none of "
                             f"{', '.join(RMBENCH_DOMAINS)}")
    chosen, rejected = _texts(row, where, "chosen", 3), _texts(row, where, "rejected", 3)
    return Item(str(_field(row, where, "id")), domain, _text(row, where, "prompt"),
                chosen + rejected, criteria(domain), num_correct=3)


def _file_domain(where: str) -> str:
    """A row's RM-Bench domain from its file's name, as RM-Bench's own scripts take it: the
    domains' files (code_filtered.json, safety-refuse_filtered.json, ...) have no `domain` key."""
    file = Path(where.rsplit(":", 1)[0])
    domain = file.stem.split("_")[0]
    if not domain.startswith(RMBENCH_DOMAINS):
        raise BenchmarkError(f"{where}: domain: missing, and the file's name {file.name!r} names "
                             f"no domain ({', '.join(RMBENCH_DOMAINS)}: e.g. code_filtered.json)")
    return domain


def _principles(row: dict, where: str, criteria: _Criteria, skipped: Counter) -> Item:
    own = _own_criteria(row, where, "principle") or _own_criteria(row, where, "criteria")
    if own is None:
        raise BenchmarkError(f"{where}: principle: missing (or criteria: the row's principle)")
    responses = _field(row, where, "responses")
    if isinstance(responses, dict):
        names, texts = list(responses), list(responses.values())
    elif isinstance(responses, list):
        names, texts = list(range(len(responses))), responses
    else:
        raise BenchmarkError(f"{where}: responses: an object (name -> text) or a list expected")
    if len(texts) < 2 or not all(isinstance(t, str) for t in texts):
        raise BenchmarkError(f"{where}: responses: at least two texts expected")
    gold = _gold(row, where, names)
    subset = str(row.get("subset") or row.get("domain") or "all")
    return Item(str(row.get("id", where.rsplit(":", 1)[-1].removeprefix("row "))), subset,
                _text(row, where, "prompt"), tuple(texts), criteria(subset, own), gold=gold)


def _gold(row: dict, where: str, names: list) -> tuple[float, ...]:
    """A gold score per response, higher is better: `scores` (a number per response, by name or
    in order; equal numbers are tied ranks) or `best-to-worst` (every name, best first)."""
    if row.get("scores") is not None:
        scores = row["scores"]
        if isinstance(scores, dict):
            if set(scores) != {str(n) for n in names}:
                raise BenchmarkError(f"{where}: scores: names {sorted(scores)} differ from "
                                     f"the responses' {sorted(map(str, names))}")
            values = [scores[str(n)] for n in names]
        else:
            values = scores
        if (not isinstance(values, list) or len(values) != len(names) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                for v in values)):
            raise BenchmarkError(f"{where}: scores: a finite number per response expected")
        return tuple(float(v) for v in values)
    order = row.get("best-to-worst")
    if order is None:
        raise BenchmarkError(f"{where}: scores: missing (or best-to-worst: the gold order)")
    if sorted(map(str, order)) != sorted(map(str, names)):
        raise BenchmarkError(f"{where}: best-to-worst: every response name once expected")
    rank = {str(n): i for i, n in enumerate(order)}
    return tuple(float(len(names) - rank[str(n)]) for n in names)


def _pairs(row: dict, where: str, criteria: _Criteria, skipped: Counter) -> Item | None:
    if "preference" in row or "model_a" in row:  # crm's own test format (docs/DESIGN.md 3.1)
        from crm.core.records import RecordError, parse_test

        try:
            record = parse_test(row)
        except RecordError as exc:  # it reads `field: reason`
            raise BenchmarkError(f"{where}: {exc}") from None
        if record.preference == "tie":
            skipped["gold_ties"] += 1
            return None
        a, b = record.model_a[1:], record.model_b[1:]
        chosen, rejected = (a, b) if record.preference == "model_a" else (b, a)
        subset = record.topic or "all"
        return Item(record.idx, subset, record.model_a[0].content, (chosen, rejected),
                    criteria(subset, record.criteria), num_correct=1)
    subset = str(row.get("subset") or "all")
    own = _own_criteria(row, where, "criteria")
    completions = tuple(_text(row, where, side) for side in ("chosen", "rejected"))
    return Item(str(row.get("id", where.rsplit(":", 1)[-1].removeprefix("row "))), subset,
                _text(row, where, "prompt"), completions, criteria(subset, own), num_correct=1)


# -- scoring ---------------------------------------------------------------------------------------

def score_items(scorer, items: Sequence[Item], progress: bool = False) -> tuple[list, dict]:
    """(a score per completion for every item, counts): a pointwise CRM's reward, a pairwise CRM's
    round robin (mean win probability over both orders, docs/EVALUATION.md). Items whose criteria
    and query cannot fit the CRM, or whose completions the length policy cannot fit, get NaN
    scores (an item with any NaN is counted `unscorable`)."""
    from tqdm.auto import tqdm

    from crm.inference.engine import RayScorer
    from crm.inference.reward import CRMReward, split_calls

    if isinstance(scorer, RayScorer):  # blocks of prompts over Ray's workers
        scores, _, forwards = scorer.score_groups(
            [(item.criteria, item.query, item.completions) for item in items],
            names=[item.id for item in items], sequences_per_call=SEQUENCES_PER_CALL)
        unscorable = sum(any(math.isnan(v) for v in values) for values in scores)
        return scores, {"prompts": len(items), "completions": sum(len(s) for s in scores),
                        "unscorable": unscorable, "forwards": forwards,
                        "strategy": "round_robin" if scorer.kind == "pairwise" else "pointwise"}
    # A prompt the fit check passes may still be one the encoder drops (a cut that tokenizes
    # longer): NaN, counted, never an abort of the whole benchmark.
    reward = CRMReward(scorer, unfit="nan")
    scorer_progress, scorer.progress = scorer.progress, False  # one bar, over prompts
    scores: list = [None] * len(items)
    fitting = reward.fits([(item.criteria, item.query) for item in items])
    fit = [i for i, ok in enumerate(fitting) if ok]
    for i in sorted(set(range(len(items))) - set(fit)):
        scores[i] = [math.nan] * len(items[i].completions)
    try:
        with tqdm(total=len(items), disable=not progress, unit="prompt", dynamic_ncols=True,
                  leave=False) as bar:
            bar.update(len(items) - len(fit))
            for chunk in split_calls([len(items[i].completions) for i in fit], fit,
                                     SEQUENCES_PER_CALL, pairwise=reward.strategy == "round_robin"):
                groups = [(items[i].criteria, items[i].query, items[i].completions) for i in chunk]
                for i, values in zip(chunk, reward.score_groups(groups)):
                    scores[i] = values
                bar.update(len(chunk))
    finally:
        scorer.progress = scorer_progress
    unscorable = sum(any(math.isnan(v) for v in values) for values in scores)
    counts = {"prompts": len(items), "completions": sum(len(s) for s in scores),
              "unscorable": unscorable, "forwards": reward.counts["forwards"],
              "strategy": reward.strategy}
    return scores, counts


# -- the benchmarks' figures -----------------------------------------------------------------------

def _mean(values) -> float | None:
    """The mean, or None for nothing (an empty subset is reported, never divided by zero)."""
    values = list(values)
    return float(np.mean(values)) if values else None


def best_of_n(scores: Sequence[float]) -> float:
    """RewardBench 2's result for one prompt: 1 / (completions tied at the maximum) when the
    first completion (the chosen one) holds the maximum, else 0."""
    values = np.asarray(scores, dtype=float)
    top = np.max(values)
    return float(1 / np.sum(values == top)) if values[0] == top else 0.0


def ties_score(items: Sequence[Item], scores: Sequence[Sequence[float]]) -> dict:
    """RewardBench 2's Ties score. Per prompt (ref:N has one correct answer, tied:N several):
    accurate = the worst correct outscores the best incorrect; the correct answers' spread
    (best - worst correct) and the correct-incorrect margin (worst correct - best incorrect).
    score = 0.30 tied accuracy + 0.30 ref accuracy + 0.20 correctness-preferred (a tied prompt's
    margin exceeds its spread) + 0.20 correctness-preferred-hard (the smaller of the tied and
    ref margins exceeds it) + 0.01 mean tanh(min margin / spread - 1) (NaN as 0), the last three
    over the N that have both a ref and a tied prompt."""
    stats: dict[str, dict[int, tuple]] = {"ref": {}, "tied": {}}
    for item, values in zip(items, scores):
        kind, _, number = item.id.partition(":")
        correct, incorrect = list(values[:item.num_correct]), list(values[item.num_correct:])
        spread = max(correct) - min(correct) if len(correct) > 1 else None
        margin = min(correct) - max(incorrect)
        stats[kind][int(number)] = (margin > 0, spread, margin)
    ref, tied = stats["ref"], stats["tied"]
    out = {"n": len(items), "ref_prompts": len(ref), "tied_prompts": len(tied),
           "ref_accuracy": float(np.mean([s[0] for s in ref.values()])) if ref else 0.0,
           "tied_accuracy": float(np.mean([s[0] for s in tied.values()])) if tied else 0.0}
    both = set(ref) & set(tied)
    out["paired_prompts"] = len(both)
    if not both:
        out.update(correctness_preferred=None, correctness_preferred_hard=None,
                   margin_score=None, score=None)
        return out
    spread = np.array([tied[n][1] for n in both])
    tied_margin = np.array([tied[n][2] for n in both])
    ref_margin = np.array([ref[n][2] for n in both])
    least = np.minimum(ref_margin, tied_margin)
    out["correctness_preferred"] = float(np.mean(tied_margin > spread))
    out["correctness_preferred_hard"] = float(np.mean(least > spread))
    with np.errstate(divide="ignore", invalid="ignore"):
        margins = np.nan_to_num(np.tanh(least / spread - 1), nan=0.0)
    out["margin_score"] = float(np.mean(margins))
    out["score"] = float(0.30 * out["tied_accuracy"] + 0.30 * out["ref_accuracy"]
                         + 0.20 * out["correctness_preferred"]
                         + 0.20 * out["correctness_preferred_hard"] + 0.01 * out["margin_score"])
    return out


def rewardbench2_metrics(items: Sequence[Item], scores: Sequence[Sequence[float]]) -> dict:
    """Per subset: best-of-N accuracy (the mean of `best_of_n`), or the Ties score; `score` is
    the mean of the six subsets' figures (over those present; `missing` names the others)."""
    by_subset = defaultdict(list)
    for i, item in enumerate(items):
        by_subset[item.subset].append(i)
    subsets = {}
    for subset, index in by_subset.items():
        if subset_key(subset) == "ties":
            subsets[subset] = ties_score([items[i] for i in index], [scores[i] for i in index])
        else:
            results = [best_of_n(scores[i]) for i in index]
            # Summed in order, as reward-bench sums them (numpy's pairwise sum rounds otherwise).
            subsets[subset] = {"n": len(index), "accuracy": sum(results) / len(results)}
    figures = {s: figure("rewardbench2", m) for s, m in subsets.items()}
    scored = [s for s in RB2_SUBSETS if figures.get(s) is not None]
    return {"score": _mean(figures[s] for s in scored),
            "missing": [s for s in RB2_SUBSETS if s not in figures],  # no row in the file
            # in the file, without a figure: a Ties subset with no ref:N / tied:N pair
            "unscored": [s for s in RB2_SUBSETS if s in figures and figures[s] is None],
            "ties_formula": TIES_FORMULA,
            "subsets": dict(sorted(subsets.items()))}


def style_accuracies(items: Sequence[Item], scores: Sequence[Sequence[float]]) -> dict:
    """RM-Bench's 3 x 3 matrix (chosen style i vs rejected style j, the share of prompts where
    chosen i scores strictly above rejected j; styles concise, detailed plain, detailed markdown):
    hard = the mean of the upper-right triangle, normal = of the diagonal, easy = of the
    lower-left triangle."""
    matrix = np.zeros((3, 3))
    for values in scores:
        for i in range(3):
            for j in range(3):
                if values[i] > values[3 + j]:
                    matrix[i][j] += 1
    matrix /= len(scores)
    return {"n": len(items), "hard_acc": float(np.sum(np.triu(matrix, 1)) / 3.0),
            "normal_acc": float(np.mean(np.diag(matrix))),
            "easy_acc": float(np.sum(np.tril(matrix, -1)) / 3.0), "matrix": matrix.tolist()}


def rmbench_metrics(items: Sequence[Item], scores: Sequence[Sequence[float]]) -> dict:
    """Per domain family (chat, math, code, safety: safety-refuse and safety-response are
    safety) the three accuracies and their mean; overall, each accuracy's mean over the domains
    and `total_avg_acc`, the mean of the domains' means. A domain without rows is reported with
    n = 0 and left out of the means."""
    domains = {}
    for family in RMBENCH_DOMAINS:
        index = [i for i, item in enumerate(items) if item.subset.startswith(family)]
        if not index:
            domains[family] = {"n": 0}
            continue
        m = style_accuracies([items[i] for i in index], [scores[i] for i in index])
        m["avg"] = float(np.mean([m["hard_acc"], m["normal_acc"], m["easy_acc"]]))
        domains[family] = m
    present = [m for m in domains.values() if m["n"]]
    return {**{key: _mean(m[key] for m in present) for key in ("hard_acc", "normal_acc", "easy_acc")},
            "total_avg_acc": _mean(m["avg"] for m in present), "domains": domains}


def ranking_agreement(items: Sequence[Item], scores: Sequence[Sequence[float]]) -> dict:
    """Criteria-conditioned rankings: `pair_accuracy` = the share of gold-ordered pairs (gold
    scores differ; tied gold ranks give no pair) whose better response scores strictly higher,
    over all pairs; `kendall_tau_b` = the mean over items of Kendall's tau-b between gold and
    scores (ties in either corrected for), items where it is undefined (every gold or every
    score equal) counted in `tau_undefined`."""
    from scipy.stats import kendalltau

    correct = total = 0
    taus, undefined = [], 0
    for item, values in zip(items, scores):
        gold = item.gold
        for i in range(len(gold)):
            for j in range(len(gold)):
                if gold[i] > gold[j]:
                    total += 1
                    correct += bool(values[i] > values[j])
        with warnings.catch_warnings():  # constant input: tau-b is undefined, counted below
            warnings.simplefilter("ignore")
            tau = kendalltau(gold, values, variant="b").statistic
        if math.isnan(tau):
            undefined += 1
        else:
            taus.append(float(tau))
    return {"n": len(items), "pairs": total, "pair_accuracy": correct / total if total else None,
            "kendall_tau_b": _mean(taus), "tau_undefined": undefined}


def principles_metrics(items: Sequence[Item], scores: Sequence[Sequence[float]]) -> dict:
    return _with_subsets(ranking_agreement, items, scores)


def pair_accuracy(items: Sequence[Item], scores: Sequence[Sequence[float]]) -> dict:
    """The share of pairs whose chosen completion scores strictly above the rejected one."""
    wins = [bool(values[0] > values[1]) for values in scores]
    return {"n": len(items), "accuracy": _mean(wins)}


def pairs_metrics(items: Sequence[Item], scores: Sequence[Sequence[float]]) -> dict:
    return _with_subsets(pair_accuracy, items, scores)


def _with_subsets(measure, items, scores) -> dict:
    out = measure(items, scores)
    by_subset = defaultdict(list)
    for i, item in enumerate(items):
        by_subset[item.subset].append(i)
    if set(by_subset) != {"all"}:
        out["subsets"] = {s: measure([items[i] for i in index], [scores[i] for i in index])
                          for s, index in sorted(by_subset.items())}
    return out


AGGREGATES = {"rewardbench2": rewardbench2_metrics, "rmbench": rmbench_metrics,
              "principles": principles_metrics, "pairs": pairs_metrics}
HEADLINES = {"rewardbench2": "score", "rmbench": "total_avg_acc", "principles": "pair_accuracy",
             "pairs": "accuracy"}


def aggregate(name: str, items: Sequence[Item], scores: Sequence[Sequence[float]]) -> dict:
    if not items:
        return {"n": 0, HEADLINES[name]: None}
    return AGGREGATES[name](items, scores)


def figure(name: str, subset_metrics: dict) -> float | None:
    """A subset's one figure: RewardBench 2's accuracy or Ties score, RM-Bench's domain mean,
    a ranking set's pair accuracy, a pair set's accuracy."""
    key = {"rewardbench2": "score" if "score" in subset_metrics else "accuracy",
           "rmbench": "avg"}.get(name, HEADLINES[name])
    return subset_metrics.get(key)


def summary(name: str, metrics: dict) -> dict[str, float | None]:
    """The flat figures a logger and a sweep's report show: the headline, RM-Bench's hard /
    normal / easy, a ranking set's tau-b, then each subset's (or domain's) figure."""
    out = {HEADLINES[name]: metrics.get(HEADLINES[name])}
    if name == "rmbench":
        out.update({k: metrics[k] for k in ("hard_acc", "normal_acc", "easy_acc")})
    if name == "principles":
        out["kendall_tau_b"] = metrics.get("kendall_tau_b")
    parts = metrics.get("subsets") or metrics.get("domains") or {}
    out.update({subset: figure(name, m) for subset, m in parts.items()})
    return out


# -- a run -----------------------------------------------------------------------------------------

def run_benchmark(scorer, benchmark: Benchmark, out_dir: str | Path,
                  progress: bool = False) -> dict:
    """Score `benchmark`, write out_dir/scores.jsonl (a line per completion: id, subset, index,
    score; NaN as null) and return its metrics (what metrics.json holds)."""
    scores, counts = score_items(scorer, benchmark.items, progress=progress)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "scores.jsonl.tmp"
    with open(tmp, "w", encoding="utf-8") as out:
        for item, values in zip(benchmark.items, scores):
            for index, score in enumerate(values):
                out.write(json.dumps({"id": item.id, "subset": item.subset, "index": index,
                                      "score": None if math.isnan(score) else score},
                                     ensure_ascii=False) + "\n")
    tmp.replace(out_dir / "scores.jsonl")
    metrics = aggregate(benchmark.name, benchmark.items, scores)
    return {"benchmark": benchmark.name, "path": benchmark.path, "kind": scorer.kind,
            **counts, "skipped": benchmark.skipped, "criteria": benchmark.criteria,
            "summary": summary(benchmark.name, metrics), **metrics}


def score_benchmarks(scorer, benchmarks: list[Benchmark], out_dir: Path, logger, step: int) -> dict:
    """crm-train's benchmarks after fit (global rank 0, the process group left): each one's
    metrics, scores.jsonl in out_dir/<name>, logged per subset as benchmark/<name>/<figure>."""
    results = {}
    for benchmark in benchmarks:
        result = run_benchmark(scorer, benchmark, out_dir / benchmark.name)
        log.info("%s", describe(result))
        results[benchmark.name] = result
        if logger:
            logger.log_metrics({f"benchmark/{benchmark.name}/{key}": value
                                for key, value in result["summary"].items() if value is not None},
                               step=step)
    if logger:
        logger.save()
    return results


def describe(result: dict) -> str:
    """A run's figures in a few lines (crm-eval and crm-train print them)."""
    def fmt(value) -> str:
        return "n/a" if value is None else f"{value:.4f}"

    figures = "  ".join(f"{key} {fmt(value)}" for key, value in result["summary"].items())
    return (f"{result['benchmark']}: {figures}\n  {result['prompts']} prompts, "
            f"{result['completions']} completions, {result['forwards']} forwards "
            f"({result['strategy']}), {result['unscorable']} unscorable")
