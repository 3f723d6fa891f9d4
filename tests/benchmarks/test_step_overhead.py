"""benchmarks/step_overhead.py's arithmetic (docs/PERFORMANCE.md section 13): nested regions' own
times add up to the step, and a run's micro batches summarise per optimizer step, quiet and
logging steps apart, warm-up left out. Its crm-train runs are the benchmark's, not the suite's."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "step_overhead.py"


@pytest.fixture(scope="module")
def so():
    spec = importlib.util.spec_from_file_location("step_overhead", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("step_overhead", module)
    spec.loader.exec_module(module)
    return module


def test_nested_regions_own_times_add_up_to_the_outer_one(so):
    now = [0.0]
    regions = so.Regions(clocks=(lambda: now[0],))
    regions.start("outer")
    now[0] += 1.0
    regions.start("inner")
    now[0] += 2.0
    regions.start("innermost")
    now[0] += 4.0
    regions.stop("inner")  # closes the innermost left open (an exception's), then inner
    now[0] += 8.0
    regions.stop("outer")
    (own,), calls = regions.own, regions.calls
    assert dict(own) == {"outer": 9.0, "inner": 2.0, "innermost": 4.0}
    assert sum(own.values()) == 15.0 and calls == {"outer": 1, "inner": 1, "innermost": 1}


def test_micro_batches_summarise_per_step_quiet_and_logging_apart(so):
    def micro(step, shape, forward, log=0.0, reads=None):
        own = {"crm: forward + loss": forward, "crm: module.log": log,
               "[Callback]Preemption.on_train_batch_end": 0.001}
        return {"step": step, "own": own, "cpu": own, "calls": {}, "reads": reads or {},
                "shape": shape}

    records = [micro(1, [2, 8], 9.0)]  # warm-up: left out of the figures, not of the shapes
    for step in (2, 3, 4):
        logs = step % 2 == 0
        for k in range(2):  # accumulation 2
            records.append(micro(step, [2, 8 + step], 0.1, log=0.005 if logs and k else 0.0,
                                 reads={"item|crm: module.log|x.py:1": 1} if logs and k else None))
    out = so.summarise(records, warmup=1, log_every=2)
    assert out["steps"] == {"quiet": 1, "logging": 2} and out["micro_batches_per_step"] == 2
    assert out["distinct_shapes"] == 4 and out["micro_batches"] == 7
    parts = out["parts_ms_per_step"]
    assert parts["compute: forward + loss"]["quiet"]["median_ms"] == pytest.approx(200.0)
    log = parts["crm: module.log"]
    assert log["quiet"]["median_ms"] == 0 < log["logging"]["median_ms"]
    assert parts["callback Preemption.on_train_batch_end"]["quiet"]["median_ms"] == pytest.approx(2.0)
    totals = out["totals"]["quiet"]
    assert totals["outside_compute_median_ms"] == pytest.approx(2.0)
    assert totals["step_median_ms"] == pytest.approx(202.0)
    assert out["host_waits_per_step"] == {"quiet": {}, "logging": {"item|crm: module.log|x.py:1": 1.0}}
