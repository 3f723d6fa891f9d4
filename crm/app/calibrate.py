"""The page's "Calibrate with your votes" step: what it shows and what it keeps, without Gradio.

After a board is shown, the suggested pairs (crm.evaluation.suggest: each model's scored pairs
uniformly at random, an even share per model) are put to the user one at a time under the board's
criteria, the two responses side by side. Which side holds the model is drawn per pair (a hash
of idx and model), so a user who favours the left side does not favour the models: the user's
own slot bias, as section 8.3's CRM's. Each answer becomes a votes line of crm-leaderboard's
format (win / tie / loss for the model against the baseline, under the board's criteria); the
votes live in the page's session state, in the browser's own storage (one entry per criteria
set, so that a new board, a reload or the server forgetting an idle session loses none) and in
the votes file the user downloads, and go nowhere else.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from crm.core.files import write_kept

SUGGESTED = 100  # pairs queued per board: past the 30-100 votes a user gives
VERDICTS = ("win", "tie", "loss")
# The browser's store of votes travels with every answer: bounded far below the server's body
# and JSON limits (crm/core/http.py), the least recently used criteria sets dropped first.
STORED_SETS = 16
STORED_CHARS = 2**19


@dataclass(frozen=True)
class Calibration:
    """A board's calibration: the pairs still to ask and the votes given ((idx, model) -> verdict)."""

    queue: tuple[dict, ...] = ()
    votes: dict[tuple[str, str], str] = field(default_factory=dict)
    answered: int = 0  # pairs answered, skips included

    def answer(self, choice: str) -> "Calibration":
        """`choice`: "A", "B", "tie" (a vote on the first queued pair) or "skip" (none)."""
        if not self.queue:
            return self
        line, rest = self.queue[0], self.queue[1:]
        if choice == "skip":
            return Calibration(rest, self.votes, self.answered + 1)
        if choice == "tie":
            verdict = "tie"
        else:
            verdict = "win" if (choice == "A") == model_in_slot_a(line) else "loss"
        return Calibration(rest, {**self.votes, (line["idx"], line["model"]): verdict},
                           self.answered + 1)

    def with_votes(self, votes: dict[tuple[str, str], str]) -> "Calibration":
        """Uploaded votes added (they replace any given for the same pair), their pairs unqueued."""
        merged = {**self.votes, **votes}
        return Calibration(tuple(x for x in self.queue if (x["idx"], x["model"]) not in merged),
                           merged, self.answered)


def criteria_key(criteria) -> str:
    return "\n".join(criteria)


def restored(store, criteria, known) -> tuple[dict[tuple[str, str], str], int]:
    """(votes, pairs answered) the browser's store holds for `criteria`; `known(idx, model)`
    says whether the benchmark ranks that pair. The store comes from the browser: anything in it
    that is not a vote on a known pair is ignored."""
    entry = store.get(criteria_key(criteria)) if isinstance(store, dict) else None
    if not isinstance(entry, dict) or not isinstance(entry.get("votes"), str):
        return {}, 0
    try:  # one JSON string: one value for the server's JSON limits, whatever the count
        lines = json.loads(entry["votes"]) if len(entry["votes"]) <= STORED_CHARS else []
    except ValueError:
        lines = []
    votes = {}
    for line in lines if isinstance(lines, list) else ():
        if (isinstance(line, list) and len(line) == 3 and all(isinstance(x, str) for x in line)
                and line[2] in VERDICTS and known(line[0], line[1])):
            votes[line[0], line[1]] = line[2]
    answered = entry.get("answered")
    return votes, answered if type(answered) is int and 0 <= answered < 10**9 else len(votes)


def stored(store, criteria, calibration: Calibration) -> dict:
    """The browser's store with `calibration`'s votes as the entry for `criteria` (the most
    recent, last), within STORED_SETS entries and STORED_CHARS characters."""
    key = criteria_key(criteria)
    entries = {k: v for k, v in (store if isinstance(store, dict) else {}).items()
               if k != key and isinstance(v, dict) and isinstance(v.get("votes"), str)}
    entries[key] = {"votes": json.dumps([[idx, model, verdict] for (idx, model), verdict
                                         in calibration.votes.items()]),
                    "answered": calibration.answered}
    while len(entries) > 1 and (len(entries) > STORED_SETS or sum(
            len(k) + len(v["votes"]) for k, v in entries.items()) > STORED_CHARS):
        del entries[next(iter(entries))]
    return entries


def model_in_slot_a(line: dict) -> bool:
    digest = hashlib.sha256(f"{line['idx']}\0{line['model']}".encode()).digest()
    return bool(digest[0] & 1)


def sides(line: dict) -> tuple[str, str]:
    """(response shown as A, response shown as B)."""
    if model_in_slot_a(line):
        return line["response"], line["baseline"]
    return line["baseline"], line["response"]


def votes_text(votes: dict[tuple[str, str], str], criteria: tuple[str, ...], bench: str) -> str:
    """The votes as crm-leaderboard's votes file (`votes=FILE`), each naming the board's criteria
    and benchmark fingerprint."""
    return "".join(json.dumps({"idx": idx, "model": model, "verdict": verdict,
                               "criteria": list(criteria), "bench": bench}) + "\n"
                   for (idx, model), verdict in votes.items())


def write_votes(votes: dict[tuple[str, str], str], directory: Path, criteria: tuple[str, ...],
                bench: str, keep: int = 256) -> Path:
    """votes.jsonl in a directory named after its contents (one file per set of votes); the
    `keep` most recently written are kept (every answer writes one)."""
    return write_kept(votes_text(votes, criteria, bench), directory, "votes.jsonl", keep)
