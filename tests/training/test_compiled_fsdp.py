"""FSDP2 at world 2 with compiled decoder layers (crm.models.compile): eager's losses and
gradients, and packed rows the padded rows', eager and compiled, pairwise and pointwise.

Its own file, apart from tests/training/test_compiled_training.py's one-process runs: a file is
one xdist worker's (tests/conftest.py), and a test that does not hold both cores, run after this
one in its file, kept the other worker's both_cores test waiting (docs/TESTING.md). The layer is
tests/helpers.py's COMPILE_ARCH, as in tests/models/test_compile.py.
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

SCRIPT = Path(__file__).parents[1] / "dist" / "compiled_fsdp.py"
RTOL, ATOL = 1e-4, 1e-6  # float32; inductor sums in another order (tests/models/test_compile.py)
PACKED_RTOL, PACKED_ATOL = 1e-5, 1e-7  # the same layers on the same tokens, laid out in one row


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
