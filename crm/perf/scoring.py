"""The cost of scoring rows with a CRM (`crm-plan task=score`): forward passes, tokens computed,
FLOPs, GPU-hours at a stated MFU, and the GPUs that finish in a target time. Arithmetic only.

A row is one judgement: a leaderboard's (query, model) pair under one criteria set (twice with
both orders), a test pair in one order, a benchmark's completion pair. With prefix reuse
(docs/DESIGN.md section 8.2) the rows of a group (a query's candidates: criteria + query + the
baseline's answer) compute their shared prefix once: a row computes `tokens_per_row x (1 -
prefix_share)` tokens of its own, and each group `tokens_per_row x prefix_share` once. A forward
costs 2 N + 4 L H d S FLOPs per token (crm.perf.flops.flops_per_token, training=False), S the row's
length; padding is not counted (length-sorted batches keep it small).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from crm.perf.flops import ModelShape, flops_per_token


@dataclass(frozen=True)
class ScoreSettings:
    """configs/plan.yaml's `score` section."""

    rows: int = 100_000
    tokens_per_row: int = 3200
    prefix_share: float = 0.0
    rows_per_prefix: int = 1
    both_orders: bool = False
    gpus: int = 8
    target_seconds: float = 60.0

    def __post_init__(self):
        if self.rows < 1 or self.tokens_per_row < 1 or self.rows_per_prefix < 1 or self.gpus < 1:
            raise ValueError("score.rows, score.tokens_per_row, score.rows_per_prefix and score.gpus: "
                             "whole numbers >= 1")
        if not 0 <= self.prefix_share < 1:
            raise ValueError(f"score.prefix_share={self.prefix_share}: expected 0 <= share < 1")
        if self.target_seconds <= 0:
            raise ValueError(f"score.target_seconds={self.target_seconds}: expected > 0")


def score_plan(shape: ModelShape, score: ScoreSettings, *, peak: float, mfu: float) -> dict:
    """Forwards, tokens, FLOPs and time of scoring `score.rows` rows on `score.gpus` GPUs of `peak`
    FLOP/s at `mfu`, and the GPUs that finish within `score.target_seconds`."""
    forwards = score.rows * (2 if score.both_orders else 1)
    groups = math.ceil(forwards / score.rows_per_prefix)
    prompt_tokens = forwards * score.tokens_per_row
    computed = (forwards * score.tokens_per_row * (1 - score.prefix_share)
                + groups * score.tokens_per_row * score.prefix_share)
    per_token = flops_per_token(shape, score.tokens_per_row, training=False)
    flops = computed * per_token
    gpu_seconds = flops / (peak * mfu)
    return {"rows": score.rows, "both_orders": score.both_orders, "forwards": forwards,
            "tokens_per_row": score.tokens_per_row, "prefix_share": score.prefix_share,
            "rows_per_prefix": score.rows_per_prefix, "prompt_tokens": prompt_tokens,
            "computed_tokens": computed, "forward_flops_per_token": per_token, "flops": flops,
            "peak_flops_per_gpu": peak, "mfu": mfu, "gpu_hours": gpu_seconds / 3600,
            "gpus": score.gpus, "seconds": gpu_seconds / score.gpus,
            "target_seconds": score.target_seconds,
            "gpus_for_target": math.ceil(gpu_seconds / score.target_seconds)}


def describe_score(p: dict, model: str) -> str:
    return "\n".join([
        f"crm-plan task=score: {model}, {p['rows']:,} rows{' x 2 orders' if p['both_orders'] else ''}"
        f" = {p['forwards']:,} forwards of {p['tokens_per_row']:,} tokens "
        f"(prefix share {p['prefix_share']:.2f} over {p['rows_per_prefix']} rows)",
        f"  tokens: {p['prompt_tokens']:.3g} in the prompts, {p['computed_tokens']:.3g} computed; "
        f"{p['forward_flops_per_token']:.3g} FLOPs per token, {p['flops']:.3g} FLOPs",
        f"  at MFU {p['mfu']:.2f} of {p['peak_flops_per_gpu'] / 1e12:.0f} TFLOP/s: "
        f"{p['gpu_hours']:.2f} GPU-hours; {p['seconds']:,.0f} s on {p['gpus']} GPUs; "
        f"{p['gpus_for_target']:,} GPUs for {p['target_seconds']:g} s"])
