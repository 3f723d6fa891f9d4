"""The bytes per token one HF Qwen3 decoder layer keeps for backward, measured and fitted: the
source of crm.perf.memory's LAYER_BYTES.

For each computing mode (bf16 parameters; float32 ones under bf16 autocast; float32) and eager or
compiled layers, counts what autograd saves (crm.perf.inventory) over layer shapes that vary h, q,
k, i, heads and kv heads one at a time, fits the linear form in (h, q, k, i, H, KV, 1) and prints
its coefficients, the largest residual (0: the form is exact), the per-layer constant per matmul
weight (2 under autocast: its bf16 copies) and the check against LAYER_BYTES. Counts do not
depend on the device; compiling on CPU takes minutes per shape.

    python benchmarks/activation_inventory.py [--modes bf16,autocast,fp32] [--compiled]
"""
from __future__ import annotations

import argparse
import json

from crm.perf.inventory import fit_forms, layer_bytes_per_token, sizes
from crm.perf.memory import LAYER_BYTES

BASE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=96, vocab_size=128)
# Each varies one size of BASE (the last two vary several), so that the fit is determined.
SHAPES = [BASE, {**BASE, "hidden_size": 96}, {**BASE, "num_attention_heads": 8},
          {**BASE, "num_key_value_heads": 4}, {**BASE, "intermediate_size": 160},
          {**BASE, "head_dim": 32}, {**BASE, "hidden_size": 128, "num_attention_heads": 8,
                                      "num_key_value_heads": 4, "head_dim": 32,
                                      "intermediate_size": 256}]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--modes", default="bf16,autocast,fp32")
    p.add_argument("--compiled", action="store_true", help="compiled layers (crm.models.compile)")
    args = p.parse_args()
    results = []
    for mode in args.modes.split(","):
        measured = [layer_bytes_per_token(shape, mode, args.compiled) for shape in SHAPES]
        coefficients, residual = fit_forms(SHAPES, [m[0] for m in measured])
        table = LAYER_BYTES.get((mode, args.compiled))
        predicted = [None if table is None else sum(c * n for c, n in zip(table, sizes(s)))
                     for s in SHAPES]
        results.append({
            "mode": mode, "compiled": args.compiled,
            "coefficients_h_q_k_i_H_KV_1": [round(c, 3) for c in coefficients],
            "largest_residual_bytes": round(residual, 3),
            "per_token_measured": [m[0] for m in measured],
            "per_token_layer_bytes": predicted,
            "per_layer_bytes_per_matmul_weight": sorted({round(m[1] / _matmul_weights(s), 3)
                                                         for m, s in zip(measured, SHAPES)}),
        })
        print(json.dumps(results[-1]), flush=True)


def _matmul_weights(fields: dict) -> int:
    h, q, k, i, *_ = sizes(fields)
    return h * (q + 2 * k) + q * h + 3 * h * i


if __name__ == "__main__":
    main()
