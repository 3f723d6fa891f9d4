"""`crm-data stats`: counts, lengths, criteria per sample and label balance of a file or shard dir;
training records also by shape and label (`shapes`: decides, tie, user; crm.core.records.SHAPES)."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from crm.core.records import (BenchRecord, RecordError, TestRecord, TrainRecord, fingerprint,
                              parse_train, read_lines)
from crm.data.manifest import load_manifest
from crm.data.reader import iter_shard


def _summary(values: list[int]) -> dict:
    if not values:
        return {}
    values = sorted(values)
    pick = lambda q: values[min(len(values) - 1, int(q * len(values)))]  # noqa: E731
    return {"mean": round(sum(values) / len(values), 1), "p50": pick(0.5), "p95": pick(0.95),
            "max": values[-1]}


def _words(conversation) -> int:
    return sum(len(m.content.split()) for m in conversation[1:])


def _records_of(path: Path):
    """(split, record, fingerprint) triples; a file's bad line is its RecordError (shards were
    validated)."""
    if path.is_dir():
        manifest = load_manifest(path)
        for split in manifest.splits:
            for shard in manifest.shards(split):
                for key, obj in iter_shard(shard.url):
                    try:
                        yield split, parse_train(obj), fingerprint(obj)
                    except RecordError as err:
                        raise RecordError(f"sample {key}: {err}", path=shard.url) from None
    else:
        for line in read_lines(path):
            yield (path.name, line.error or line.record,
                   None if line.error else fingerprint(json.loads(line.text)))


def stats(path: str | Path) -> dict:
    path = Path(path)
    per_split: dict[str, dict] = {}
    seen: set[bytes] = set()
    for split, record, record_print in _records_of(path):
        s = per_split.setdefault(split, {"records": 0, "rejected": 0, "duplicates": 0, "labels": Counter(),
                                         "criteria": Counter(), "words": [], "turns": Counter(),
                                         "topics": Counter(), "shapes": {}})
        if isinstance(record, RecordError):
            s["rejected"] += 1
            continue
        s["records"] += 1
        if record_print in seen:  # of a record earlier in this split or another (one in val leaks)
            s["duplicates"] += 1
        seen.add(record_print)
        if isinstance(record, TrainRecord):
            s["labels"][record.human_winner] += 1
            s["shapes"].setdefault(record.shape, Counter())[record.human_winner] += 1
            # a README-format record knows one side's criteria, a tie record one list (both sides
            # hold a tie's)
            for side in ((record.a_criteria or record.b_criteria,)
                         if record.one_sided or record.shape == "tie"
                         else (record.a_criteria, record.b_criteria)):
                s["criteria"][len(side)] += 1
            s["words"] += [_words(record.model_a), _words(record.model_b)]
            s["turns"][len(record.model_a)] += 1
        elif isinstance(record, TestRecord):
            s["labels"][record.preference] += 1
            s["criteria"][len(record.criteria)] += 1
            s["words"] += [_words(record.model_a), _words(record.model_b)]
            s["turns"][len(record.model_a)] += 1
        elif isinstance(record, BenchRecord):
            s["labels"].update(record.responses)  # responses per model
            s["words"] += [_words(c) for c in record.responses.values()]
        if getattr(record, "topic", None):
            s["topics"][record.topic] += 1
    return {
        split: {
            "records": s["records"],
            "rejected": s["rejected"],
            "duplicates": s["duplicates"],
            "labels": dict(sorted(s["labels"].items())),
            "shapes": {shape: dict(sorted(labels.items())) for shape, labels in sorted(s["shapes"].items())},
            "criteria_per_side": dict(sorted(s["criteria"].items())),
            "response_words": _summary(s["words"]),
            "messages_per_conversation": dict(sorted(s["turns"].items())),
            "topics": dict(sorted(s["topics"].items())),
        }
        for split, s in per_split.items()
    }
