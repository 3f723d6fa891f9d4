"""A user's votes (`crm-leaderboard votes=FILE`): their own verdict on a few of the board's pairs.

One JSONL line per vote, `{"idx": <a bench query's idx>, "model": <a ranked model>, "verdict":
"win" | "tie" | "loss"}`: the user's verdict on that model's response against the baseline's
under the board's criteria. The whole file is checked against the benchmark's selection before
any model loads; the first defect raises a RecordError that reads `FILE:LINE: field: reason`.
Votes on queries outside the selected topics, or on benchmark lines rejected for every model,
are counted and reported, not used: read = used + outside_topics + on_rejected_lines.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from crm.core.records import RecordError, read_lines
from crm.evaluation.leaderboard import LOSS, TIE, WIN

VERDICTS = (WIN, TIE, LOSS)
FIELDS = ("idx", "model", "verdict")


@dataclass(frozen=True)
class Votes:
    path: str
    used: dict[tuple[str, str], str] = field(default_factory=dict)  # (idx, model) -> verdict
    outside_topics: int = 0
    on_rejected_lines: int = 0

    @property
    def counts(self) -> dict:
        used = len(self.used)
        return {"file": self.path, "read": used + self.outside_topics + self.on_rejected_lines,
                "used": used, "outside_topics": self.outside_topics,
                "on_rejected_lines": self.on_rejected_lines}


def _vote(obj) -> tuple[str, str, str]:
    if not isinstance(obj, dict):
        raise RecordError(f"a vote is a JSON object with {', '.join(FIELDS)}, not "
                          f"{type(obj).__name__}")
    extra = sorted(set(obj) - set(FIELDS))
    if extra:
        raise RecordError(f"unknown field (a vote has {', '.join(FIELDS)})", extra[0])
    values = []
    for name in FIELDS:
        if name not in obj:
            raise RecordError("missing field", name)
        value = obj[name]
        if name == "idx" and isinstance(value, int) and not isinstance(value, bool):
            value = str(value)  # as the benchmark reads its idx
        if not isinstance(value, str):
            raise RecordError(f"must be a string{' or an integer' if name == 'idx' else ''}, "
                              f"not {'null' if value is None else type(value).__name__}", name)
        values.append(value)
    if values[2] not in VERDICTS:
        raise RecordError(f"{values[2][:40]!r} is not one of {', '.join(VERDICTS)}", "verdict")
    return values[0], values[1], values[2]


def read_votes(path: str | Path, selection) -> Votes:
    """The votes of `path` checked against a leaderboard Selection (crm.evaluation.leaderboard):
    every idx a query of the benchmark file, every model a ranked one, each (idx, model) once."""
    path = str(path)
    used_idx = {r.idx for r in selection.records}
    outside, rejected = set(selection.outside_idx), set(selection.rejected_idx)
    models = set(selection.models)
    seen: dict[tuple[str, str], int] = {}
    used, n_outside, n_rejected = {}, 0, 0
    for line in read_lines(path, parser=_vote):
        if line.error:
            raise line.error
        idx, model, verdict = line.record
        if idx not in used_idx and idx not in outside and idx not in rejected:
            raise RecordError(f"{idx[:80]!r} is no query of the benchmark {selection.path}",
                              "idx", path, line.number)
        if model not in models:
            raise RecordError(f"{model[:80]!r} is not a ranked model (ranked: "
                              f"{', '.join(selection.models)})", "model", path, line.number)
        if (idx, model) in seen:
            raise RecordError(f"a second vote on ({idx[:80]!r}, {model!r}): the first is line "
                              f"{seen[idx, model]}", "idx", path, line.number)
        seen[idx, model] = line.number
        if idx in used_idx:
            used[idx, model] = verdict
        elif idx in outside:
            n_outside += 1
        else:
            n_rejected += 1
    return Votes(path, used, n_outside, n_rejected)
