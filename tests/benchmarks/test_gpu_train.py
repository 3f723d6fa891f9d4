"""benchmarks/gpu_train.py keeps working where CI runs it: without CUDA it is a smoke test of its
harness (crm-train with the step-statistics callback, the plan beside it, crm against TRL), on the
tiny model, a few steps each. Its figures are not GPU figures and it says so."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_train.py"


@pytest.mark.slow  # five processes of short runs (crm-train, crm-plan, 2 train_vs_trl runs, the script)
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the benchmark runs the real sizes")
def test_without_cuda_the_benchmark_smoke_tests_its_harness(tmp_path):
    tasks = "train=tiny:8:off:pairwise,train=tiny:8:off:pairwise:graphs,scoring,trl,flex"
    out = tmp_path / "gpu.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--tasks", tasks, "--out", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert json.loads(out.read_text()) == result  # the file written after each task: the last one whole
    assert result["device"] == "cpu"
    run, graphs = result["crm_train"]
    assert "error" not in run, run.get("error")
    for key in ("size", "mode", "packing", "mfu", "tokens_per_s", "peak_gib", "planned_gib"):
        assert key in run, key
    assert run["size"] == "tiny" and run["variant"] == "today"
    assert run["timed_steps"] == 2  # 3 steps, the first untimed
    assert run["tokens_per_s"] > 0 and 0 < run["real_token_fraction"] <= 1
    assert run["step_seconds_p50"] <= run["step_seconds_p95"]
    assert run["mfu"] is None and run["peak_gib"] is None  # no GPU: no peak, no CUDA memory
    records, width = run["widest_micro_batch"]  # CPU pairwise: padded rows (stream.packing=auto)
    assert not run["packing"] and records == 8 and 0 < width <= 384
    assert run["mode"] == "pairwise"
    assert run["planned_gib"] == run["plan"]["crm_plan_total_gib"] > 0  # crm-plan itself, run's overrides
    assert run["plan"]["at_widest_batch_gib"] <= run["planned_gib"]
    assert "host_syncs" not in run  # counted on CUDA only
    assert graphs["variant"] == "graphs" and "CUDA" in graphs["skipped"]
    scoring = result["scoring"]  # the run's export, loaded as crm-eval loads it
    assert "error" not in scoring, scoring.get("error")
    for path in ("plain", "prefix_reuse"):
        assert scoring["benchmark"][path]["forwards"] == 12 * scoring["benchmark"]["prompts"]
        assert scoring["leaderboard"][path]["pairs"] > 0
        assert scoring["rows_per_s"]["crm_eval"]["local"][path] > 0
        assert scoring["rows_per_s"]["crm_leaderboard"]["local"][path] > 0
    assert "ray" not in scoring["rows_per_s"]["crm_leaderboard"]  # --engines local: the CPU default
    board = scoring["leaderboard"]
    assert board["prefix_reuse"]["computed_tokens"] < board["plain"]["computed_tokens"]
    assert "CUDA" in result["flex"]["skipped"]
    trl = result["crm_vs_trl"]
    assert "error" not in trl, trl.get("error")
    if importlib.util.find_spec("trl") is None:
        assert trl["ratio_crm_over_trl"] is None and "not installed" in trl["skipped"]
    else:
        assert trl["crm_records_per_s"] > 0 and trl["trl_records_per_s"] > 0 and trl["ratio_crm_over_trl"] > 0
        full = trl["train_vs_trl"]
        assert full["crm_pointwise_packed"]["real_token_fraction"] == 1.0
        assert full["setup"]["device"] == "cpu"
        assert "crm_pointwise" not in full and "crm_pairwise" not in full  # the packed run against TRL
    assert [t["task"] for t in result["tasks"]] == tasks.split(",")
