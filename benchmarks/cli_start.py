"""How fast each console script answers before it does any work: `--help`, a Hydra composition
error and a start check's refusal (one line, exit 2; crm-train's also those that read the user's
files), wall time per call, and what importing its module costs (`python -X importtime`: the
module's cumulative time and the heavy libraries it pulled in), as one JSON document.

    python benchmarks/cli_start.py [--repeat 3] [--label "after, load 2.1"] [--out FILE]

The scripts are the installed console scripts beside this interpreter (.venv/bin/crm-*); a
PYTHONPATH set for the run puts another checkout's `crm` first (how the "before" figures of
benchmarks/results/cli_start_*.json were taken, on the commit before the change). Each call runs in
a scratch directory with CRM_ROOT there, so nothing lands in the checkout. Wall times include the
interpreter's start; the machine's load average is recorded with them.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HEAVY = ("torch", "lightning", "transformers", "torchmetrics", "peft", "scipy", "trl")
MISSING = "/nonexistent/crm-cli-start"

# script -> (its module, a composition error, a start check's refusal); None: not a Hydra command.
# crm-train's refusals of a library's setting are timed apart (LIBRARY_CHECKS): its `trainer` keys
# are checked against Lightning's Trainer (read from its source), `stream.packing` by its schema, a
# batch plan that does not divide by the resolver (crm.training.resolve.batch_plan).
COMMANDS = {
    "crm-train": ("crm.cli.train", ["trainer.max_stepz=3"], [f"model.path={MISSING}"]),
    "crm-eval": ("crm.cli.eval", ["batch_sise=3"],
                 [f"checkpoint={MISSING}", f"data.test=[{MISSING}.jsonl]"]),
    "crm-leaderboard": ("crm.cli.leaderboard", ["interval.resample=3"],
                        [f"checkpoint={MISSING}", f"bench={MISSING}.jsonl", "baseline=base"]),
    "crm-usl": ("crm.cli.usl", ["serve.scorin=1"], [f"checkpoint={MISSING}"]),
    "crm-plan": ("crm.cli.plan", ["seq_lenn=1"], ["prompt_share=2"]),
    "crm-rl": ("crm.cli.rl", ["grpo.max_stepz=1"], [f"checkpoint={MISSING}"]),
    "crm-export": ("crm.cli.export", None, None),
    "crm-report": ("crm.cli.report", None, None),
}
LIBRARY_CHECKS = {"crm-train": {"trainer_value": ["trainer.max_steps=ten"],
                                "packing_value": ["stream.packing=1"],
                                "batch_plan": ["micro_batch_size=3", "global_batch_size=16"]}}
# crm-train's refusals that read the user's files (data_refusals writes them into the scratch dir):
# a training-format file as a test file, shards without validation records, and resume=auto in a
# run dir whose checkpoint another data set trained.
DATA_CHECKS = {"crm-train": {"test_file_format": ["data=shards", "data.path=shards",
                                                  "data.test_files=[train.jsonl]"],
                             "no_val_records": ["data=shards", "data.path=no_val"],
                             "other_data_checkpoint": ["data=shards", "data.path=shards", "name=mine"]}}


def data_refusals(cwd: Path) -> None:
    """The files DATA_CHECKS refer to, in `cwd`: 60 demo training records sharded with and without
    a validation split, and outputs/mine/checkpoints/last.ckpt naming data.path=other."""
    import torch

    from crm.data.demo import write_demo
    from crm.data.shard import shard

    write_demo(cwd / "demo", n_train=60, n_test=4, n_bench=1)
    (cwd / "train.jsonl").write_bytes((cwd / "demo" / "train.jsonl").read_bytes())
    shard([str(cwd / "train.jsonl")], cwd / "shards", val_fraction=0.5)
    shard([str(cwd / "train.jsonl")], cwd / "no_val", val_fraction=0.0)
    last = cwd / "outputs" / "mine" / "checkpoints" / "last.ckpt"
    last.parent.mkdir(parents=True)
    torch.save({"crm_config": {"data": {"path": str(cwd / "other")}}}, last)


def timed(argv: list[str], cwd: Path, repeat: int) -> dict:
    """Median wall seconds of `repeat` calls, the exit code and the last stderr line of the last."""
    env = {**os.environ, "CRM_ROOT": str(cwd)}
    seconds = []
    for _ in range(repeat):
        started = time.perf_counter()
        done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
        seconds.append(time.perf_counter() - started)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    return {"median_s": round(statistics.median(seconds), 2), "runs_s": [round(s, 2) for s in seconds],
            "exit": done.returncode, "stderr_lines": len(lines),
            "last_stderr": lines[-1][:200] if lines else ""}


def import_cost(module: str) -> dict:
    """`python -X importtime -c 'import MODULE'`: the module's cumulative import time and the
    cumulative time of each heavy library loaded on the way (top-level entries only)."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", f"import {module}"],
                          capture_output=True, text=True, timeout=300)
    cumulative = {}
    for line in done.stderr.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        _, cum, name = (part.strip() for part in line.split("|"))
        if cum.isdigit():
            cumulative.setdefault(name.strip(), int(cum))
    return {"module_s": round(cumulative.get(module, 0) / 1e6, 2),
            "heavy_s": {h: round(cumulative[h] / 1e6, 2) for h in HEAVY if h in cumulative}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--label", default="")
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args()
    bin_dir = Path(sys.executable).parent
    load_before = os.getloadavg()
    result = {"label": args.label, "python": sys.executable, "repeat": args.repeat,
              "pythonpath": os.environ.get("PYTHONPATH", ""), "commands": {}}
    with tempfile.TemporaryDirectory() as scratch:
        cwd = Path(scratch)
        data_refusals(cwd)
        for script, (module, composition, refusal) in COMMANDS.items():
            exe = str(bin_dir / script)
            row = {"import": import_cost(module), "help": timed([exe, "--help"], cwd, args.repeat)}
            if composition is not None:
                row["composition_error"] = timed([exe, *composition], cwd, args.repeat)
                row["start_check"] = timed([exe, *refusal], cwd, args.repeat)
            else:  # argparse: a missing argument
                row["usage_error"] = timed([exe], cwd, args.repeat)
            for name, argv in LIBRARY_CHECKS.get(script, {}).items():
                row[f"start_check_{name}"] = timed([exe, *argv], cwd, args.repeat)
            for name, argv in DATA_CHECKS.get(script, {}).items():
                row[f"data_check_{name}"] = timed([exe, *argv], cwd, args.repeat)
            result["commands"][script] = row
            print(f"{script}: {json.dumps(row)}", file=sys.stderr)
    result["loadavg_before"] = [round(x, 2) for x in load_before]
    result["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
