"""crm-eval: score test files with a trained CRM (metrics.json, predictions.jsonl)."""
from __future__ import annotations

from crm.evaluation import evaluate_records
from crm.records import load_records


def evaluate_files(scorer, paths) -> tuple[dict, dict]:
    """({path: metrics}, {path: predictions}) for test-format files."""
    metrics, predictions = {}, {}
    for path in paths:
        metrics[str(path)], predictions[str(path)] = evaluate_records(scorer, load_records(path, "test"))
    return metrics, predictions
