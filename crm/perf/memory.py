"""Per-GPU memory plan of a training step: states, parameters in flight and activations, every term
stated, the activations those of HF's Qwen3 as they are.

All figures are GiB (2^30 bytes) on one GPU. P = all parameters (embeddings included), W = GPUs
(nodes x devices), L layers, h hidden size, q = heads x head_dim (the attention width), k =
kv_heads x head_dim, i = intermediate size, H heads, KV kv heads, d head_dim.

States (bytes per parameter: parameter + gradient + AdamW's two moments), sharded over W under
FSDP, whole on every GPU under DDP or on one GPU:
    bf16-mixed  4 + 4 + 8 = 16   fp32 weights, gradients and moments; bf16 compute
    bf16-true   2 + 2 + 4 =  8   everything bf16
    32-true     4 + 4 + 8 = 16   everything fp32

Parameters in flight. FSDP2 all-gathers one decoder layer at a time and prefetches the next, and
keeps the root group (embeddings, final norm, head) gathered between forward and backward:
(root + 2 layers) parameters in the compute dtype, plus one layer's unsharded gradient before its
reduce-scatter. Autocast (bf16-mixed without FSDP) keeps a bf16 copy of every matmul weight from
the forward to its backward, like an activation: 2 bytes per decoder-layer parameter.

Flat FSDP with grad_sync=step under accumulation skips the reduce-scatter on all micro batches but
the last, so every GPU holds the whole model's gradients unsharded in the reduce dtype until then:
P x 4 bytes more (bf16-mixed), `accumulated_grads` (HSDP reduce-scatters every micro batch: none).

Gradients and activations are not all there at once. Backward frees each layer's activations as
it fills that layer's gradients, so with one micro batch per optimizer step the peak is the larger
of the two (all activations at its start, all gradients at its end; the optimizer frees the
gradients after its step). With gradient accumulation the gradients of the earlier micro batches
are held while the next one runs: then the peak is their sum. `accumulating` (default True, the
larger) says which.

Activations: what autograd keeps for backward, per token of the tokens one micro batch computes
(`tokens_per_record` x micro batch): padded rows, micro_batch x rows_per_record x S (a pointwise
record is two rows, chosen and rejected, in one forward; S a full row, the plan has no padding);
packed (crm-train's stream.packing, crm.data.packing), the same for pairwise records, and for a
pointwise pair S x (2 - p), its criteria + query (the share p of a row, `prompt_share`) computed
once and its two responses as branches. Attention stays per record, so S, the row length, is still
the length each token attends over (eager attention's softmax below, and crm.perf.flops' S).
`LAYER_BYTES` holds, for one HF Qwen3 decoder layer, the bytes per token as a linear form in (h, q,
k, i, H, KV, 1), by how the layer computes:
    bf16      bf16 parameters and residual stream (FSDP2's param_dtype=bfloat16, or bf16-true)
    autocast  float32 parameters and residual stream under bf16 autocast (trainer=gpu, ddp)
    fp32      32-true
and whether it runs eagerly or compiled (crm.models.compile). They are measured, not derived: every
tensor autograd saves in one layer's forward (torch.autograd.graph.saved_tensors_hooks, parameters
left out) over Qwen3 layers of several shapes, fitted exactly by the form
(benchmarks/activation_inventory.py prints them; tests/perf/test_plan.py checks the eager forms
against a live count). Eagerly HF's RMSNorm keeps float32 copies of its input, q/k-norm float32
copies of q and k; compiled, inductor's partitioner recomputes the cheap elementwise work in
backward and keeps less (docs/PERFORMANCE.md section 4). Outside the layers (`REST_BYTES`): the
final norm, RoPE's cos/sin (per position) and the head's few rows.
- without activation checkpointing: every layer's set, L x layer + rest, per token;
- with: each layer keeps only its input (h per token in the residual stream's dtype) and one
  layer at a time recomputes its set during backward: L x h x r + layer + rest.
- eager attention (not sdpa or flash) also keeps the softmax, H x S x 6 bytes per token (float32
  and the compute dtype; not measured).

It fits if the total is at most the GPU memory less a `headroom_fraction` (default 10%: the
allocator's fragmentation and the plan's error, docs/PERFORMANCE.md section 4 compares it with
torch's measured peaks) and a fixed `reserved_gib` (default 2 GiB: CUDA context, NCCL buffers).

LoRA (`trainable`: crm.models.lora, lora.rank > 0): T = adapters + head (lora_parameters) train,
the model's other parameters are frozen in bf16 (lora.base_dtype): they hold 2 bytes each, sharded
like any parameter, and no gradient, no AdamW moments, no fp32 master copy. Gradients and
optimizer states are T's only; FSDP's in-flight gradient is one layer's share of T. The base and
so the residual stream are bf16 whatever the trainer's precision, so the layers compute as `bf16`
(no autocast copies of weights already in bf16). Activations: the full model's measured forms, an
upper bound: a frozen linear needs no copy of its input for a weight gradient, but the adapter
beside it (A, dropout 0) keeps that same tensor, and B keeps its rank-wide input (negligible).

Host memory of one node at start-up (`host_startup_plan`), D = GPUs per node, c = bytes per
parameter of the checkpoint (2: Qwen3 releases are bf16), p = of the parameters:
- from a checkpoint (model.path; crm.training.parallel.build_sharded): each rank reads only the
  slices of its own shards, straight into its GPU. The node reads its share of the checkpoint,
  P x c x D / W, through the page cache (memory-mapped safetensors: clean pages the kernel can
  drop), and each rank holds one tensor slice in flight, read and converted: E / W x (c + p), E the
  largest tensor (bounded here by the root's parameters, the embedding nearly all of them).
- random init (model.arch, no path): every rank builds the whole model in host memory from the
  seed, then shards it: D x P x p.
Neither counts what every process holds anyway (Python, torch, transformers, Lightning imported:
benchmarks/load_memory.py measures it: SLURM.md "Loading pretrained weights"; plus the CUDA context).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from crm.perf.flops import ModelShape

GIB = 2 ** 30


@dataclass(frozen=True)
class PrecisionBytes:
    param: int  # stored (sharded) parameter
    grad: int
    optimizer: int  # AdamW exp_avg + exp_avg_sq
    compute: int  # all-gathered parameters and activations


# The share of a packed pointwise row that is criteria + query, where the data's is not known:
# crm-plan's default prompt_share (configs/plan.yaml says where it was measured) and what crm-train
# plans parallel.sharding=auto with, so that the two decide alike.
PLANNED_PROMPT_SHARE = 0.2

PRECISIONS: dict[str, PrecisionBytes] = {
    "bf16-mixed": PrecisionBytes(param=4, grad=4, optimizer=8, compute=2),
    "bf16-true": PrecisionBytes(param=2, grad=2, optimizer=4, compute=2),
    "32-true": PrecisionBytes(param=4, grad=4, optimizer=8, compute=4),
}
STRATEGIES = ("fsdp", "ddp")
ROWS_PER_RECORD = {"pairwise": 1, "pointwise": 2}


def tokens_per_record(kind: str, seq_len: int, *, packing: bool = False, prompt_share: float = 0.0) -> float:
    """Tokens one record computes: its rows of `seq_len` tokens, or packed, a pointwise pair's
    criteria + query (`prompt_share` of a row) once and its two responses: seq_len x (2 - share).
    `prompt_share` is read only for a packed pointwise record."""
    if kind not in ROWS_PER_RECORD:
        raise ValueError(f"kind={kind!r}: expected one of {', '.join(ROWS_PER_RECORD)}")
    if not 0.0 <= prompt_share < 1.0:
        raise ValueError(f"prompt_share={prompt_share}: expected 0 <= prompt_share < 1 (the share of "
                         "a pointwise row that is criteria + query)")
    if packing and kind == "pointwise":
        return seq_len * (2.0 - prompt_share)
    return seq_len * ROWS_PER_RECORD[kind]


# Bytes per token kept by one decoder layer: coefficients of (h, q, k, i, H, KV, 1) (the docstring).
LAYER_BYTES: dict[tuple[str, bool], tuple[int, ...]] = {
    ("bf16", False): (16, 10, 10, 8, 8, 4, 8),
    ("autocast", False): (26, 10, 10, 8, 8, 4, 8),
    ("fp32", False): (24, 16, 16, 16, 8, 4, 8),
    ("bf16", True): (8, 6, 6, 6, 8, 4, 8),
    ("autocast", True): (10, 6, 6, 6, 8, 4, 8),
}
# Outside the layers, per token: coefficients of (h, 1), and RoPE's cos and sin per position (x d).
REST_BYTES = {"bf16": (6, 12, 4), "autocast": (8, 12, 8), "fp32": (8, 12, 8)}
RESIDUAL_BYTES = {"bf16": 2, "autocast": 4, "fp32": 4}


def compute_mode(precision: str, strategy: str) -> str:
    """How the layers compute: bf16 (FSDP2's bf16 parameters, bf16-true), autocast, fp32."""
    if precision == "32-true":
        return "fp32"
    if precision == "bf16-mixed" and strategy != "fsdp":
        return "autocast"
    return "bf16"


def layer_bytes(shape: ModelShape, mode: str, compiled: bool) -> int:
    """Bytes per token one decoder layer keeps for backward (measured forms, the docstring)."""
    q, k = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    sizes = (shape.hidden, q, k, shape.intermediate, shape.heads, shape.kv_heads, 1)
    return sum(c * n for c, n in zip(LAYER_BYTES[(mode, compiled)], sizes))


def rest_bytes(shape: ModelShape, mode: str) -> int:
    """Bytes per token kept outside the decoder layers (final norm, RoPE; RoPE counted per token)."""
    h, const, rope = REST_BYTES[mode]
    return h * shape.hidden + const + rope * shape.head_dim


def activation_bytes(shape: ModelShape, *, seq_len: int, tokens: float, mode: str, compiled: bool,
                     checkpointing: bool, attention: str = "sdpa") -> float:
    """Activations of `tokens` tokens each attending over sequences of `seq_len`, with or without
    full checkpointing."""
    layer = layer_bytes(shape, mode, compiled)
    if attention == "eager":
        layer += shape.heads * seq_len * 6
    if checkpointing:
        per_token = shape.layers * shape.hidden * RESIDUAL_BYTES[mode] + layer
    else:
        per_token = shape.layers * layer
    return tokens * (per_token + rest_bytes(shape, mode))


# The linear layers of a Qwen3 decoder layer: (in, out) features from the shape's sizes.
def decoder_linears(shape: ModelShape) -> dict[str, tuple[int, int]]:
    h, q, k, i = (shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim,
                  shape.intermediate)
    return {"q_proj": (h, q), "k_proj": (h, k), "v_proj": (h, k), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def lora_parameters(shape: ModelShape, rank: int, targets) -> int:
    """What LoRA trains: rank x (in + out) per adapted linear of every layer, and the head."""
    linears = decoder_linears(shape)
    adapters = sum(rank * sum(linears[name]) for name in targets)
    return shape.layers * adapters + shape.hidden * shape.num_labels


FROZEN_BYTES = 2  # a LoRA run's frozen base: bf16 (lora.base_dtype)


def memory_plan(shape: ModelShape, *, world: int, seq_len: int, micro_batch_size: int = 1,
                kind: str = "pairwise", packing: bool = False, prompt_share: float = 0.0,
                precision: str = "bf16-mixed", strategy: str = "fsdp",
                activation_checkpointing: bool = True, compiled: bool = False,
                attention: str = "sdpa", accumulating: bool = True, unsharded_grads: bool = False,
                gpu_memory_gib: float = 80.0, headroom_fraction: float = 0.10,
                reserved_gib: float = 2.0, trainable: int | None = None) -> dict:
    """The per-GPU plan: GiB per term, totals with and without checkpointing, and `fits`.

    `total_gib` and `fits` are for the configured `activation_checkpointing`; the `_checkpointed`
    and `_full` variants give both settings. `world` is the GPUs the states shard over (one node's
    under HSDP); `unsharded_grads` counts flat FSDP's gradients held whole, in the reduce dtype,
    across an accumulation under grad_sync=step (crm.perf.network). `packing` and `prompt_share`:
    the tokens a micro batch computes (`tokens_per_record`).
    """
    for name, value, allowed in (("precision", precision, PRECISIONS), ("kind", kind, ROWS_PER_RECORD),
                                 ("strategy", strategy, STRATEGIES)):
        if value not in allowed:
            raise ValueError(f"{name}={value!r}: expected one of {', '.join(allowed)}")
    if world < 1 or seq_len < 1 or micro_batch_size < 1:
        raise ValueError(f"world={world}, seq_len={seq_len}, micro_batch_size={micro_batch_size}: "
                         "each must be at least 1")
    b, mode = PRECISIONS[precision], compute_mode(precision, strategy)
    P = shape.total_params
    # T trains; a LoRA run's frozen bf16 base is everything of the model but its head (the
    # adapters are T's, on top of P).
    T, frozen = P, 0
    if trainable is not None:
        T, frozen, mode = trainable, P - shape.hidden * shape.num_labels, "bf16"
    stored = T * b.param + frozen * FROZEN_BYTES
    shards = world if strategy == "fsdp" else 1
    rows = 1 if packing else micro_batch_size * ROWS_PER_RECORD[kind]  # packed: the micro batch is one row
    per_record = tokens_per_record(kind, seq_len, packing=packing, prompt_share=prompt_share)
    tokens = micro_batch_size * per_record
    in_flight = copies = 0
    if strategy == "fsdp":
        layer_grads = shape.layer_params if trainable is None else T / shape.layers
        in_flight = (shape.root_params + 2 * shape.layer_params) * b.compute + layer_grads * b.grad
    elif mode == "autocast":
        copies = shape.layers * shape.layer_params * 2
    activations = {ckpt: activation_bytes(shape, seq_len=seq_len, tokens=tokens, mode=mode,
                                          compiled=compiled, checkpointing=ckpt, attention=attention)
                   for ckpt in (True, False)}
    gib = {
        "params": stored / shards,
        "grads": T * b.grad / shards,
        "optimizer": T * b.optimizer / shards,
        "unsharded": in_flight,
        "weight_copies": copies,
        "accumulated_grads": T * b.grad if unsharded_grads and accumulating else 0,
        "activations_checkpointed": activations[True],
        "activations_full": activations[False],
    }
    gib = {name: value / GIB for name, value in gib.items()}
    states = gib["params"] + gib["grads"] + gib["optimizer"]
    fixed = gib["params"] + gib["optimizer"] + gib["unsharded"] + gib["accumulated_grads"]

    def peak(activations: float) -> float:
        kept = activations + gib["weight_copies"]
        return fixed + (gib["grads"] + kept if accumulating else max(gib["grads"], kept))

    usable = gpu_memory_gib * (1.0 - headroom_fraction) - reserved_gib
    total_ckpt = peak(gib["activations_checkpointed"])
    total_full = peak(gib["activations_full"])
    total = total_ckpt if activation_checkpointing else total_full
    return {
        "precision": precision,
        "strategy": strategy,
        "compute": mode,
        "compiled": compiled,
        "attention": attention,
        "world": world,
        "seq_len": seq_len,
        "micro_batch_size": micro_batch_size,
        "packing": packing,
        "prompt_share": prompt_share if packing and kind == "pointwise" else None,  # where it counts
        "rows_per_micro_batch": rows,
        "tokens_per_record": per_record,
        "tokens_per_micro_batch": tokens,
        "activation_checkpointing": activation_checkpointing,
        "accumulating": accumulating,
        "bytes_per_param": {"param": b.param, "grad": b.grad, "optimizer": b.optimizer,
                            "compute": b.compute},
        "layer_bytes_per_token": layer_bytes(shape, mode, compiled),
        "trainable_params": T,
        "states_all_gpus_gib": (stored + T * (b.grad + b.optimizer)) / GIB,
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


# A sharded checkpoint holds, per trained parameter, its fp32 weight and AdamW's two fp32 moments
# (a LoRA run's frozen base is not saved: docs/CHECKPOINTING.md).
CHECKPOINT_BYTES_PER_TRAINED_PARAM = 12
CHECKPOINT_WRITE_GBS = 1.0  # what one node writes to a shared filesystem, GB/s: a conservative figure
TIMEOUT_MARGIN = 3  # a save's planned time x this: a slower filesystem, a busy node, a load
MIN_TIMEOUT_MINUTES = 30  # torch's default, kept as the floor


def process_group_timeout_minutes(shape: ModelShape, *, num_nodes: int,
                                  trained_params: int | None = None,
                                  write_gbs: float = CHECKPOINT_WRITE_GBS) -> int:
    """crm-train's `parallel.timeout_minutes=auto`: how long a rank may wait in a collective.

    The longest wait left inside training is a checkpoint save (the ranks meet at barriers around
    it, and the slowest writer sets the pace): every node writes its share of the checkpoint at
    `write_gbs`. Rank 0's long work (the export, the evaluation) runs after every rank has left
    the process group, so it does not count (docs/DESIGN.md section 9)."""
    params = shape.total_params if trained_params is None else trained_params
    seconds = params * CHECKPOINT_BYTES_PER_TRAINED_PARAM / (num_nodes * write_gbs * 1e9)
    return max(MIN_TIMEOUT_MINUTES, math.ceil(TIMEOUT_MARGIN * seconds / 60))
