"""Writers of vote files in the shapes people download (shared by the vote and criteria tests)."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ONE_HOT = {"model_a": (1, 0, 0), "model_b": (0, 1, 0), "tie": (0, 0, 1)}


def arena_55k_row(id_, prompt: list, a: list, b: list, winner: str, indent=None) -> dict:
    """A row of lmsys/arena-human-preference-55k's train.csv: JSON-text turn lists, one-hot winner."""
    hot = ONE_HOT[winner]
    return {"id": id_, "model_a": "gpt-4-0613", "model_b": "llama-2-70b-chat",
            "prompt": json.dumps(prompt, ensure_ascii=False, indent=indent),
            "response_a": json.dumps(a, ensure_ascii=False),
            "response_b": json.dumps(b, ensure_ascii=False),
            "winner_model_a": hot[0], "winner_model_b": hot[1], "winner_tie": hot[2]}


def write_csv(path: Path, rows: list[dict]) -> Path:
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    columns = list(dict.fromkeys(k for r in rows for k in r))  # from_pylist reads the first row's
    pq.write_table(pa.Table.from_pylist([{c: r.get(c) for c in columns} for r in rows]), path)
    return path
