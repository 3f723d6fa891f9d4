"""Per-GPU memory plan for FSDP2 full sharding with AdamW: an estimate, with every term stated.

All figures are GiB (2^30 bytes) on one GPU. P = all parameters (embeddings included), W = GPUs
(nodes x devices), L layers, h hidden size, q = heads x head_dim (the attention width), k =
kv_heads x head_dim, i = intermediate size, a = bytes of the compute dtype (activations).

States, sharded over W (bytes per parameter: param + grad + AdamW's two moments):
    bf16-mixed  4 + 4 + 8 = 16   fp32 master weights, gradients and moments; bf16 compute
    bf16-true   2 + 2 + 4 =  8   everything bf16
    32-true     4 + 4 + 8 = 16   everything fp32, fp32 compute

Unsharded in flight: FSDP2 all-gathers one decoder layer at a time and prefetches the next, and
does not reshard the root group (embeddings, final norm, head) between forward and backward:
    (root + 2 layers) parameters x a  +  1 layer's unsharded gradient (before its reduce-scatter)
    x gradient bytes.

Activations of one micro batch of T = micro_batch x rows_per_record x S tokens (rows_per_record
is 1 pairwise, 2 pointwise: chosen and rejected in one forward). What autograd keeps per token
for one Qwen3 decoder layer, in elements:
    layer set = 4h + 3q + 3k + 4i
      4h: block input, attention-norm output, residual after attention, MLP-norm output
      3q + 3k: q/k/v projections (q + 2k), q and k after q/k-norm and RoPE (q + k), attention
               output (q); flash/sdpa kernels keep only a per-head log-sum-exp besides (ignored)
      4i: gate, up, silu(gate), silu(gate) x up
    eager attention (not flash/sdpa) also keeps the probabilities: S x heads per token.
- with full activation checkpointing: the block inputs of every layer, L x h x a per token, plus
  one layer's recompute during its backward, counted as 2 x layer set x a per token (the
  recomputed activations and the gradients flowing through them, of the same order).
- without: every layer's set, L x layer set x a per token, plus one layer set of backward
  gradients.
- the head is tiny: the final norm's input and output (2 h a per token) and the logits (rows x
  num_labels x 4 B), shown separately to make that visible.

It fits if the total is at most the GPU memory less a `headroom_fraction` (default 10%, for
fragmentation and the estimate's error) and a fixed `reserved_gib` (default 2 GiB: CUDA context,
NCCL buffers, allocator reserve).

The activation figures assume a bf16 residual stream under bf16-mixed, i.e. FSDP2 computing with
bf16 parameters (MixedPrecisionPolicy(param_dtype=bfloat16)); autocast over fp32 parameters alone
keeps the residual stream (the block inputs) in fp32, twice the checkpointed term.

Host memory of one node at start-up (`host_startup_plan`), D = GPUs per node, c = bytes per
parameter of the checkpoint (2: Qwen3 releases are bf16), p = of the parameters:
- from a checkpoint (model.path; crm.training.parallel.build_sharded): each rank reads only the slices of
  its own shards, straight into its GPU. The node reads its share of the checkpoint, P x c x D / W,
  through the page cache (memory-mapped safetensors: clean pages the kernel can drop), and each
  rank holds one tensor slice in flight, read and converted: E / W x (c + p), E the largest
  tensor (bounded here by the root's parameters, the embedding nearly all of them).
- random init (model.arch, no path): every rank builds the whole model in host memory from the
  seed, then shards it: D x P x p.
Neither counts what every process holds anyway (Python, torch, transformers, Lightning imported:
0.43 GiB measured on CPU by benchmarks/load_memory.py; plus the CUDA context on a GPU).
"""
from __future__ import annotations

from dataclasses import dataclass

from crm.perf.flops import ModelShape

GIB = 2 ** 30


@dataclass(frozen=True)
class PrecisionBytes:
    param: int  # stored (sharded) parameter
    grad: int
    optimizer: int  # AdamW exp_avg + exp_avg_sq
    compute: int  # all-gathered parameters and activations


PRECISIONS: dict[str, PrecisionBytes] = {
    "bf16-mixed": PrecisionBytes(param=4, grad=4, optimizer=8, compute=2),
    "bf16-true": PrecisionBytes(param=2, grad=2, optimizer=4, compute=2),
    "32-true": PrecisionBytes(param=4, grad=4, optimizer=8, compute=4),
}
ROWS_PER_RECORD = {"pairwise": 1, "pointwise": 2}


def layer_set_elements(shape: ModelShape, seq_len: int, flash: bool = True) -> int:
    """Elements one decoder layer keeps for backward, per token (see the module docstring)."""
    q, k = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    n = 4 * shape.hidden + 3 * q + 3 * k + 4 * shape.intermediate
    return n if flash else n + seq_len * shape.heads


def activation_bytes(shape: ModelShape, *, seq_len: int, rows: int, compute_bytes: int,
                     checkpointing: bool, flash: bool = True) -> int:
    """Activations of `rows` rows of `seq_len` tokens, with or without full checkpointing."""
    tokens = rows * seq_len
    layer_set = layer_set_elements(shape, seq_len, flash)
    if checkpointing:
        per_token = shape.layers * shape.hidden + 2 * layer_set
    else:
        per_token = (shape.layers + 1) * layer_set
    return tokens * per_token * compute_bytes


def memory_plan(shape: ModelShape, *, world: int, seq_len: int, micro_batch_size: int = 1,
                kind: str = "pairwise", precision: str = "bf16-mixed",
                activation_checkpointing: bool = True, flash: bool = True,
                gpu_memory_gib: float = 80.0, headroom_fraction: float = 0.10,
                reserved_gib: float = 2.0) -> dict:
    """The per-GPU plan: GiB per term, totals with and without checkpointing, and `fits`.

    `total_gib` and `fits` are for the configured `activation_checkpointing`; the `_checkpointed`
    and `_full` variants give both settings.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: expected one of {', '.join(PRECISIONS)}")
    if kind not in ROWS_PER_RECORD:
        raise ValueError(f"kind={kind!r}: expected one of {', '.join(ROWS_PER_RECORD)}")
    if world < 1 or seq_len < 1 or micro_batch_size < 1:
        raise ValueError(f"world={world}, seq_len={seq_len}, micro_batch_size={micro_batch_size}: "
                         "each must be at least 1")
    b = PRECISIONS[precision]
    P = shape.total_params
    rows = micro_batch_size * ROWS_PER_RECORD[kind]
    gib = {
        "params": P * b.param / world,
        "grads": P * b.grad / world,
        "optimizer": P * b.optimizer / world,
        "unsharded": (shape.root_params + 2 * shape.layer_params) * b.compute
                     + shape.layer_params * b.grad,
        "activations_checkpointed": activation_bytes(shape, seq_len=seq_len, rows=rows,
                                                     compute_bytes=b.compute, checkpointing=True,
                                                     flash=flash),
        "activations_full": activation_bytes(shape, seq_len=seq_len, rows=rows,
                                             compute_bytes=b.compute, checkpointing=False,
                                             flash=flash),
        "head": rows * seq_len * 2 * shape.hidden * b.compute + rows * shape.num_labels * 4,
    }
    gib = {name: value / GIB for name, value in gib.items()}
    states = gib["params"] + gib["grads"] + gib["optimizer"]
    fixed = states + gib["unsharded"] + gib["head"]
    usable = gpu_memory_gib * (1.0 - headroom_fraction) - reserved_gib
    total_ckpt = fixed + gib["activations_checkpointed"]
    total_full = fixed + gib["activations_full"]
    total = total_ckpt if activation_checkpointing else total_full
    return {
        "precision": precision,
        "world": world,
        "seq_len": seq_len,
        "micro_batch_size": micro_batch_size,
        "rows_per_micro_batch": rows,
        "flash_attention": flash,
        "activation_checkpointing": activation_checkpointing,
        "bytes_per_param": {"param": b.param, "grad": b.grad, "optimizer": b.optimizer,
                            "compute": b.compute},
        "states_all_gpus_gib": P * (b.param + b.grad + b.optimizer) / GIB,
        **{f"{name}_gib": value for name, value in gib.items()},
        "states_gib": states,
        "total_checkpointed_gib": total_ckpt,
        "total_full_gib": total_full,
        "total_gib": total,
        "gpu_memory_gib": gpu_memory_gib,
        "headroom_fraction": headroom_fraction,
        "reserved_gib": reserved_gib,
        "usable_gib": usable,
        "fits_checkpointed": total_ckpt <= usable,
        "fits_full": total_full <= usable,
        "fits": total <= usable,
    }


def host_startup_plan(shape: ModelShape, *, world: int, devices: int, checkpoint_bytes: int = 2,
                      param_bytes: int = 4) -> dict:
    """Host memory of one node while the model is set up, GiB: from a checkpoint (each rank
    reading its slices) and from random init (every rank the whole model); see the docstring."""
    if world < 1 or devices < 1 or world % devices:
        raise ValueError(f"world={world}, devices={devices}: the world is whole nodes of devices")
    P = shape.total_params
    page_cache = P * checkpoint_bytes * devices / world
    in_flight = shape.root_params / world * (checkpoint_bytes + param_bytes)
    return {
        "checkpoint_bytes_per_param": checkpoint_bytes,
        "param_bytes_per_param": param_bytes,
        "pretrained_page_cache_gib": page_cache / GIB,
        "pretrained_in_flight_per_rank_gib": in_flight / GIB,
        "pretrained_gib": (page_cache + devices * in_flight) / GIB,
        "random_init_gib": devices * P * param_bytes / GIB,
    }
