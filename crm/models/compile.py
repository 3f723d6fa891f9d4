"""Each Qwen3 decoder layer compiled in place with torch.compile (inductor), for training and scoring.

Why: on an H100 the eager step spends most of its time outside the matmuls, in the decoder layer's
elementwise work (RMSNorm in float32, RoPE, SwiGLU); compiling each layer fuses it, and keeps about
a third less for backward (docs/PERFORMANCE.md sections 4 and 9).

- Per layer, in place (`layer.compile`): all decoder layers share one code and, in crm's calls
  (no KV cache, so no read of the layer index), one set of guards, so one compiled graph serves
  every layer and compile time is one layer's. Embeddings, the mask and the head stay eager, and
  parameter names do not change (checkpoints and exports keep their keys).
- Order (torchtitan's): activation checkpointing, then compile, then FSDP2's `fully_shard`
  (crm.training.parallel.build_sharded). transformers 5 checkpoints a layer's `forward`, inside
  the compiled call; FSDP2's hooks are its own.
- Shapes: `dynamic=True`, so rows of any length and micro batches of any size reuse the graph;
  dynamo still specialises sizes 0 and 1, so a micro batch of one row, or a forward in eval mode,
  compiles once more. `fullgraph=True`: a graph break is an error, never a silent fall back to
  eager, and so is passing torch._dynamo's recompile limit (8 graphs per code); `compile_stats`
  counts graphs and breaks for the logs, and `RECOMPILE_WARNING` is where crm warns first.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from crm.models.backbone import decoder_layers

log = logging.getLogger(__name__)

SETTINGS = ("auto", True, False)
# Training compiles a graph for the train step, one for evaluation (inference mode), and one more
# per size specialised at 1; past this many, shapes are varying in a way the run should know about.
RECOMPILE_WARNING = 4


def resolve(setting, device_type: str) -> bool:
    """The `compile` setting for a model on `device_type`: auto = on where it runs on CUDA.

    On CPU compiling costs more than it saves for crm's sizes (docs/PERFORMANCE.md section 9), so
    there it is only done when asked for.
    """
    if setting == "auto":
        return device_type == "cuda"
    if setting in (True, False):
        return setting
    raise ValueError(f"compile={setting!r}: expected auto, true or false")


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


def compile_layers(model: nn.Module, backend: str = "inductor") -> int:
    """Compiles each decoder layer of `model` (a Qwen3 sequence classifier) in place; returns how many.

    `backend="aot_eager"` traces and runs the same graphs without generating code (a fast check of
    capture, guards and autograd).
    """
    layers = decoder_layers(model)
    for layer in layers:
        layer.compile(backend=backend, fullgraph=True, dynamic=True)
    log.info("compiled %d decoder layers (torch.compile, %s, dynamic shapes)", len(layers), backend)
    return len(layers)


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
