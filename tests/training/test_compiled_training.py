"""Training with compiled decoder layers (crm.models.compile): FSDP2 at world 2 gives eager's losses
and gradients, a compiled run's checkpoints load, resume and export with an eager run's keys, and
the settings that cannot work stop the run at start with one line.

The layer is tests/helpers.py's COMPILE_ARCH, as in tests/models/test_compile.py: inductor's
kernels are built once per session and found in its cache afterwards.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from helpers import COMPILE_ARCH, assert_ranks_ok, run_ranks
from safetensors.torch import load_file
from test_train import run_train

from crm.core.errors import ConfigError
from crm.models import compile as compiling

SCRIPT = Path(__file__).parents[1] / "dist" / "compiled_fsdp.py"
RTOL, ATOL = 1e-4, 1e-6  # float32; inductor sums in another order (tests/models/test_compile.py)
PACKED_RTOL, PACKED_ATOL = 1e-5, 1e-7  # the same layers on the same tokens, laid out in one row
ARCH_OVERRIDES = [f"model.arch.{k}={v}" for k, v in COMPILE_ARCH.items()]

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_dynamo")  # tests/conftest.py


@pytest.mark.slow  # two processes, each building its model four times: 8 s (inductor's cache warm), 34 s cold
@pytest.mark.both_cores
def test_fsdp2_world_2_compiled_layers_and_packed_rows_give_eager_padded_losses_and_gradients(tmp_path):
    """At world 2 under FSDP2 with activation checkpointing: compiled layers give the eager losses
    and gradients, and packed rows (crm.data.packing) give the padded rows', eager and compiled,
    pairwise and pointwise (a pointwise pair's shared prefix computed once)."""
    out = tmp_path / "result.safetensors"
    arch = {**COMPILE_ARCH, "vocab_size": 256}
    cmd = [sys.executable, str(SCRIPT), "pairwise,pointwise", json.dumps(arch), str(out)]
    # Both ranks need the same kernels at the same moment and take turns on each one's lock in
    # inductor's on-disk cache: one compile process each left a core idle (1.35 cores busy, 45 s
    # on a cold cache); two each compile different kernels side by side (34 s). The cores are this
    # test's alone (both_cores).
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "2"}
    assert_ranks_ok(run_ranks(cmd, env, tmp_path / "logs", timeout=600))  # as torchrun
    r = load_file(out)
    assert int(r["graph_breaks"]) == 0 and int(r["graphs"]) >= 1
    kinds = ("pairwise", "pointwise")
    pairs = [(f"{kind}_True_padded", f"{kind}_False_padded", RTOL, ATOL) for kind in kinds]
    pairs += [(f"{kind}_{compiled}_packed", f"{kind}_{compiled}_padded", PACKED_RTOL, PACKED_ATOL)
              for kind in kinds for compiled in (False, True)]
    for run, reference, rtol, atol in pairs:
        for step in (0, 1):
            torch.testing.assert_close(r[f"loss_{run}_{step}"], r[f"loss_{reference}_{step}"],
                                       rtol=rtol, atol=atol)
        grads = [k.removeprefix(f"grad_{reference}_") for k in r if k.startswith(f"grad_{reference}_")]
        assert grads and all(f"grad_{run}_{name}" in r for name in grads)
        for name in grads:
            torch.testing.assert_close(r[f"grad_{run}_{name}"], r[f"grad_{reference}_{name}"], rtol=rtol,
                                       atol=atol, msg=f"{run} {name}")


def test_a_compiled_run_checkpoints_resumes_and_exports_with_eager_keys(demo_root, tmp_path):
    common = [*ARCH_OVERRIDES, "parallel.activation_checkpointing=true", "save_every_n_steps=2",
              "perf.log_every_n_steps=1", "export=true"]
    runs = {}
    for compile in (False, True):
        run_dir = tmp_path / f"compile-{compile}"
        metrics = run_train(demo_root, run_dir, *common, f"compile={str(compile).lower()}")
        assert metrics["train"]["global_step"] == 2
        ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
        export = load_file(run_dir / "export" / "model.safetensors")
        runs[compile] = (run_dir, ckpt, export, metrics)
    (_, eager_ckpt, eager_export, _), (run_dir, ckpt, export, metrics) = runs[False], runs[True]
    assert ckpt["state_dict"].keys() == eager_ckpt["state_dict"].keys()
    assert len(ckpt["optimizer_states"][0]["state"]) == len(eager_ckpt["optimizer_states"][0]["state"])
    assert export.keys() == eager_export.keys()
    assert metrics["train"]["throughput"]["perf/compiled_graphs"] >= 1
    assert metrics["train"]["throughput"]["perf/graph_breaks"] == 0
    resumed = run_train(demo_root, run_dir, *common, "compile=true", "trainer.max_steps=4", "resume=auto")
    assert resumed["train"]["resumed_from"] == str(run_dir / "checkpoints" / "last.ckpt")
    assert resumed["train"]["global_step"] == 4


def test_compile_true_where_inductor_cannot_is_refused_at_start(demo_root, tmp_path, monkeypatch):
    monkeypatch.setattr(compiling, "why_not_compilable", lambda device: "no C++ compiler found (test)")
    with pytest.raises(ConfigError, match=r"compile=true on cpu: no C\+\+ compiler found \(test\); set "
                                          r"compile=false"):
        run_train(demo_root, tmp_path / "run", "compile=true")
    monkeypatch.undo()
    with pytest.raises(ConfigError, match=r"^attention=flash_attention_2 cannot run in compiled decoder "
                                          r"layers .*or compile=false$"):
        run_train(demo_root, tmp_path / "flash", "compile=true", "model.attention=flash_attention_2")
    # auto on CPU does not compile at all; on a machine that cannot, auto falls back to eager
    assert run_train(demo_root, tmp_path / "auto", "compile=auto")["train"]["global_step"] == 2
