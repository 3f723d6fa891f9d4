"""The CPU demo's quality and wall time, and its criteria-blind control.

1. `crm-train` with no overrides (the embedded demo recipe) in a fresh root, so the wall time counts
   everything a first run does: demo data generation, sharding, tokenizer training, training,
   export and scoring the five test files.
2. The control: the same recipe on the same data with every criterion replaced by one constant
   line ("General user preference", the reference's criteria-blind criterion) at train and test.
   On the contradictory set every pair appears under both sides' criteria with opposite labels, so
   a model that cannot read criteria scores 0.5 there however well it learns the crowd's taste.

Prints one JSON document: per test set the accuracy (mean of the two A/B orders, a score tie
counts as wrong), the accuracy with both orders' probabilities averaged, and the flip rate; the
steps, training seconds and samples/s; the wall time of each run.

    python benchmarks/demo_quality.py [--skip-control] [--root DIR] [-- extra crm-train overrides]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from crm.data.shard import shard

BLIND = ["General user preference"]
BIN = Path(sys.executable).parent


def crm_train(root: Path, name: str, overrides: list[str]) -> dict:
    env = {**os.environ, "CRM_ROOT": str(root)}
    cmd = [str(BIN / "crm-train"), f"name={name}", "trainer.enable_progress_bar=false", *overrides]
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode:
        sys.exit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    metrics = json.loads((root / "outputs" / name / "metrics.json").read_text())
    train = metrics["train"]
    return {
        "wall_s": round(wall, 1),
        "steps": train["global_step"],
        "train_s": train["wall_seconds"],
        "samples_per_s": round(train["throughput"]["perf/samples_per_s"], 1),
        "test": {Path(f).stem: {"accuracy": m["accuracy_mean"],
                                "accuracy_both_orders": m["accuracy_both_orders"],
                                "flip_rate": m["flip_rate"]}
                 for f, m in metrics["eval"].items()},
    }


def blind_copy(src: Path, dst: Path) -> list[str]:
    """The demo's train set and test files with every criterion replaced by BLIND; the test paths."""
    (dst / "test").mkdir(parents=True)
    with open(src / "train.jsonl") as f, open(dst / "train.jsonl", "w") as out:
        for line in f:
            r = json.loads(line)
            r.update(a_criteria=BLIND, b_criteria=BLIND, a_broad_criteria_topic=[0],
                     b_broad_criteria_topic=[0])
            out.write(json.dumps(r) + "\n")
    tests = []
    for name in ("in_distribution", "contradictory"):
        with open(src / "test" / f"{name}.jsonl") as f, open(dst / "test" / f"{name}.jsonl", "w") as out:
            for line in f:
                out.write(json.dumps({**json.loads(line), "criteria": BLIND}) + "\n")
        tests.append(str(dst / "test" / f"{name}.jsonl"))
    shard([str(dst / "train.jsonl")], dst / "shards", shard_size=1000)
    return tests


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", help="CRM_ROOT for the runs (default: a fresh temporary dir)")
    p.add_argument("--skip-control", action="store_true", help="only the demo run")
    p.add_argument("overrides", nargs="*", help="crm-train overrides for both runs (after --)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.root or tmp)
        result = {"demo": crm_train(root, "demo", args.overrides)}
        if not args.skip_control:
            tests = blind_copy(root / ".cache" / "demo" / "raw", root / "blind")
            result["criteria_blind_control"] = crm_train(
                root, "blind", ["data=shards", f"data.path={root / 'blind' / 'shards'}",
                                f"data.test_files=[{','.join(tests)}]", *args.overrides])
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
