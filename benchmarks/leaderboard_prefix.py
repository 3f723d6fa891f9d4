"""Leaderboard judging with and without prefix reuse, eager and with compiled decoder layers
(docs/DESIGN.md section 8, docs/PERFORMANCE.md sections 6 and 9).

Prints one JSON document: pairs/s of `crm.evaluation.leaderboard.judge` on the demo benchmark (60 queries x 8
models against the baseline, baseline in slot A) with the plain path and with prefix reuse, the
largest score difference between the two, and the token arithmetic: the prefix share p of the
prompt tokens and the computed fraction (1 - p) + p / N that bounds the speed-up at
1 / ((1 - p) + p / N) for N = 8 candidates per prefix. With `--compile` (default: both) the same
is measured for a scorer whose decoder layers are compiled (`CRMScorer(compile=True)`, as on a GPU;
the prefix path's cached keys and values run eagerly there), with the first call's seconds (the
compile warm-up) and the graphs it built.

Throughput is pairs per second of this process's CPU time (one intra-op thread by default), best of
`--repeats`: on a shared machine wall time measures the neighbours; wall-clock pairs/s are reported
too. The model is the demo's tiny Qwen3 (configs/model/tiny.yaml), randomly initialised: the cost of a
forward does not depend on the weights. The tokenizer is a BPE trained on the demo training data,
as crm-train trains it for the tiny model. Two criteria settings: one criterion line (the demo's
wordings) and six (a user who writes more, so a larger share of each prompt is shared).

    python benchmarks/leaderboard_prefix.py [--batch-size 32] [--repeats 3] [--threads 1] [--compile both]
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

import crm_configs
from crm.evaluation.leaderboard import judge, select
from crm.models import compile as compiling
from crm.models.factory import LossConfig, ModelConfig, build_crm
from crm.models.tokenizer import train_bpe_tokenizer
from crm.core.prompts import PromptTemplate
from crm.core.records import read_lines
from crm.inference.scorer import CRMScorer
from crm.data.demo import BENCH_BASELINE, TRAIN_WORDINGS, write_demo

CRITERIA = {
    "1 line": [TRAIN_WORDINGS["detailed"][1]],
    "6 lines": [TRAIN_WORDINGS[pole][0] for pole in
                ("detailed", "bullets", "formal", "examples", "plain", "cautious")],
}


def training_texts(path: str):
    yield PromptTemplate().pairwise
    for line in read_lines(path, "train"):
        if line.record:
            r = line.record
            yield "\n".join(r.a_criteria + r.b_criteria + tuple(m.content for m in r.model_a + r.model_b))


def timed(scorer: CRMScorer, selection, criteria, repeats: int) -> tuple[dict, list[float]]:
    start = time.perf_counter()
    judge(scorer, selection, criteria)  # warm-up (allocator, kernels, compiled graphs)
    warmup = time.perf_counter() - start
    cpu, wall = [], []
    for _ in range(repeats):
        scorer.counts.clear()
        start_cpu, start_wall = time.process_time(), time.perf_counter()
        outcomes = judge(scorer, selection, criteria)
        cpu.append(time.process_time() - start_cpu)
        wall.append(time.perf_counter() - start_wall)
    pairs = len(outcomes)
    return ({"pairs": pairs, "pairs_per_s": round(pairs / min(cpu), 1),
             "pairs_per_wall_s": round(pairs / min(wall), 1), "warmup_wall_seconds": round(warmup, 2),
             "cpu_seconds": [round(s, 3) for s in cpu], "wall_seconds": [round(s, 3) for s in wall],
             "prompt_tokens": scorer.counts["prompt_tokens"],
             "computed_tokens": scorer.counts["computed_tokens"],
             "padded_tokens": scorer.counts["padded_tokens"],
             "prefix_sequences": scorer.counts["prefix_sequences"],
             "split_mismatch": scorer.counts["split_mismatch"]},
            [o.p_win for o in outcomes])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the machine is shared)")
    p.add_argument("--n-bench", type=int, default=60)
    p.add_argument("--hidden-size", type=int, default=None,
                   help="widen the tiny model (intermediate 3x, heads of 32) to see a larger model")
    p.add_argument("--compile", choices=["both", "off", "on"], default="both",
                   help="eager layers, compiled layers (inductor), or both")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        write_demo(tmp, seed=0, n_train=2000, n_test=2, n_bench=args.n_bench)
        tokenizer = train_bpe_tokenizer(training_texts(f"{tmp}/train.jsonl"), 2048)
        selection = select(f"{tmp}/bench.jsonl", BENCH_BASELINE)
    arch = OmegaConf.to_container(
        OmegaConf.load(Path(crm_configs.__file__).parent / "model" / "tiny.yaml").arch)
    if args.hidden_size:
        heads = args.hidden_size // 32
        arch.update(hidden_size=args.hidden_size, intermediate_size=3 * args.hidden_size,
                    num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=32)
    modes = {"both": (False, True), "off": (False,), "on": (True,)}[args.compile]
    scorers = {}
    for compiled in modes:
        torch.manual_seed(0)  # the same weights in both
        crm = build_crm(ModelConfig(arch=arch, attention="sdpa"), LossConfig("pairwise"), num_labels=2,
                        pad_token_id=tokenizer.pad_token_id, vocab_size=len(tokenizer), compiled=compiled)
        scorers["compiled" if compiled else "eager"] = CRMScorer(
            crm.model, tokenizer, PromptTemplate(), "pairwise", max_tokens=1024,
            batch_size=args.batch_size, device=torch.device("cpu"), compile=compiled)
    n = len(selection.models)
    settings = {}
    for name, criteria in CRITERIA.items():
        settings[name] = {"criteria": criteria}
        probabilities = {}
        for mode, scorer in scorers.items():
            before = compiling.compile_stats()
            scorer.prefix_reuse = False
            plain, p_plain = timed(scorer, selection, criteria, args.repeats)
            scorer.prefix_reuse = True
            reused, p_reused = timed(scorer, selection, criteria, args.repeats)
            after = compiling.compile_stats()
            probabilities[mode] = p_plain
            settings[name][mode] = {
                "plain": plain,
                "prefix_reuse": reused,
                "speedup": round(reused["pairs_per_s"] / plain["pairs_per_s"], 2),
                "max_abs_diff_p_win": max(abs(a - b) for a, b in zip(p_plain, p_reused)),
                "graphs_built": after["graphs"] - before["graphs"],
                "compile_seconds": round(after["seconds"] - before["seconds"], 1),
            }
        if len(scorers) == 2:
            eager, compiled = settings[name]["eager"], settings[name]["compiled"]
            settings[name]["compiled_vs_eager"] = {
                path: round(compiled[path]["pairs_per_s"] / eager[path]["pairs_per_s"], 2)
                for path in ("plain", "prefix_reuse")}
            settings[name]["compiled_vs_eager"]["max_abs_diff_p_win"] = max(
                abs(a - b) for a, b in zip(probabilities["eager"], probabilities["compiled"]))
        first = settings[name][next(iter(scorers))]  # the token counts do not depend on the mode
        plain, reused = first["plain"], first["prefix_reuse"]
        prompt = plain["prompt_tokens"]
        # computed = sum of prefixes once + all suffixes = prompt - (N - 1) * sum of prefixes
        prefix_tokens = (prompt - reused["computed_tokens"]) / (n - 1)
        share = n * prefix_tokens / prompt
        settings[name]["tokens"] = {
            "mean_prompt_tokens": round(prompt / plain["pairs"], 1),
            "mean_prefix_tokens": round(prefix_tokens / len(selection.records), 1),
            "prefix_share_p": round(share, 4),
            "expected_computed_fraction": round((1 - share) + share / n, 4),
            "measured_computed_fraction": round(reused["computed_tokens"] / prompt, 4),
            "token_bound_speedup": round(1 / ((1 - share) + share / n), 2),
        }
    print(json.dumps({
        "benchmark": "leaderboard judging, plain vs prefix reuse, eager vs compiled layers",
        "model": "tiny Qwen3 (configs/model/tiny.yaml arch), random init; BPE 2048 on demo data",
        "arch": {k: arch[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                      "num_key_value_heads", "intermediate_size")},
        "device": "cpu", "dtype": "float32", "threads": args.threads,
        "throughput": "pairs per CPU second of this process (best of repeats); wall also given",
        "batch_size": args.batch_size, "repeats": args.repeats,
        "bench": {"queries": len(selection.records), "models": n,
                  "pairs": len(selection.records) * n},
        "compile": {"graphs": compiling.compile_stats()["graphs"],
                    "graph_breaks": compiling.compile_stats()["graph_breaks"],
                    "seconds": compiling.compile_stats()["seconds"]},
        "settings": settings,
    }, indent=1))


if __name__ == "__main__":
    main()
