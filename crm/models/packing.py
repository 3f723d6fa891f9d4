"""Attention over a packed row (crm.data.packing): each segment attends only within itself, each
branch of a segment to the shared prefix and to itself (docs/PERFORMANCE.md section 5).

`attention_path` is the one place that chooses the kernel:
- "varlen": on CUDA, for a block-diagonal row (no branches: pairwise records) computed in 16 bits
  (bf16 autocast, or FSDP's bf16 parameters), PyTorch's variable-length flash kernel
  (`torch.nn.attention.varlen`) over the segments' starts: no mask, no padding, no wasted block;
- "flex": on CUDA, for a row with branches (pointwise pairs sharing criteria + query), in float32,
  or where the varlen kernel is missing, FlexAttention with a block mask built once per forward from the
  segment and branch ids (compiled: only the blocks the mask keeps are computed);
- "gather": elsewhere (CPU), each branch's own sequence gathered from the row into a right-padded
  batch of views and run through sdpa's fused causal kernel, outputs scattered back. The views are
  the rows the padded path computes, so attention costs what it did and is computed by the same
  kernel, while every other part of the layer (projections, norms, MLP: most of a decoder
  layer's work) runs on the real tokens only, and the shared prefix once. On CPU FlexAttention
  runs eagerly as the reference math over the whole row (every masked score computed) or needs
  inductor's compile, and a dense boolean mask makes sdpa leave its causal kernel for one that
  computes every masked block: both cost more than the padding they remove.

A model that runs a packed batch has its attention implementation set to `ATTENTION` (registered
with transformers then), which runs a packed call's kernel and a plain call (no layout: a
right-padded batch) through sdpa, so the same model runs both.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

ATTENTION = "crm_packed"
PATHS = ("gather", "flex", "varlen")


def _varlen_causal() -> dict:
    """varlen_attn's causal argument: `window_size=(-1, 0)` from torch 2.13, `is_causal` before
    (read here, outside any compiled code: dynamo would trace a cached lookup)."""
    import inspect

    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return {}
    if "window_size" in inspect.signature(varlen_attn).parameters:
        return {"window_size": (-1, 0)}
    return {"is_causal": True}


VARLEN_CAUSAL = _varlen_causal()


def _varlen_takes_gqa() -> bool:
    """Whether varlen_attn reads grouped key/value heads itself (`enable_gqa`, torch 2.13)."""
    import inspect

    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return False
    return "enable_gqa" in inspect.signature(varlen_attn).parameters


VARLEN_GQA = _varlen_takes_gqa()


class Layout(NamedTuple):
    """What one packed forward's attention reads (passed to every layer as `crm_packing`)."""

    path: str
    views: torch.Tensor | None = None  # gather: [views, width] token indices
    owner: torch.Tensor | None = None  # gather: per token, its output's index in views x width
    block_mask: object | None = None  # flex: a BlockMask over the row
    seq_starts: torch.Tensor | None = None  # varlen: cumulative segment starts (int32)
    max_length: int = 0  # varlen: the longest segment


@functools.cache
def varlen_available() -> bool:
    """PyTorch's varlen flash kernel is there and this GPU runs it (Ampere or newer)."""
    try:
        from torch.nn.attention import varlen  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8


def attention_path(device_type: str, branched: bool, dtype: torch.dtype = torch.bfloat16) -> str:
    """The kernel for a packed row on `device_type`, with branches (`branched`) or without,
    computed in `dtype` (flash kernels take 16-bit inputs only)."""
    if device_type != "cuda":
        return "gather"
    half = dtype in (torch.bfloat16, torch.float16)
    return "varlen" if not branched and half and varlen_available() else "flex"


def compute_dtype(model) -> torch.dtype:
    """The dtype `model`'s attention computes in: autocast's where it is on, else the dtype FSDP2
    gathers the parameters in (`crm_compute_dtype`, set by crm.training.parallel), else the
    parameters'."""
    device = model.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return getattr(model, "crm_compute_dtype", model.dtype)


def use_packed_attention(model) -> None:
    """Routes `model`'s attention through `packed_attention` (idempotent). Not at import: importing
    crm changes nothing in transformers."""
    if model.config._attn_implementation != ATTENTION:
        AttentionInterface.register(ATTENTION, packed_attention)
        model.config._attn_implementation = ATTENTION


def packed_hidden(model, batch: dict, path: str | None = None) -> torch.Tensor:
    """The backbone's hidden states at the tokens the head reads (`batch["read"]`), [reads, hidden],
    for a packed batch of crm.data.packing.pack. `path` overrides `attention_path` (tests)."""
    use_packed_attention(model)
    ids = batch["input_ids"]
    path = path or attention_path(ids.device.type, batch["branched"], compute_dtype(model))
    if path not in PATHS:
        raise ValueError(f"packed attention path {path!r}: expected one of {PATHS}")
    if path == "gather":
        # A dimension of a compiled layer's input that varies from batch to batch is a symbol of
        # its graph from the first one on, not a recompile per batch (crm.models.compile).
        torch._dynamo.maybe_mark_dynamic(batch["views"], (0, 1))
        torch._dynamo.maybe_mark_dynamic(batch["owner"], 0)
        layout = Layout(path, views=batch["views"], owner=batch["owner"])
    elif path == "varlen":
        # The segment count varies too; the longest segment, an int, turns dynamic at its
        # first change (dynamo's automatic dynamic shapes): two graphs, not one per batch.
        torch._dynamo.maybe_mark_dynamic(batch["seq_starts"], 0)
        layout = Layout(path, seq_starts=batch["seq_starts"], max_length=batch["max_length"])
    else:
        mask = block_mask(batch["segment_ids"], batch["branch_ids"])
        mark_tiles_dynamic(mask)
        layout = Layout(path, block_mask=mask)
    hidden = model.model(input_ids=ids, position_ids=batch["position_ids"], use_cache=False,
                         crm_packing=layout).last_hidden_state
    return hidden[0, batch["read"]]


BLOCK = 128  # FlexAttention's default sparse block: the mask is described per 128 x 128 tile


def mark_tiles_dynamic(mask) -> None:
    """The block mask's tile counts are symbols of a compiled layer's graph, as the row length
    is: a row of another length is not another graph (toward dynamo's limit of 8, which raises
    under fullgraph). The first graph still has the row length fixed (the mask's lengths are ints,
    dynamic from their first change on), and a row of one tile (under 128 tokens) is one more, as
    dynamo specialises a size of 1."""
    for tensor in (mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks,
                   mask.full_kv_indices, mask.q_num_blocks, mask.q_indices, mask.full_q_num_blocks,
                   mask.full_q_indices):
        if tensor is not None:
            torch._dynamo.maybe_mark_dynamic(tensor, tuple(range(2, tensor.dim())))


def block_mask(segment_ids: torch.Tensor, branch_ids: torch.Tensor):
    """FlexAttention's block mask of a packed row: a token sees the earlier tokens of its own
    segment that are in the shared prefix (branch 0) or in its own branch.

    Built from per-tile bounds, never from the [T, T] mask: create_block_mask without compile
    evaluates the mask at every pair (about 10 bytes x T^2: 1.6 GiB at 12,800 tokens), where a
    tile's segment and branch ranges decide it. A tile is full when its queries and keys lie in
    one piece each (a segment's prefix or branch), keys in the query's segment, earlier, in its
    prefix or its branch; skipped when causality, an earlier segment or another branch rules it
    out; else partial, where the kernel applies `keep` per pair. Memory: a few (T/128)^2 tensors.
    """
    from torch.nn.attention.flex_attention import BlockMask

    def keep(batch, head, q, kv):
        same_branch = (branch_ids[kv] == 0) | (branch_ids[kv] == branch_ids[q])
        return (segment_ids[q] == segment_ids[kv]) & (kv <= q) & same_branch

    n = segment_ids.shape[0]
    tiles = max(-(-n // BLOCK), 1)

    def bounds(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        padded = torch.nn.functional.pad(ids.long(), (0, tiles * BLOCK - n), value=-1)
        # the tail's filling (-1) never counts as the tile's smallest or largest real id
        rows = padded.view(tiles, BLOCK)
        real = rows >= 0
        low = torch.where(real, rows, torch.iinfo(torch.long).max).amin(1)
        return low, torch.where(real, rows, -1).amax(1)

    seg_low, seg_high = bounds(segment_ids)
    branch_low, branch_high = bounds(branch_ids)
    one_piece = (seg_low == seg_high) & (branch_low == branch_high)
    index = torch.arange(tiles, device=segment_ids.device)
    q, kv = index[:, None], index[None, :]
    same_piece_segment = one_piece[:, None] & one_piece[None, :] & (seg_low[:, None] == seg_low[None, :])
    kv_branch, q_branch = branch_low[None, :], branch_low[:, None]
    other_branch = same_piece_segment & (kv_branch != 0) & (kv_branch != q_branch)
    maybe = (kv <= q) & (seg_high[None, :] >= seg_low[:, None]) & ~other_branch
    full = (kv < q) & same_piece_segment & ((kv_branch == 0) | (kv_branch == q_branch))
    if n % BLOCK:  # the last tile holds fewer than BLOCK real tokens: never full
        full[-1, :] = False
        full[:, -1] = False
    partial = maybe & ~full

    def listed(tiles_kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        counts = tiles_kept.sum(-1, dtype=torch.int32)
        order = torch.argsort(tiles_kept.to(torch.int32), dim=-1, descending=True, stable=True)
        return counts[None, None], order.to(torch.int32)[None, None]

    return BlockMask.from_kv_blocks(*listed(partial), *listed(full), BLOCK_SIZE=BLOCK, mask_mod=keep,
                                    seq_lengths=(n, n))


def packed_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                     scaling: float | None = None, crm_packing: Layout | None = None, **kwargs):
    """transformers' attention interface: query [1, heads, tokens, head size], key and value with
    the grouped heads; returns ([1, tokens, heads, head size], None)."""
    if crm_packing is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    if crm_packing.path == "gather":
        views, owner = crm_packing.views, crm_packing.owner
        # Gathered token-major, [views, width, heads, d], then seen as [views, heads, width, d]: the
        # strides of the padded path's queries, which sdpa's CPU kernel reads fastest.
        rows = [t[0].transpose(0, 1)[views].transpose(1, 2) for t in (query, key, value)]
        out, _ = sdpa_attention_forward(module, *rows, None, dropout=dropout, scaling=scaling)
        return out.flatten(0, 1)[owner].unsqueeze(0), None  # out: [views, width, heads, d]
    if crm_packing.path == "varlen":
        from torch.nn.attention.varlen import varlen_attn

        # [tokens, heads, d]; under autocast RoPE's float32 cos/sin leave the queries and keys in
        # float32: cast as autocast casts sdpa's inputs
        dtype = value.dtype if not torch.is_autocast_enabled("cuda") else torch.get_autocast_dtype("cuda")
        q, k, v = (t[0].transpose(0, 1).to(dtype) for t in (query, key, value))
        groups = q.shape[1] // k.shape[1]
        grouped = {}
        if groups > 1 and VARLEN_GQA:  # no copy of the keys and values per query head
            grouped = {"enable_gqa": True}
        elif groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        starts, longest = crm_packing.seq_starts, crm_packing.max_length
        out = varlen_attn(q, k, v, starts, starts, longest, longest, scale=scaling, **VARLEN_CAUSAL,
                          **grouped)
        return out.unsqueeze(0), None
    # Inside a compiled layer dynamo captures flex_attention itself; an eager layer calls the
    # compiled function (built outside any trace).
    from torch.nn.attention.flex_attention import flex_attention

    attend = flex_attention if torch.compiler.is_compiling() else flex()
    out = attend(query, key, value, block_mask=crm_packing.block_mask, scale=scaling,
                 enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


@functools.cache
def flex():
    """flex_attention, compiled where it runs on CUDA (eager it is the reference math, every
    score computed)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True) if torch.cuda.is_available() else flex_attention

