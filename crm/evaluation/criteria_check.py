"""Does a trained CRM read the criteria and the answers, or only the slot? (crm-train's end check,
docs/DESIGN.md section 8.1)

A pairwise CRM trained on too little data can settle on a shortcut that its validation loss does
not show: the same verdict whatever the criteria say (criteria-blind), or the verdict of a slot
(slot-following: it flips whenever A and B swap). Each two-sided validation record (a vote, the
winner's criteria and the loser's) becomes two contradictory test pairs: under the winner's
criteria the winner is right, under the loser's the loser. A CRM that reads the criteria changes
its verdict between the two; one that does not keeps it. Both orders are judged, so following
the slot shows as a flip rate near 1.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

from crm.core.records import TestRecord, TrainRecord
from crm.evaluation.accuracy import evaluate_records

log = logging.getLogger(__name__)
SAMPLE = 32  # validation records judged: 4 sequences each for a pairwise CRM, seconds on a CPU
SHORTCUT = 0.9  # a share of pairs at or above which a shortcut is what the CRM learned
CHANCE = 0.6  # an accuracy below which, on contradictory pairs, it is near chance (0.5)


def contradictory_pairs(records: Iterable[TrainRecord], most: int = SAMPLE) -> list[TestRecord]:
    """Up to `most` records' test pairs: a two-sided record's two (the winner's criteria, then
    the loser's), a one-sided (README-format) record's one. Ties are left out: no criteria set
    makes one side right."""
    pairs: list[TestRecord] = []
    used = 0
    for n, r in enumerate(records):
        if used == most:
            break
        if r.human_winner == "tie":
            continue
        used += 1
        loser = "model_b" if r.human_winner == "model_a" else "model_a"
        sides = {"model_a": r.a_criteria, "model_b": r.b_criteria}
        for label in ((r.human_winner,) if r.one_sided else (r.human_winner, loser)):
            if sides[label]:
                pairs.append(TestRecord(f"v{n}/{label}", r.query, r.model_a, r.model_b,
                                        sides[label], label, r.topic))
    return pairs


def check_validation(scorer, shard_dir: Path) -> dict | None:
    """crm-train's end check: the exported CRM on its own validation records, its warnings
    logged (a criteria-blind or slot-following model, which its validation loss does not show);
    None without a validation split."""
    from crm.core.records import parse_train
    from crm.data.manifest import load_manifest
    from crm.data.reader import iter_shard

    manifest = load_manifest(shard_dir)
    if "val" not in manifest.splits:
        return None
    records = (parse_train(obj) for shard in manifest.shards("val") for _, obj in iter_shard(shard.url))
    result = shortcut_check(scorer, records)
    for warning in (result or {}).get("warnings", []):
        log.warning("the trained CRM is %s", warning)
    return result


def shortcut_check(scorer, records: Iterable[TrainRecord], most: int = SAMPLE) -> dict | None:
    """The figures and a warning per shortcut found (`warnings`); None without a pair to judge."""
    pairs = contradictory_pairs(records, most)
    if not pairs:
        return None
    metrics, predictions = evaluate_records(scorer, pairs)
    by_record: dict[str, list[str]] = {}
    for p in predictions:  # in order: a record's pair under the winner's criteria, then the loser's
        by_record.setdefault(p["idx"].rsplit("/", 1)[0], []).append(p["verdict"])
    two_sided = [v for v in by_record.values() if len(v) == 2]
    same = round(sum(a == b for a, b in two_sided) / len(two_sided), 4) if two_sided else None
    out = {"pairs": len(pairs), "records": len(by_record),
           "accuracy_mean": metrics["accuracy_mean"], "flip_rate": metrics["flip_rate"],
           "same_verdict_under_both_criteria": same, "warnings": []}
    what = (f"on {out['records']} validation records judged under "
            + ("the winner's and the loser's criteria" if two_sided else "their criteria")
            + f" (accuracy {metrics['accuracy_mean']:.2f}; 0.5 is chance)")
    advice = ("more steps or data" + (", or loss=ranking, which learns from fewer records"
                                      if scorer.kind == "pairwise" else "")
              + " (README, 'Your own small data')")
    if same is not None and same >= SHORTCUT:
        out["warnings"].append(f"criteria-blind: its verdict stays the same when the criteria "
                               f"change sides in {same:.0%} of pairs, {what}: {advice}")
    if metrics["flip_rate"] is not None and metrics["flip_rate"] >= SHORTCUT:
        out["warnings"].append(f"slot-following: its verdict changes when A and B swap in "
                               f"{metrics['flip_rate']:.0%} of pairs, {what}: it reads the slot, "
                               f"not the answers; {advice}; judge in both orders meanwhile "
                               "(crm-leaderboard both_orders=true)")
    near_chance = metrics["accuracy_mean"] is not None and metrics["accuracy_mean"] < CHANCE
    if not out["warnings"] and near_chance and len(pairs) >= 20:
        out["warnings"].append(f"near chance {what}: {advice}")
    return out
