"""Packed rows (crm.data.packing, crm.models.packing): a micro batch in one row of real tokens gives
the loss and every gradient of its right-padded rows, plain, with LoRA, with activation
checkpointing and with compiled layers; a pointwise pair's criteria + query computed once gives
each response the reward it has alone; FlexAttention's mask keeps what the gathered views keep.

On CPU the packed path is "gather" (crm.models.packing.attention_path); FlexAttention runs here only
without gradients (torch has no CPU backward for it). The CUDA tests run on a GPU machine: the
varlen and flex kernels, eager and in compiled layers, against the padded path.
"""
from __future__ import annotations

import pytest
import torch
from helpers import COMPILE_ARCH, tiny_tokenizer

from crm.data.config import resolve_packing
from crm.data.packing import Budget, pack, split_shared, unpack
from crm.data.padding import pad_rows
from crm.models import compile as compiling
from crm.models import packing
from crm.models.factory import LossConfig, ModelConfig, build_crm
from crm.models.heads import head
from crm.models.lora import LoraConfig
from crm.training.parallel import ParallelConfig, prepare_layers

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_dynamo")  # tests/conftest.py
RTOL, ATOL = 1e-5, 1e-7  # float32; the bound is 1e-5 relative
ARCH = {**COMPILE_ARCH, "num_hidden_layers": 2}
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def batches(kind: str, lengths: list[int], shared: int = 0, seed: int = 0) -> tuple[dict, dict]:
    """(right-padded batch, packed batch) of the same records. Pointwise: len(lengths) // 2 pairs,
    chosen then rejected, each pair's two rows opening with the same `shared` tokens."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randint(3, 250, (n,), generator=g).tolist() for n in lengths]
    if kind == "pairwise":
        padded, packed = pad_rows(rows, pad_id=0), pack([(r,) for r in rows])
        padded["labels"] = packed["labels"] = torch.arange(len(rows)) % 2
        packed["branched"] = False
        return padded, packed
    n = len(rows) // 2
    prefixes = [torch.randint(3, 250, (shared,), generator=g).tolist() for _ in range(n)]
    chosen = [p + r for p, r in zip(prefixes, rows[:n])]
    rejected = [p + r for p, r in zip(prefixes, rows[n:])]
    packed = pack([split_shared(c, r) for c, r in zip(chosen, rejected)])
    packed["branched"] = True
    return pad_rows(chosen + rejected, pad_id=0), packed


def make_crm(kind: str, *, lora: bool = False, checkpointing: bool = False, compiled: bool = False,
             device: str = "cpu"):
    tok = tiny_tokenizer()
    torch.manual_seed(0)
    crm = build_crm(ModelConfig(arch=ARCH, attention="sdpa"), LossConfig(kind), num_labels=2,
                    pad_token_id=tok.pad_token_id, vocab_size=len(tok),
                    lora=LoraConfig(rank=4, base_dtype="float32") if lora else None)
    prepare_layers(crm, ParallelConfig(activation_checkpointing=checkpointing), compile=False)
    if compiled:  # aot_eager on CPU: capture, guards and autograd without generating kernels
        compiling.compile_layers(crm.model, backend="inductor" if device == "cuda" else "aot_eager")
    return crm.to(device).train()


def loss_and_grads(crm, batch: dict) -> tuple[torch.Tensor, dict]:
    crm.zero_grad(set_to_none=True)
    loss = crm.loss(batch)["loss"]
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in crm.named_parameters() if p.grad is not None}


def assert_same_training(crm, padded: dict, packed: dict, rtol=RTOL, atol=ATOL) -> None:
    loss_padded, grads_padded = loss_and_grads(crm, padded)
    loss_packed, grads_packed = loss_and_grads(crm, packed)
    torch.testing.assert_close(loss_packed, loss_padded, rtol=rtol, atol=atol)
    assert grads_packed.keys() == grads_padded.keys() and grads_padded
    for name, grad in grads_padded.items():
        torch.testing.assert_close(grads_packed[name], grad, rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("setup", ["plain", "lora", "checkpointing", "compiled"])
@pytest.mark.parametrize("kind", ["pairwise", "pointwise"])
def test_a_packed_batch_gives_the_padded_loss_and_every_gradient(kind, setup):
    crm = make_crm(kind, lora=setup == "lora", checkpointing=setup == "checkpointing",
                   compiled=setup == "compiled")
    for seed, lengths in enumerate(([12, 7, 9, 3], [20, 16, 5, 11, 30, 2])):
        padded, packed = batches(kind, lengths, shared=6, seed=seed)
        assert packed["input_ids"].shape[0] == 1 and packed["real_tokens"] < padded["input_ids"].numel()
        assert_same_training(crm, padded, packed)
    if setup == "compiled":
        assert compiling.compile_stats()["graph_breaks"] == 0


def filled(kind: str, packed: dict, budget: int) -> dict:
    """`packed`'s records packed again with a token budget (crm-train's stream.token_budget)."""
    segments = [(ids,) for ids in unpack(packed)] if kind == "pairwise" else None
    if segments is None:  # the pairs again: chosen reads first, then rejected
        sequences = unpack(packed)
        n = len(sequences) // 2
        segments = [split_shared(c, r) for c, r in zip(sequences[:n], sequences[n:])]
    batch = pack(segments, budget=Budget(budget, records=len(segments), longest=64))
    return {**batch, "branched": packed["branched"],
            **({"labels": packed["labels"]} if "labels" in packed else {})}


@pytest.mark.parametrize("kind", ["pairwise", "pointwise"])
def test_a_row_filled_to_a_token_budget_gives_the_same_loss_and_every_gradient(kind):
    crm = make_crm(kind)
    padded, packed = batches(kind, [20, 16, 5, 11, 30, 2], shared=6)
    with_budget = filled(kind, packed, budget=256)
    assert with_budget["input_ids"].shape[1] == 256 > packed["real_tokens"] == with_budget["real_tokens"]
    assert_same_training(crm, padded, with_budget)
    with torch.no_grad():  # FlexAttention's mask (CPU: forward only) keeps the filling to itself
        flex = packing.packed_hidden(crm.model, with_budget, path="flex")
        gathered = packing.packed_hidden(crm.model, packed, path="gather")
    torch.testing.assert_close(flex, gathered, rtol=1e-5, atol=1e-6)


def test_a_shared_prefix_reward_equals_the_response_scored_alone():
    crm = make_crm("pointwise").eval()
    _, packed = batches("pointwise", [9, 4, 13, 1, 7, 22], shared=17)
    with torch.no_grad():
        rewards = head(crm.model, packing.packed_hidden(crm.model, packed)).squeeze(-1)
        alone = []
        for sequence in unpack(packed):
            ids = torch.tensor([sequence])
            alone.append(crm(ids, torch.ones_like(ids))[0])
    # the shared prefix is computed once: fewer tokens than the pairs' rows hold
    assert packed["real_tokens"] == packed["attended_tokens"] - 3 * 17
    torch.testing.assert_close(rewards, torch.stack(alone), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("kind", ["pairwise", "pointwise"])
def test_flex_attentions_block_mask_keeps_what_the_gathered_views_keep(kind):
    crm = make_crm(kind).eval()
    _, packed = batches(kind, [12, 7, 9, 3, 15, 5], shared=5)
    with torch.no_grad():
        gathered = packing.packed_hidden(crm.model, packed, path="gather")
        flex = packing.packed_hidden(crm.model, packed, path="flex")
    torch.testing.assert_close(flex, gathered, rtol=1e-5, atol=1e-6)


def test_auto_packs_where_it_was_measured_faster():
    assert resolve_packing("auto", "cuda", "pairwise") and resolve_packing("auto", "cuda", "pointwise")
    assert not resolve_packing("auto", "cpu", "pointwise") and not resolve_packing("auto", "cpu", "pairwise")
    assert resolve_packing(True, "cpu", "pairwise") and not resolve_packing(False, "cuda", "pointwise")
    with pytest.raises(ValueError, match="stream.packing='yes': expected auto, true or false"):
        resolve_packing("yes", "cpu", "pairwise")


def test_one_place_chooses_the_kernel():
    assert packing.attention_path("cpu", branched=False) == "gather"
    assert packing.attention_path("cpu", branched=True) == "gather"
    assert packing.attention_path("cuda", branched=True) == "flex"
    expected = "varlen" if packing.varlen_available() else "flex"
    assert packing.attention_path("cuda", branched=False) == expected
    crm = make_crm("pairwise")
    _, packed = batches("pairwise", [4, 5])
    with pytest.raises(ValueError, match="packed attention path 'dense'"):
        packing.packed_hidden(crm.model, packed, path="dense")


def assert_close_in_norm(crm, padded: dict, packed: dict, bound: float) -> None:
    """Loss and each gradient within `bound` of the padded path's, relative to its norm: two 16-bit
    kernels round differently, elementwise bounds would fail on the smallest entries."""
    loss_padded, grads_padded = loss_and_grads(crm, padded)
    loss_packed, grads_packed = loss_and_grads(crm, packed)
    assert abs(float(loss_packed - loss_padded)) <= bound * abs(float(loss_padded))
    assert grads_packed.keys() == grads_padded.keys() and grads_padded
    for name, grad in grads_padded.items():
        assert float((grads_packed[name] - grad).norm()) <= bound * float(grad.norm()) + 1e-8, name


@cuda
@pytest.mark.parametrize("dtype, compiled", [("float32", False), ("bfloat16", False), ("bfloat16", True)])
@pytest.mark.parametrize("kind", ["pairwise", "pointwise"])
def test_the_gpu_kernels_give_the_padded_loss_and_gradients(kind, dtype, compiled):
    """On the GPU, against the padded path's sdpa: FlexAttention in float32 (both kinds) and for
    pointwise branches under bf16 autocast; the varlen flash kernel for pairwise rows under bf16
    autocast; eager and in compiled layers."""
    crm = make_crm(kind, compiled=compiled, device="cuda")
    padded, packed = batches(kind, [120, 77, 300, 5, 64, 211], shared=40)
    to = lambda b: {k: v.cuda() if torch.is_tensor(v) else v for k, v in b.items()}  # noqa: E731
    padded, packed = to(padded), to(packed)
    varlen = kind == "pairwise" and dtype == "bfloat16" and packing.varlen_available()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
        path = packing.attention_path("cuda", packed["branched"], packing.compute_dtype(crm.model))
        assert path == ("varlen" if varlen else "flex")
        if dtype == "float32":
            assert_same_training(crm, padded, packed, rtol=1e-4, atol=1e-5)
        else:
            assert_close_in_norm(crm, padded, packed, bound=2e-2)
    assert compiling.compile_stats()["graph_breaks"] == 0


@cuda
@pytest.mark.parametrize("kind", ["pairwise", "pointwise"])
def test_the_gpu_kernels_give_the_padded_loss_with_a_token_budget(kind):
    """varlen (pairwise, its segment starts listing empty segments up to a fixed count, its longest
    segment the budget's) and flex (pointwise) over a row filled to a token budget."""
    crm = make_crm(kind, device="cuda")
    padded, packed = batches(kind, [120, 77, 300, 5, 64, 211], shared=40)
    with_budget = filled(kind, packed, budget=2048)
    to = lambda b: {k: v.cuda() if torch.is_tensor(v) else v for k, v in b.items()}  # noqa: E731
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert_close_in_norm(crm, to(padded), to(with_budget), bound=2e-2)

