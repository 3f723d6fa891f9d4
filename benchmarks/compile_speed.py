"""Eager against compiled decoder layers for one model on this machine: compile seconds, seconds per
train step, and what they make of a run of N steps (the `compile: auto` decision, PERFORMANCE.md
section 9).

The model is a config of configs/model/ (default tiny, the demo's), the batches the demo data's
(crm's stream: the demo's micro batch, rows and padding), the step the LightningModule's loss,
backward and AdamW, in float32 on CPU. Both models start from the same weights and take the same
batches; timed blocks alternate (eager, compiled, eager, ...) so that the machine's other load hits
both alike, and each block's steps are timed one by one (medians printed). The first compiled
steps, which compile (the training graph, then a batch of another shape), are timed apart.

    python benchmarks/compile_speed.py [--model tiny] [--steps 20] [--blocks 4] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from crm.core.prompts import PromptTemplate
from crm.data.demo import write_demo
from crm.data.manifest import load_manifest
from crm.data.reader import training_texts
from crm.data.shard import shard
from crm.data.config import StreamConfig
from crm.data.transforms import TransformConfig
from crm.models.compile import compile_layers, compile_stats
from crm.models.factory import LossConfig, ModelConfig, build_crm
from crm.models.tokenizer import train_bpe_tokenizer
from crm.training.datamodule import CRMDataModule

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def batches(tmp: str, micro_batch: int, count: int, vocab_size: int):
    """`count` demo batches as crm-train streams them (pairwise, original direction)."""
    write_demo(f"{tmp}/raw", seed=0, n_train=max(400, 2 * micro_batch * count), n_test=10, n_bench=4)
    shard([f"{tmp}/raw/train.jsonl"], f"{tmp}/shards", shard_size=1000)
    texts = training_texts(load_manifest(f"{tmp}/shards").shards("train"), PromptTemplate())
    tokenizer = train_bpe_tokenizer(texts, vocab_size)  # as crm-train trains the tiny model's
    data = CRMDataModule(load_manifest(f"{tmp}/shards"), tokenizer,
                         StreamConfig(batch_size=micro_batch, mode="pairwise", max_tokens=512,
                                      packing=False),
                         TransformConfig(direction="original"))
    out = []
    for batch in data.train_dataloader():
        out.append({k: batch[k] for k in ("input_ids", "attention_mask", "labels")})
        if len(out) == count:
            return out, tokenizer
    return out, tokenizer


def step_seconds(crm, optimizer, batch) -> float:
    start = time.perf_counter()
    crm.loss(batch)["loss"].backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="a config of configs/model/ with a dict arch")
    p.add_argument("--micro-batch", type=int, default=64, help="the demo's (global batch 64, one rank)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per block")
    p.add_argument("--blocks", type=int, default=4, help="alternating blocks per model")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--run-steps", type=int, default=1250, help="the run to project (the demo's 1250)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = OmegaConf.to_container(OmegaConf.load(CONFIGS / "model" / f"{args.model}.yaml"))
    with tempfile.TemporaryDirectory() as tmp:
        data, tokenizer = batches(tmp, args.micro_batch, args.steps, model["vocab_size"])
    arch = {**model["arch"], "vocab_size": len(tokenizer)}
    crms, optimizers = {}, {}
    for name in ("eager", "compiled"):
        torch.manual_seed(0)
        crms[name] = build_crm(ModelConfig(arch=arch, attention="sdpa"), LossConfig("pairwise"),
                               num_labels=2, pad_token_id=tokenizer.pad_token_id).train()
        if name == "compiled":
            compile_layers(crms[name].model)
        optimizers[name] = torch.optim.AdamW(crms[name].parameters(), lr=1e-4)
    warm = {name: [step_seconds(crms[name], optimizers[name], b) for b in data[:2]] for name in crms}
    compiled_stats = compile_stats()
    times = {name: [] for name in crms}
    for _ in range(args.blocks):
        for name in crms:
            times[name] += [step_seconds(crms[name], optimizers[name], b) for b in data]
    median = {name: statistics.median(t) for name, t in times.items()}
    compile_seconds = sum(warm["compiled"]) - sum(warm["eager"])
    run = {name: args.run_steps * median[name] + (compile_seconds if name == "compiled" else 0)
           for name in crms}
    print(json.dumps({
        "model": args.model, "device": "cpu", "threads": args.threads, "micro_batch": args.micro_batch,
        "mean_tokens_per_batch": round(statistics.mean(int(b["attention_mask"].sum()) for b in data)),
        "timed_steps_per_model": len(times["eager"]),
        "step_seconds_median": {k: round(v, 4) for k, v in median.items()},
        "step_seconds_p10_p90": {k: [round(q, 4) for q in statistics.quantiles(t, n=10)[::8]]
                                 for k, t in times.items()},
        "speedup_per_step": round(median["eager"] / median["compiled"], 3),
        "first_two_steps_seconds": {k: [round(x, 2) for x in v] for k, v in warm.items()},
        "compile_seconds_by_torch": compiled_stats["seconds"], "graphs": compiled_stats["graphs"],
        f"projected_seconds_for_{args.run_steps}_steps": {k: round(v) for k, v in run.items()},
    }, indent=1))


if __name__ == "__main__":
    main()
