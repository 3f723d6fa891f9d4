"""A user's votes (`crm-leaderboard votes=FILE`): their own verdict on a few of the board's pairs.

One JSONL line per vote: a line of the board's suggested_votes.jsonl (crm.evaluation.suggest) with
`"verdict": "win" | "tie" | "loss"` added, the user's verdict on that model's response against
the baseline's under the board's criteria. What a vote must hold: idx, model, verdict, and the
criteria and bench fingerprint of the board it was given on, so that votes given under one
criteria set never calibrate a board under another; the rest of a suggested line (topic, prompt,
baseline, response) may stay, and `p`, the pair's inclusion probability when it was drawn by
`strategy=active`, must, on every line or none. The whole file is checked against the
benchmark's selection before any model loads; the first defect raises a RecordError that reads
`FILE:LINE: field: reason`. Votes on queries outside the selected topics, or on benchmark lines
rejected for every model, are counted and reported, not used: read = used + outside_topics +
on_rejected_lines (and, once the board is judged, used = scored + unscorable).
"""
from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from crm.core.records import RecordError, read_lines
from crm.evaluation.leaderboard import LOSS, TIE, WIN

VERDICTS = (WIN, TIE, LOSS)
FIELDS = ("idx", "model", "verdict", "criteria", "bench")
# A suggested line's other fields: shown to the user, kept in the file, not read.
CONTEXT = ("topic", "prompt", "baseline", "response")
INCLUSION = "p"


@dataclass(frozen=True)
class Vote:
    idx: str
    model: str
    verdict: str
    criteria: tuple[str, ...]
    bench: str
    p: float | None = None


@dataclass(frozen=True)
class Votes:
    path: str
    used: dict[tuple[str, str], str] = field(default_factory=dict)  # (idx, model) -> verdict
    outside_topics: int = 0
    on_rejected_lines: int = 0
    # (idx, model) -> the vote's weight, 1 / its inclusion probability: only for votes drawn
    # with unequal probabilities (strategy=active); empty for a uniform sample
    weights: dict[tuple[str, str], float] = field(default_factory=dict)
    unscorable: int | None = None  # of `used`, on pairs the CRM could not score (None: not judged)

    @property
    def counts(self) -> dict:
        used = len(self.used)
        out = {"file": self.path, "read": used + self.outside_topics + self.on_rejected_lines + (
                   self.unscorable or 0),
               "used": used, "outside_topics": self.outside_topics,
               "on_rejected_lines": self.on_rejected_lines}
        if self.unscorable is not None:
            out["unscorable"] = self.unscorable
        if self.weights:
            out["weighted"] = "inverse inclusion probability (strategy=active)"
        return out

    def scored(self, judged: Collection[tuple[str, str]]) -> "Votes":
        """Only the votes on pairs the board judged: the rest counted as unscorable."""
        used = {k: v for k, v in self.used.items() if k in judged}
        return replace(self, used=used, weights={k: w for k, w in self.weights.items()
                                                 if k in used},
                       unscorable=len(self.used) - len(used))


def _text(value, name: str) -> str:
    if isinstance(value, str):
        return value
    raise RecordError(f"must be a string, not {'null' if value is None else type(value).__name__}",
                      name)


def _vote(obj) -> Vote:
    if not isinstance(obj, dict):
        raise RecordError(f"a vote is a JSON object with {', '.join(FIELDS)}, not "
                          f"{type(obj).__name__}")
    extra = sorted(set(obj) - set(FIELDS) - set(CONTEXT) - {INCLUSION})
    if extra:
        raise RecordError(f"unknown field (a vote has {', '.join(FIELDS)}, and may keep a "
                          "suggested line's other fields)", extra[0])
    for name in FIELDS:
        if name not in obj:
            how = (" (the board's suggested_votes.jsonl lines carry it: add a verdict to them)"
                   if name in ("criteria", "bench") else "")
            raise RecordError(f"missing field{how}", name)
    idx = obj["idx"]
    if isinstance(idx, int) and not isinstance(idx, bool):
        idx = str(idx)  # as the benchmark reads its idx
    elif not isinstance(idx, str):
        raise RecordError(f"must be a string or an integer, not "
                          f"{'null' if idx is None else type(idx).__name__}", "idx")
    model, verdict, bench = (_text(obj[name], name) for name in ("model", "verdict", "bench"))
    if verdict not in VERDICTS:
        raise RecordError(f"{verdict[:40]!r} is not one of {', '.join(VERDICTS)}", "verdict")
    criteria = obj["criteria"]
    if not isinstance(criteria, list) or not all(isinstance(c, str) for c in criteria):
        raise RecordError("must be the board's criteria, a list of strings", "criteria")
    p = obj.get(INCLUSION)
    if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float))
                          or not 0 < p <= 1):
        raise RecordError(f"{p!r} is no inclusion probability (a number in (0, 1])", INCLUSION)
    return Vote(idx, model, verdict, tuple(criteria), bench,
                None if p is None else float(p))


def read_votes(path: str | Path, selection, criteria: Sequence[str] | None = None) -> Votes:
    """The votes of `path` checked against a leaderboard Selection (crm.evaluation.leaderboard):
    every idx a query of the benchmark file, every model a ranked one, each (idx, model) once,
    every vote given on this benchmark and, when `criteria` are given, under them."""
    path = str(path)
    used_idx = {r.idx for r in selection.records}
    outside, rejected = set(selection.outside_idx), set(selection.rejected_idx)
    models = set(selection.models)
    seen: dict[tuple[str, str], int] = {}
    used, weights, n_outside, n_rejected = {}, {}, 0, 0
    weighted: bool | None = None
    for line in read_lines(path, parser=_vote):
        if line.error:
            raise line.error
        vote = line.record
        if vote.bench != selection.fingerprint:
            raise RecordError(f"these votes were given on the benchmark {vote.bench[:80]!r}; this "
                              f"board's {selection.path} is {selection.fingerprint!r}", "bench",
                              path, line.number)
        if criteria is not None and list(vote.criteria) != list(criteria):
            raise RecordError(f"this vote was given under the criteria {list(vote.criteria)}; "
                              f"this board's are {list(criteria)}", "criteria", path, line.number)
        if weighted is None:
            weighted = vote.p is not None
        elif weighted != (vote.p is not None):
            raise RecordError("p on some lines and not others: a file holds one sample, drawn "
                              "uniformly (no p) or by strategy=active (p on every line)", "p",
                              path, line.number)
        key = (vote.idx, vote.model)
        if vote.idx not in used_idx and vote.idx not in outside and vote.idx not in rejected:
            raise RecordError(f"{vote.idx[:80]!r} is no query of the benchmark {selection.path}",
                              "idx", path, line.number)
        if vote.model not in models:
            raise RecordError(f"{vote.model[:80]!r} is not a ranked model (ranked: "
                              f"{', '.join(selection.models)})", "model", path, line.number)
        if key in seen:
            raise RecordError(f"a second vote on ({vote.idx[:80]!r}, {vote.model!r}): the first "
                              f"is line {seen[key]}", "idx", path, line.number)
        seen[key] = line.number
        if vote.idx in used_idx:
            used[key] = vote.verdict
            if vote.p is not None:
                weights[key] = 1.0 / vote.p
        elif vote.idx in outside:
            n_outside += 1
        else:
            n_rejected += 1
    return Votes(path, used, n_outside, n_rejected, weights)
