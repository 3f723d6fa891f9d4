"""Compiled decoder layers (crm.models.compile): the same losses and gradients as eager, a bounded
number of graphs over varying shapes, no graph break, the private torch APIs it relies on.

Every test here compiles the same tiny layer (COMPILE_ARCH, float32, activation checkpointing on),
and so does tests/training/test_compiled_training.py: inductor builds its C++ kernels once per
test session and finds them in its cache afterwards (a first compile takes 20-60 s on 2 cores).
"""
from __future__ import annotations

import pytest
import torch
from helpers import COMPILE_ARCH, tiny_tokenizer

from crm.data.padding import pad_rows
from crm.models import compile as compiling
from crm.models.config import resolve_compile
from crm.models.factory import LossConfig, ModelConfig, build_crm
from crm.training.parallel import ParallelConfig, prepare_layers

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_dynamo")  # tests/conftest.py
# float32 throughout; inductor fuses and reorders the elementwise work, so sums round differently.
RTOL, ATOL = 1e-4, 1e-6


def crm_pair(kind: str):
    """(eager CRM, compiled CRM) with the same initial weights, activation checkpointing on both."""
    tok = tiny_tokenizer()
    models = []
    for compile in (False, True):
        torch.manual_seed(0)
        crm = build_crm(ModelConfig(arch=COMPILE_ARCH, attention="sdpa"), LossConfig(kind), num_labels=2,
                        pad_token_id=tok.pad_token_id, vocab_size=len(tok))
        prepare_layers(crm, ParallelConfig(activation_checkpointing=True), compile)
        models.append(crm.train())
    return models


def batch(kind: str, lengths: list[int], seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(3, 250, (n,), generator=g).tolist() for n in lengths]
    out = pad_rows(rows, pad_id=0)
    n = len(lengths) if kind == "pairwise" else len(lengths) // 2
    out["labels"] = torch.arange(n) % 2
    return out


def loss_and_grads(crm, b: dict) -> tuple[float, dict]:
    crm.zero_grad(set_to_none=True)
    loss = crm.loss(b)["loss"]
    loss.backward()
    return float(loss), {name: p.grad.clone() for name, p in crm.named_parameters()}


@pytest.mark.parametrize("kind", ["pairwise", "pointwise"])
def test_compiled_layers_give_eager_losses_and_gradients(kind):
    eager, compiled = crm_pair(kind)
    for lengths in ([12, 7, 9, 3], [20, 16, 5, 11]):
        loss_e, grads_e = loss_and_grads(eager, batch(kind, lengths))
        loss_c, grads_c = loss_and_grads(compiled, batch(kind, lengths))
        assert loss_c == pytest.approx(loss_e, rel=RTOL)
        assert grads_c.keys() == grads_e.keys()
        for name, g in grads_e.items():
            torch.testing.assert_close(grads_c[name], g, rtol=RTOL, atol=ATOL, msg=name)
    stats = compiling.compile_stats()
    assert stats["graph_breaks"] == 0 and stats["graphs"] >= 1 and stats["seconds"] > 0


def test_varying_shapes_stay_within_the_recompile_bound():
    """Rows of 2 to 90 tokens, micro batches of 1 to 6 rows, then evaluation: dynamic shapes keep
    one training graph; only a batch of one row and evaluation's no-grad mode compile again."""
    _, crm = crm_pair("pairwise")
    before = compiling.compile_stats()["graphs"]
    g = torch.Generator().manual_seed(1)
    for step in range(12):
        rows = int(torch.randint(1, 7, (1,), generator=g))
        lengths = torch.randint(2, 91, (rows,), generator=g).tolist()
        crm.loss(batch("pairwise", lengths, seed=step))["loss"].backward()
    with torch.inference_mode():
        crm.eval()(**{k: v for k, v in batch("pairwise", [30, 12, 40]).items() if k != "labels"})
    new = compiling.compile_stats()["graphs"] - before
    assert 1 <= new <= compiling.RECOMPILE_WARNING, new
    assert compiling.compile_stats()["graph_breaks"] == 0


def test_eager_context_runs_a_compiled_layer_without_compiling():
    _, crm = crm_pair("pairwise")
    before = compiling.compile_stats()["graphs"]
    with compiling.eager():  # a one-token batch: not worth a graph
        crm.loss(batch("pairwise", [1]))["loss"].backward()
    assert compiling.compile_stats()["graphs"] == before


def test_settings_and_the_compilers_inductor_needs():
    assert resolve_compile("auto", "cuda") and not resolve_compile("auto", "cpu")
    assert resolve_compile(True, "cpu") and not resolve_compile(False, "cuda")
    with pytest.raises(ValueError, match="expected auto, true or false"):
        resolve_compile("yes", "cpu")
    # This machine compiles CPU kernels (the tests above ran): the private lookups still exist.
    assert compiling.why_not_compilable("cpu") is None
    assert isinstance(compiling.why_not_compilable("cuda"), (str, type(None)))


def test_a_missing_cxx_compiler_is_named():
    from torch._inductor import config
    from torch._inductor.cpp_builder import cpp_compiler_search

    cpp_compiler_search.cache_clear()  # inductor remembers the compiler it found
    try:
        with config.patch({"cpp.cxx": ("no-such-compiler-for-crm",)}):
            assert "no C++ compiler found" in compiling.why_not_compilable("cpu")
    finally:
        cpp_compiler_search.cache_clear()


def test_where_inductor_cannot_build_compile_true_is_refused_and_auto_stays_eager(monkeypatch, caplog):
    """crm-train and CRMScorer decide alike (crm-eval, crm-leaderboard and crm-usl load the scorer)."""
    from scorers import tiny_scorer

    monkeypatch.setattr(compiling, "why_not_compilable", lambda device: "no Triton (test)")
    with pytest.raises(ValueError, match=r"^compile=true on cuda: no Triton \(test\); set compile=false"):
        compiling.decide(True, "cuda")
    assert compiling.decide("auto", "cuda") is False and "stay eager on cuda" in caplog.text
    assert compiling.decide(False, "cuda") is False
    with pytest.raises(ValueError, match=r"^compile=true on cpu: no Triton \(test\)"):
        tiny_scorer("pairwise", compile=True)
