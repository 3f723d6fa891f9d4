"""The page's "Calibrate with your votes" step: what it shows and what it keeps, without Gradio.

After a board is shown, the suggested pairs (crm.evaluation.suggest: random, spread over models
and topics) are put to the user one at a time under the board's criteria, the two responses side
by side. Which side holds the model is drawn per pair (a hash of idx and model), so a user who
favours the left side does not favour the models: the user's own slot bias, as section 8.3's
CRM's. Each answer becomes a votes line of crm-leaderboard's format (win / tie / loss for the
model against the baseline); the votes live in the page's session state and in the votes file the
user downloads, and go nowhere else.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from crm.core.files import write_kept

SUGGESTED = 100  # pairs queued per board: past the 30-100 votes a user gives


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


def model_in_slot_a(line: dict) -> bool:
    digest = hashlib.sha256(f"{line['idx']}\0{line['model']}".encode()).digest()
    return bool(digest[0] & 1)


def sides(line: dict) -> tuple[str, str]:
    """(response shown as A, response shown as B)."""
    if model_in_slot_a(line):
        return line["response"], line["baseline"]
    return line["baseline"], line["response"]


def votes_text(votes: dict[tuple[str, str], str]) -> str:
    """The votes as crm-leaderboard's votes file (`votes=FILE`)."""
    return "".join(json.dumps({"idx": idx, "model": model, "verdict": verdict}) + "\n"
                   for (idx, model), verdict in votes.items())


def write_votes(votes: dict[tuple[str, str], str], directory: Path, keep: int = 256) -> Path:
    """votes.jsonl in a directory named after its contents (one file per set of votes); the
    `keep` most recently written are kept (every answer writes one)."""
    return write_kept(votes_text(votes), directory, "votes.jsonl", keep)
