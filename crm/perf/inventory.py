"""What autograd keeps for backward, counted: the measurement behind crm.perf.memory's LAYER_BYTES.

`saved_bytes` runs one forward of a module under `torch.autograd.graph.saved_tensors_hooks` and
sums the distinct storages it saves, parameters left out. `layer_bytes_per_token` does it for one
HF Qwen3 decoder layer at two token counts: the difference is what a token costs, the rest (a
bf16 copy of each matmul weight under autocast) what the layer costs once. `fit_forms` fits the
linear form of crm.perf.memory over several layer shapes (benchmarks/activation_inventory.py).
The counts are the same on any device: the layer's code, not the kernels, decides what is saved
(an attention kernel keeps its inputs, output and log-sum-exp on CPU and CUDA alike).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

MODES = ("bf16", "autocast", "fp32")
COLUMNS = ("hidden", "q", "k", "intermediate", "heads", "kv_heads", "one")


def saved_bytes(run: Callable[[], torch.Tensor], exclude: set[int]) -> int:
    """Bytes of the distinct storages `run()`'s forward saves for backward, less those in `exclude`
    (storage data pointers: the parameters, the input); then runs the backward, which frees them."""
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in exclude:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = run()
    out.float().sum().backward()
    return sum(seen.values())


def layer_bytes_per_token(fields: dict, mode: str, compiled: bool = False,
                          tokens: tuple[int, int] = (64, 128), rows: int = 2) -> tuple[float, float]:
    """(bytes per token, bytes per layer) one Qwen3 decoder layer of `fields` (Qwen3Config fields)
    keeps, computing in `mode`: bf16 parameters, float32 ones under bf16 autocast, or float32.

    The layer's input counts when the layer keeps it (the previous layer does not: its output
    comes from an addition, which keeps nothing), so the residual stream is counted once. RoPE's
    cos/sin are the model's, not the layer's (left out).
    """
    from crm.models.backbone import build_classifier
    from crm.models.compile import compile_layers

    torch.manual_seed(0)
    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    model = build_classifier(num_labels=2, pad_token_id=0, arch={**fields, "num_hidden_layers": 1},
                             attention="sdpa", dtype=dtype)
    if compiled:
        # Each shape its own graphs: one process measuring many would pass the recompile limit.
        torch._dynamo.reset()
        compile_layers(model)
    layer, rotary = model.model.layers[0], model.model.rotary_emb
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    counts = []
    for n in tokens:
        x = torch.randn(rows, n // rows, fields["hidden_size"], dtype=dtype, requires_grad=True)
        position_ids = torch.arange(n // rows)[None]
        cos, sin = rotary(x, position_ids)
        exclude = parameters | {cos.untyped_storage().data_ptr(), sin.untyped_storage().data_ptr()}

        def run():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
                return layer(x, attention_mask=None, position_embeddings=(cos, sin),
                             position_ids=position_ids)

        counts.append(saved_bytes(run, exclude))
    per_token = (counts[1] - counts[0]) / (tokens[1] - tokens[0])
    return per_token, counts[0] - per_token * tokens[0]


def sizes(fields: dict) -> tuple[int, ...]:
    """The form's columns for a shape: h, q, k, i, heads, kv heads, 1."""
    d = fields["head_dim"]
    return (fields["hidden_size"], fields["num_attention_heads"] * d,
            fields["num_key_value_heads"] * d, fields["intermediate_size"],
            fields["num_attention_heads"], fields["num_key_value_heads"], 1)


def fit_forms(shapes: list[dict], per_token: list[float]) -> tuple[list[float], float]:
    """Least-squares coefficients of the form over `shapes`, and the largest residual (bytes)."""
    import numpy as np

    a = np.array([sizes(f) for f in shapes], dtype=float)
    y = np.array(per_token, dtype=float)
    coefficients = np.linalg.lstsq(a, y, rcond=None)[0]
    return coefficients.tolist(), float(np.abs(a @ coefficients - y).max())
