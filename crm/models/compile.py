"""Each Qwen3 decoder layer compiled in place with torch.compile (inductor), for training and scoring.

Why: on an H100 the eager step spends most of its time outside the matmuls, in the decoder layer's
elementwise work (RMSNorm in float32, RoPE, SwiGLU); compiling each layer fuses it, and keeps less
for backward (docs/PERFORMANCE.md sections 4 and 9 have the figures).

- Per layer, in place (`layer.compile`): all decoder layers share one code and, in crm's calls
  (no KV cache, so no read of the layer index), one set of guards, so one compiled graph serves
  every layer and compile time is one layer's. Embeddings, the mask and the head stay eager, and
  parameter names do not change (checkpoints and exports keep their keys).
- Order (torchtitan's): activation checkpointing, then compile, then FSDP2's `fully_shard`
  (crm.training.parallel.build_sharded). transformers 5 checkpoints a layer's `forward`, inside
  the compiled call; FSDP2's hooks are its own.
- Shapes: only what varies is dynamic. The batch and sequence dimensions of the layers' inputs
  (the embeddings' output, RoPE's cos/sin) are marked dynamic where they are made, so the first
  graph already serves every row length and micro batch; everything the model fixes (head size,
  grouped heads, the norms' eps, the attention scale) stays a constant of the graph, for inductor's
  fixed-size fused reductions (`dynamic=True` made the hidden size a symbol and read eps and scale
  from 0-d tensors with `.item()`). Dynamo still specialises a size of 1, so a micro batch of one row,
  or a forward in eval mode, compiles once more. `fullgraph=True`: a graph break is an error,
  never a silent fall back to eager, and so is passing torch._dynamo's recompile limit (8 graphs
  per code); `compile_stats` counts graphs and breaks for the logs, and `RECOMPILE_WARNING` is
  where crm warns first.
- Attention: sdpa (or eager) only; `backbone.choose_attention` picks sdpa for compiled layers and
  refuses an explicit flash_attention_2, whose transformers wrapper dynamo cannot capture whole.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from crm.models.backbone import decoder_layers
from crm.models.config import COMPILABLE_ATTENTION, not_compilable, resolve_compile

log = logging.getLogger(__name__)

# Training compiles a graph for the train step, one for evaluation (inference mode), and one more
# for each with a micro batch of one row; past this many, shapes are varying in a way the run should
# know about.
RECOMPILE_WARNING = 4


def decide(setting, device_type: str) -> bool:
    """Whether to compile for `device_type`: `resolve_compile`, then where inductor cannot build there,
    compile=true is refused (ValueError, one line) and auto stays eager with a warning."""
    wanted = resolve_compile(setting, device_type)
    reason = why_not_compilable(device_type) if wanted else None
    if reason and setting is True:
        raise ValueError(f"compile=true on {device_type}: {reason}; set compile=false (or auto)")
    if reason:
        log.warning("compile=auto: decoder layers stay eager on %s: %s", device_type, reason)
        return False
    return wanted


def why_not_compilable(device_type: str) -> str | None:
    """Why inductor cannot compile for `device_type` here (None when it can).

    Inductor needs a C++ compiler for CPU code and Triton for CUDA code; without them the first
    forward would fail minutes into a run, after the model was built.
    """
    if device_type == "cuda":
        # torch.utils._triton is private; no public check exists (tests/models/test_compile.py
        # fails if it moves).
        from torch.utils._triton import has_triton

        return None if has_triton() else "Triton is not installed (inductor generates Triton for CUDA)"
    from torch._inductor import exc
    from torch._inductor.cpp_builder import get_cpp_compiler  # private: as above

    try:
        get_cpp_compiler()
    except exc.InvalidCxxCompiler:
        return "no C++ compiler found (inductor builds CPU kernels with g++ or clang++, or $CXX)"
    return None


def compile_layers(model: nn.Module, backend="inductor") -> int:
    """Compiles each decoder layer of `model` (a Qwen3 sequence classifier) in place; returns how many.

    `backend="aot_eager"` traces and runs the same graphs without generating code (a fast check of
    capture, guards and autograd); a callable backend receives each captured graph.
    """
    attention = model.config._attn_implementation
    if attention not in COMPILABLE_ATTENTION:
        raise ValueError(not_compilable(attention))
    mark_dynamic_dimensions(model)
    layers = decoder_layers(model)
    for layer in layers:
        # dynamic=None: the dimensions marked dynamic are symbols, everything else a constant
        layer.compile(backend=backend, fullgraph=True)
    log.info("compiled %d decoder layers (torch.compile, %s, batch and sequence dynamic, %s attention)",
             len(layers), getattr(backend, "__name__", backend), attention)
    return len(layers)


def mark_dynamic_dimensions(model: nn.Module) -> None:
    """Marks batch and sequence dynamic on what the decoder layers receive: the embeddings' output
    (batch, sequence, hidden) and RoPE's cos and sin (batch or 1, sequence, head size).

    Marked where they are made (forward hooks on the eager modules that make them): a mark on a
    tensor is read when a graph is compiled for it, and inside the compiled layer it is too late.
    The next layers' inputs, outputs of the compiled graph, match the dynamic graph's guards without
    a mark. `maybe_mark_dynamic`: a dimension of size 1 is specialised, not an error.
    """
    backbone = model.model
    if getattr(backbone, "_crm_dynamic_marks", False):
        return

    def mark(module, args, output):
        for tensor in output if isinstance(output, tuple) else (output,):
            torch._dynamo.maybe_mark_dynamic(tensor, (0, 1))

    backbone.embed_tokens.register_forward_hook(mark)
    backbone.rotary_emb.register_forward_hook(mark)
    backbone._crm_dynamic_marks = True


def compile_stats() -> dict:
    """This process's torch.compile figures so far: graphs compiled, graph breaks, seconds spent.

    torch keeps them in torch._dynamo.utils (private; no public counters exist, and
    tests/models/test_compile.py fails if they move).
    """
    from torch._dynamo.utils import calculate_time_spent, counters

    return {"graphs": int(counters["stats"].get("unique_graphs", 0)),
            "graph_breaks": int(sum(counters["graph_break"].values())),
            "seconds": round(calculate_time_spent().get("total_wall_time", 0.0), 2)}


def eager():
    """A context in which compiled layers run eagerly (a rare shape not worth a compile: the empty
    batch's single token, the prefix engine's cached keys and values)."""
    return torch.compiler.set_stance("force_eager")
