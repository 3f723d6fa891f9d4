"""A CRM on a best-of-4 benchmark: 1,000 prompts x 4 completions in RewardBench 2's layout, scored
as `crm-eval benchmark=rewardbench2` scores them (crm.evaluation.benchmarks: a pairwise CRM's
round robin in both orders, 12 forwards a prompt, with prefix reuse and length-sorted batches
across prompts; docs/EVALUATION.md section 4).

Prints one JSON document: prompts, completions, forwards (and per prompt), wall and CPU seconds of
load_benchmark + run_benchmark (reading the Parquet file, scoring, scores.jsonl, the figures),
sequences per second, the scorer's token and prefix counters. `--no-prefix-reuse` also times the
plain path for comparison.

The CRM: `--checkpoint DIR` (an export, e.g. outputs/demo/export after `crm-train`), else the
demo CRM's architecture (configs/model/tiny.yaml: Qwen3 2 x 64) with a 2048-token BPE trained on
the demo training data as crm-train trains it, randomly initialised: the cost of a forward does not
depend on the weights. The prompts and completions are the demo benchmark's (bench.jsonl: a query
answered by several models of 1-5 sentences); prompt i is the demo query i with its first four
answers, one chosen, three rejected, the subsets cycling through the five best-of-4 subsets.

    python benchmarks/benchmark_scoring.py [--prompts 1000] [--checkpoint DIR] [--threads N]
"""
from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from omegaconf import OmegaConf

import crm_configs
from crm.cli.schema import benchmark_config
from crm.core.prompts import PromptTemplate
from crm.core.records import read_lines
from crm.data.demo import write_demo
from crm.evaluation.benchmarks import load_benchmark, run_benchmark
from crm.inference.scorer import CRMScorer
from crm.models.factory import LossConfig, ModelConfig, build_crm
from crm.models.tokenizer import train_bpe_tokenizer

SUBSETS = ("Factuality", "Precise IF", "Math", "Safety", "Focus")


def benchmark_rows(bench_file: Path, prompts: int) -> list[dict]:
    rows = []
    for i, line in enumerate(read_lines(bench_file, "bench")):
        if len(rows) == prompts:
            break
        record = line.record
        answers = [r[-1].content for r in record.responses.values()][:4]
        rows.append({"id": str(i), "prompt": record.prompt, "chosen": answers[:1],
                     "rejected": answers[1:], "num_correct": 1, "num_incorrect": 3,
                     "total_completions": 4, "models": list(record.responses)[:4],
                     "subset": SUBSETS[i % len(SUBSETS)]})
    return rows


def demo_scorer(train_file: Path, batch_size: int) -> CRMScorer:
    def texts():
        yield PromptTemplate().pairwise
        for line in read_lines(train_file, "train"):
            r = line.record
            yield "\n".join(r.a_criteria + r.b_criteria + tuple(m.content for m in r.model_a + r.model_b))

    tokenizer = train_bpe_tokenizer(texts(), 2048)
    arch = OmegaConf.to_container(
        OmegaConf.load(Path(crm_configs.__file__).parent / "model" / "tiny.yaml").arch)
    torch.manual_seed(0)
    crm = build_crm(ModelConfig(arch=arch, attention="sdpa"), LossConfig("pairwise"), num_labels=2,
                    pad_token_id=tokenizer.pad_token_id, vocab_size=len(tokenizer))
    return CRMScorer(crm.model, tokenizer, PromptTemplate(), "pairwise", max_tokens=512,
                     batch_size=batch_size, device=torch.device("cpu"))


def timed_run(scorer: CRMScorer, data: Path, out_dir: Path) -> dict:
    scorer.counts.clear()
    wall, cpu = time.perf_counter(), time.process_time()
    benchmark = load_benchmark(benchmark_config("rewardbench2", str(data)))
    result = run_benchmark(scorer, benchmark, out_dir)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
            "forwards": result["forwards"],
            "forwards_per_prompt": result["forwards"] / result["prompts"],
            "sequences_per_s": round(result["forwards"] / wall, 1),
            "scorer_counts": dict(scorer.counts), "score": result["score"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=1000)
    p.add_argument("--checkpoint", help="an export dir (default: the demo architecture, random weights)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--no-prefix-reuse", action="store_true", help="also time the plain path")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        write_demo(tmp / "demo", seed=0, n_train=2000, n_test=2, n_bench=args.prompts)
        rows = benchmark_rows(tmp / "demo" / "bench.jsonl", args.prompts)
        data = tmp / "rb2.parquet"
        pq.write_table(pa.Table.from_pylist(rows), data)
        if args.checkpoint:
            scorer = CRMScorer.load(args.checkpoint, batch_size=args.batch_size,
                                    device=torch.device("cpu"), dtype=torch.float32)
            crm = f"export {args.checkpoint}"
        else:
            scorer = demo_scorer(tmp / "demo" / "train.jsonl", args.batch_size)
            crm = "demo architecture (configs/model/tiny.yaml), demo BPE 2048, random weights"
        runs = {"prefix_reuse": timed_run(scorer, data, tmp / "with")}
        if args.no_prefix_reuse:
            scorer.prefix_reuse = False
            runs["plain"] = timed_run(scorer, data, tmp / "plain")
        lengths = [len(c) for r in rows for c in r["chosen"] + r["rejected"]]
    print(json.dumps({
        "benchmark": "best-of-4 benchmark scoring (RewardBench 2 layout), pairwise round robin",
        "crm": crm, "kind": scorer.kind, "prompts": len(rows), "completions": 4 * len(rows),
        "completion_chars_mean": round(sum(lengths) / len(lengths), 1),
        "batch_size": args.batch_size, "threads": torch.get_num_threads(),
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
        **runs}, indent=1))


if __name__ == "__main__":
    main()
