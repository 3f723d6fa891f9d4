"""Training with compiled decoder layers (crm.models.compile), in this process: a compiled run's
checkpoints load, resume and export with an eager run's keys, and the settings that cannot work
stop the run at start with one line. FSDP2 at world 2 is tests/training/test_compiled_fsdp.py's.

The layer is tests/helpers.py's COMPILE_ARCH, as in tests/models/test_compile.py: inductor's
kernels are built once per session and found in its cache afterwards.
"""
from __future__ import annotations

import pytest
import torch
from helpers import COMPILE_ARCH
from safetensors.torch import load_file
from test_train import run_train

from crm.core.errors import ConfigError
from crm.models import compile as compiling

ARCH_OVERRIDES = [f"model.arch.{k}={v}" for k, v in COMPILE_ARCH.items()]

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_dynamo")  # tests/conftest.py


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
    with pytest.raises(ConfigError, match=r"^model\.attention=flash_attention_2 cannot run in compiled "
                                          r"decoder layers .*or compile=false$"):
        run_train(demo_root, tmp_path / "flash", "compile=true", "model.attention=flash_attention_2")
    # auto on CPU does not compile at all; on a machine that cannot, auto falls back to eager
    assert run_train(demo_root, tmp_path / "auto", "compile=auto")["train"]["global_step"] == 2
