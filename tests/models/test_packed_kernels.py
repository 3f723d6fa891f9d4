"""The GPU kernels' inputs, checked on CPU: FlexAttention's block mask built from tile bounds keeps
what the [T, T] mask keeps, compiled layers see packed rows of varying length without a graph per
length, and the varlen kernel reads grouped key/value heads without copying them per query head."""
from __future__ import annotations

import random

import pytest
import torch
from test_packed_attention import batches, make_crm

from crm.models import compile as compiling
from crm.models import packing

pytestmark = pytest.mark.usefixtures("one_thread", "fresh_dynamo")  # tests/conftest.py


def dense_reference(segment_ids, branch_ids):
    from torch.nn.attention.flex_attention import create_block_mask

    def keep(batch, head, q, kv):
        same_branch = (branch_ids[kv] == 0) | (branch_ids[kv] == branch_ids[q])
        return (segment_ids[q] == segment_ids[kv]) & (kv <= q) & same_branch

    n = segment_ids.shape[0]
    return create_block_mask(keep, None, None, n, n, device="cpu")


@pytest.mark.parametrize("kind, lengths, shared", [
    ("pairwise", [130, 7, 300, 128, 1, 77], 0),
    ("pointwise", [200, 90, 129, 3, 260, 140], 150),  # branches within and across tiles
    ("pointwise", [12, 7, 9, 3], 5),  # one partial tile
])
def test_the_tile_mask_keeps_what_the_dense_mask_keeps(kind, lengths, shared):
    from torch.nn.attention.flex_attention import flex_attention

    _, packed = batches(kind, lengths, shared=shared)
    segment_ids, branch_ids = packed["segment_ids"], packed["branch_ids"]
    tiles, dense = packing.block_mask(segment_ids, branch_ids), dense_reference(segment_ids, branch_ids)
    # every tile the dense mask keeps is kept (full or partial), and none it skips is full
    kept = lambda m: (m.to_dense() > 0)  # noqa: E731
    assert bool((kept(dense) <= kept(tiles)).all())
    n = segment_ids.shape[0]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 16, generator=g) for _ in range(3))
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=tiles),
                               flex_attention(q, k, v, block_mask=dense), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("path", ["flex", "gather"])
def test_twenty_packed_micro_batches_of_varying_length_compile_at_most_two_graphs(path):
    crm = make_crm("pointwise", compiled=True).eval()
    before = compiling.compile_stats()  # a process's running totals
    rng = random.Random(0)
    with torch.no_grad():
        for seed in range(20):
            # rows of 2 tiles or more (a row of one tile, under 128 tokens, is one more graph)
            lengths = [rng.randint(40, 90) for _ in range(2 * rng.randint(2, 4))]
            _, packed = batches("pointwise", lengths, shared=rng.randint(0, 20), seed=seed)
            packing.packed_hidden(crm.model, packed, path=path)
    stats = {key: value - before[key] for key, value in compiling.compile_stats().items()}
    # the decoder layers share one compiled code: its graphs are every layer's
    assert stats["graphs"] <= 2 and stats["graph_breaks"] == 0, stats


def test_varlen_reads_grouped_heads_without_a_copy_per_query_head(monkeypatch):
    """The varlen kernel (CUDA only) replaced by a recorder: what it is handed."""
    varlen = pytest.importorskip("torch.nn.attention.varlen")
    if not packing.VARLEN_GQA:
        pytest.skip("this torch's varlen_attn has no enable_gqa")
    seen = {}

    def recorder(q, k, v, *args, **kwargs):
        seen.update(q=q.shape, k=k.shape, kwargs=kwargs)
        return torch.zeros_like(q)

    monkeypatch.setattr(varlen, "varlen_attn", recorder)
    query, key = torch.randn(1, 8, 10, 16), torch.randn(1, 2, 10, 16)
    layout = packing.Layout("varlen", seq_starts=torch.tensor([0, 4, 10], dtype=torch.int32),
                            max_length=6)
    out, _ = packing.packed_attention(None, query, key, key.clone(), None, crm_packing=layout)
    assert out.shape == (1, 10, 8, 16)
    assert seen["q"] == (10, 8, 16) and seen["k"] == (10, 2, 16)  # 2 key/value heads, not 8
    assert seen["kwargs"]["enable_gqa"] is True
