"""The boards the app serves: one CRM, one benchmark, each criteria set judged once.

A criteria set is judged over every benchmark pair (all topics), once: topic selection, similarity
selection and the drill-down only filter those verdicts, so changing topics never calls the model.
It is judged as crm-leaderboard judges a board of every topic: `slot_sample` of its pairs in both
orders first (crm.evaluation.slot_bias, the same seeded sample), then every pair in one order or,
as `both_orders` says (auto: when the verdicts follow the slot), in both; the board carries the
measurement and the orders, and says so as crm-leaderboard's outputs do.
Verdicts are cached (crm.app.cache); boards derived from them are memoised. The model and its
tokenizer run behind a gate: a bounded number of scorings at once and a bounded number waiting;
one more is refused as busy. A request whose verdicts are cached never touches the gate, so it
never waits behind another user's scoring.

Bad input raises BoardError with a message for the user, before any model call: empty criteria,
too many lines or characters, criteria that leave some pair unable to fit the CRM's token budget,
no topic, an unknown topic, a description that matches no query.
"""
from __future__ import annotations

import math
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from crm.app.cache import VerdictCache, Verdicts, verdict_key
from crm.app.similarity import QueryIndex
from crm.core.lru import LRU
from crm.evaluation.leaderboard import (Bootstrap, Outcome, Selection, board_method,
                                       interval_doc, judge, kendall_tau, pairs, win_rates)
from crm.core.records import RecordError
from crm.evaluation.slot_bias import decide_orders, measure_slot_bias
from crm.evaluation.suggest import suggest_pairs, suggestion_lines
from crm.evaluation.user_votes import read_votes

Progress = Callable[[int, int], None]  # (queries judged, queries in all)
PROGRESS_STEPS = 10  # a board is judged in this many slices, reporting after each


class BoardError(ValueError):
    """A request refused with a message for the user; nothing was scored."""


class Busy(BoardError):
    pass


def _text(value, what: str) -> str:
    """`value` if it is text the model and the cache can read (valid Unicode), else BoardError:
    an API call may send a number, an object or a lone surrogate where text belongs."""
    if not isinstance(value, str):
        raise BoardError(f"{what} must be text, not {type(value).__name__}.")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BoardError(f"{what}: an invalid character at position {exc.start} (a lone "
                         "surrogate, not Unicode text).") from None
    return value


@dataclass(frozen=True)
class Limits:
    """The most a user may type: criteria lines, and characters per text box."""

    lines: int = 20
    chars: int = 2000


class ModelGate:
    """At most `concurrency` scorings at once and `waiting` more in line (each for at most
    `timeout` seconds); any more are refused at once as Busy, so that no request hangs."""

    def __init__(self, concurrency: int = 1, waiting: int = 4, timeout: float = 120.0):
        self.concurrency, self.waiting, self.timeout = concurrency, waiting, timeout
        self._slots = threading.Semaphore(concurrency)
        self._lock = threading.Lock()
        self.admitted = 0

    @contextmanager
    def __call__(self):
        with self._lock:
            if self.admitted >= self.concurrency + self.waiting:
                raise Busy(f"The CRM is busy scoring other boards ({self.admitted} in progress "
                           "or waiting): try again in a minute. Boards already scored are "
                           "served at once.")
            self.admitted += 1
        try:
            if not self._slots.acquire(timeout=self.timeout):
                raise Busy(f"The CRM stayed busy for {self.timeout:.0f} s: try again later.")
            try:
                yield
            finally:
                self._slots.release()
        finally:
            with self._lock:
                self.admitted -= 1


@dataclass(frozen=True)
class Choice:
    """The benchmark examples a board ranks on: the queries of `topics`, or with a description,
    the queries most similar to it (`idx`)."""

    topics: tuple[str, ...]
    idx: frozenset[str] | None = None
    describe: str = ""

    def __contains__(self, outcome: Outcome) -> bool:
        return outcome.topic in self.topics and (self.idx is None or outcome.idx in self.idx)


def version(checkpoint: str | Path, crm_fingerprint: str, bench_fingerprint: str) -> str:
    """The CRM's identity as people read it: its run and name, the training step an export
    records, a short hash; and the benchmark's short hash."""
    # Here, not at the top: crm-usl reads `Limits` above to compose its config, before torch loads.
    from crm.models.export import META, read_meta

    path = Path(checkpoint)
    step = read_meta(path).get("global_step") if (path / META).is_file() else None
    name = f"{path.parent.name}/{path.name}"
    return (f"{name}{f' step {step}' if step is not None else ''} (crm {crm_fingerprint[:8]}) · "
            f"bench {bench_fingerprint[:8]}")


class Leaderboards:
    def __init__(self, scorer, selection: Selection, *, crm_fingerprint: str,
                 bench_fingerprint: str, version: str, cache: VerdictCache,
                 both_orders: bool | str = False, slot_sample: int = 0, dtype: str = "float32",
                 interval: Bootstrap = Bootstrap(), limits: Limits = Limits(),
                 gate: ModelGate | None = None, memo_entries: int = 256):
        self.scorer, self.selection, self.cache = scorer, selection, cache
        self.fingerprints = {"crm": crm_fingerprint, "bench": bench_fingerprint}
        decide_orders(both_orders, None)  # true, false or auto, checked before any request
        self.version, self.both_orders, self.dtype = version, both_orders, dtype
        self.slot_sample = slot_sample
        self.interval, self.limits = interval, limits
        self.gate = gate or ModelGate()
        self.records = {r.idx: r for r in selection.records}
        counts = Counter(r.topic for r in selection.records)
        self.topic_counts = {t: counts[t] for t in selection.topics}  # the benchmark's order
        self.index = QueryIndex(selection.records)
        self.boards = LRU(memo_entries)

    @property
    def models(self) -> tuple[str, ...]:
        return self.selection.models

    # -- input -----------------------------------------------------------------------------------

    def criteria(self, text: str | None, what: str = "criteria") -> tuple[str, ...]:
        """One criterion per non-blank line, whitespace collapsed (what the cache key and the model
        both read, so that spacing alone never makes a new board)."""
        text = _text(text or "", f"The {what}")
        if len(text) > self.limits.chars:
            raise BoardError(f"The {what} are {len(text)} characters long: at most "
                             f"{self.limits.chars}.")
        lines = tuple(line for line in (" ".join(raw.split()) for raw in text.splitlines()) if line)
        if not lines:
            raise BoardError(f"No {what}: write at least one criterion, one per line.")
        if len(lines) > self.limits.lines:
            raise BoardError(f"{len(lines)} lines of {what}: at most {self.limits.lines}.")
        return lines

    def choose(self, topics: Sequence[str] | None, describe: str = "", k: int = 20) -> Choice:
        """The examples to rank on: the queries most similar to `describe` when it is given, else
        those of `topics` (None: all topics; an empty list is an error)."""
        describe = _text(describe or "", "The description")
        if describe.strip():
            if len(describe) > self.limits.chars:
                raise BoardError(f"The description is {len(describe)} characters long: at most "
                                 f"{self.limits.chars}.")
            if isinstance(k, bool) or not isinstance(k, (int, float)) or not math.isfinite(k):
                raise BoardError(f"The number of similar queries must be a number, not {k!r:.40}.")
            near = self.index.nearest(describe, max(1, int(k)))
            if not near:
                raise BoardError("No benchmark query shares a word with the description: "
                                 "describe it in other words, or tick topics.")
            idx = frozenset(i for i, _ in near)
            chosen = {self.records[i].topic for i in idx}
            return Choice(tuple(t for t in self.topic_counts if t in chosen), idx,
                          " ".join(describe.split()))
        if topics is None:
            return Choice(tuple(self.topic_counts))
        if not isinstance(topics, (list, tuple)) or not all(isinstance(t, str) for t in topics):
            raise BoardError("Topics must be a list of topic names (text).")
        if not topics:
            raise BoardError("No topic selected: tick at least one topic, or describe what you "
                             "use an LLM for.")
        unknown = [t for t in topics if t not in self.topic_counts]
        if unknown:
            raise BoardError(f"Unknown topics: {', '.join(map(repr, unknown))}. The benchmark's "
                             f"topics: {', '.join(self.topic_counts)}.")
        wanted = set(topics)
        return Choice(tuple(t for t in self.topic_counts if t in wanted))

    # -- verdicts --------------------------------------------------------------------------------

    def _fields(self, criteria: tuple[str, ...]) -> dict:
        return {**self.fingerprints, "baseline": self.selection.baseline,
                "criteria": list(criteria), "both_orders": self.both_orders,
                "slot_sample": self.slot_sample, "slot_seed": self.interval.seed,
                "dtype": self.dtype}

    def is_cached(self, criteria: tuple[str, ...]) -> bool:
        return self.cache.get(self._fields(criteria)) is not None

    def verdicts(self, criteria: tuple[str, ...], progress: Progress | None = None
                 ) -> list[Outcome]:
        """Every benchmark pair judged under `criteria`: from the cache, or scored now."""
        return self.judged(criteria, progress).outcomes

    def judged(self, criteria: tuple[str, ...], progress: Progress | None = None) -> Verdicts:
        """The outcomes, the slot-bias measurement and the orders judged under `criteria`."""
        fields = self._fields(criteria)
        judged = self.cache.get(fields)
        if judged is not None:
            return judged
        # The fit check tokenizes: behind the gate too, since a fast tokenizer must not be used
        # by two threads at once ("Already borrowed").
        with self.gate():
            judged = self.cache.get(fields)  # scored while this request waited
            if judged is None:
                self._check_fit(criteria)
                judged = self._score(criteria, progress)
                self.cache.put(fields, judged)
        return judged

    def _check_fit(self, criteria: tuple[str, ...]) -> None:
        """Tokenize every pair as the scorer will (no model call): criteria so long that some pair
        cannot fit the CRM's budget, even with its responses shortened, are refused."""
        examples = [e for _, _, e in pairs(self.selection, criteria)]
        encoder = self.scorer.encoder
        if self.scorer.kind == "pointwise":
            ids = encoder.pointwise_many([(e.criteria, e.query, c) for e in examples
                                          for c in (e.conv_a, e.conv_b)])
            unfit = sum(a is None or b is None for a, b in zip(ids[::2], ids[1::2]))
        else:
            unfit = sum(ids is None for ids in encoder.pairwise_many(
                [(e.criteria, e.query, e.conv_a, e.conv_b) for e in examples]))
        if unfit:
            raise BoardError(f"The criteria are too long for this CRM: with them {unfit} of "
                             f"{len(examples)} benchmark pairs do not fit in its "
                             f"{encoder.max_tokens} tokens, even with shortened responses. "
                             "Shorten the criteria.")

    def _score(self, criteria: tuple[str, ...], progress: Progress | None) -> Verdicts:
        # The sample crm-leaderboard measures on a board of every topic (crm.evaluation.leaderboard
        # .rank): the same pairs, in the same order, from the same seed.
        bias = (measure_slot_bias(self.scorer, [e for _, _, e in pairs(self.selection, criteria)],
                                  self.slot_sample, self.interval.seed)
                if self.slot_sample else None)
        both = decide_orders(self.both_orders, bias)
        records = self.selection.records
        step = math.ceil(len(records) / PROGRESS_STEPS)
        outcomes = []
        for start in range(0, len(records), step):
            part = replace(self.selection, records=records[start:start + step])
            outcomes += judge(self.scorer, part, criteria, both)
            if progress:
                progress(min(start + step, len(records)), len(records))
        return Verdicts(outcomes, bias, both)

    # -- boards ----------------------------------------------------------------------------------

    def board(self, criteria: tuple[str, ...], choice: Choice,
              progress: Progress | None = None) -> dict:
        """The leaderboard document (the API's answer): the rows of leaderboard.json for these
        criteria over the chosen examples, with their intervals. Do not modify: it is memoised."""
        memo = (verdict_key(self._fields(criteria)), choice)
        doc = self.boards.get(memo)
        if doc is None:
            judged = self.judged(criteria, progress)
            outcomes = [o for o in judged.outcomes if o in choice]
            doc = {"criteria": list(criteria), "topics": list(choice.topics),
                   "examples": len({o.idx for o in outcomes}), "models": list(self.models),
                   "baseline": self.selection.baseline, "version": self.version,
                   "both_orders": judged.both_orders, "slot_bias": judged.slot_bias,
                   "interval": interval_doc(self.interval, "bootstrap"),
                   "rows": win_rates(outcomes, self.models, choice.topics, self.interval)}
            if choice.idx is not None:
                doc["similar_to"] = choice.describe
            self.boards.put(memo, doc)
        return doc

    def calibrated(self, criteria: tuple[str, ...], choice: Choice,
                   votes: Mapping[tuple[str, str], str]) -> dict:
        """The board with PPI intervals and rank sets from the user's votes ((idx, model) ->
        verdict); votes on queries outside `choice` are left out and counted. No model call once
        the board was scored: its verdicts are cached."""
        doc = dict(self.board(criteria, choice))
        outcomes = [o for o in self.verdicts(criteria) if o in choice]
        judged = {(o.idx, o.model) for o in outcomes}  # votes the estimator can use
        used = {k: v for k, v in votes.items() if k in judged}
        spec = replace(self.interval, method="ppi")
        doc.update(rows=win_rates(outcomes, self.models, choice.topics, spec, used),
                   interval=interval_doc(spec, board_method(spec, used, outcomes)),
                   votes={"used": len(used), "outside_choice": len(votes) - len(used)})
        return doc

    def suggestions(self, criteria: tuple[str, ...], choice: Choice, n: int,
                    exclude=frozenset()) -> list[dict]:
        """crm-leaderboard's suggested_votes lines for this board's examples (crm.evaluation.suggest)."""
        judged = [o for o in self.verdicts(criteria) if o in choice]
        pairs = suggest_pairs(judged, self.models, n, self.interval.seed, exclude,
                              tie_value=self.interval.tie_value)
        return suggestion_lines(self.selection, pairs, criteria)

    def read_votes(self, path: str, criteria: tuple[str, ...]) -> dict[tuple[str, str], str]:
        """An uploaded votes file, checked as crm-leaderboard checks it (given on this benchmark,
        under these criteria); a defect is a BoardError naming the line and the field."""
        try:
            votes = read_votes(path, self.selection, criteria)
        except (RecordError, OSError) as exc:
            raise BoardError(f"Votes file: {exc}".replace(str(path), "line")) from None
        return dict(votes.used)

    def contrast(self, criteria: tuple[str, ...], other: tuple[str, ...], choice: Choice,
                 progress: Progress | None = None) -> dict:
        """Two boards over the same examples and the Kendall tau between their rankings."""
        first = self.board(criteria, choice, progress)
        second = self.board(other, choice, progress)
        return {"boards": [first, second], "kendall_tau": kendall_tau(first["rows"],
                                                                       second["rows"])}

    def examples(self, criteria: tuple[str, ...], choice: Choice, model: str) -> list[dict]:
        """The drill-down: `model`'s judged examples (its response, the baseline's, P(win),
        P(tie)), the CRM's most confident verdicts first."""
        if model not in self.models:
            raise BoardError(f"Unknown model {model!r}: the benchmark ranks "
                             f"{', '.join(self.models)}.")
        show = self.scorer.template.conversation_block
        rows = []
        for o in self.verdicts(criteria):
            if o.model == model and o in choice:
                record = self.records[o.idx]
                rows.append({"idx": o.idx, "topic": o.topic, "query": record.prompt,
                             "response": show(record.responses[model][1:]),
                             "baseline": show(record.responses[self.selection.baseline][1:]),
                             "p_win": round(o.p_win, 4), "p_tie": round(o.p_tie, 4),
                             "result": o.result})
        rows.sort(key=lambda r: -abs(r["p_win"] - 0.5))
        return rows
