"""Pointwise CRM training throughput: crm (Lightning) vs TRL's RewardTrainer, same work, on CPU.

Same tiny Qwen3 architecture (configs/model/tiny.yaml) and initial weights, the same demo pairs
rendered to the same token ids (criteria + query + response, chosen and rejected), the same batch
size, AdamW at the same lr. TRL gets the pairs pre-tokenized; crm streams and tokenizes them
inside the timed loop, in-process (`--num-workers 1` moves tokenizing to a DataLoader worker:
slower on 2 cores, where the worker takes a core from the two torch threads).

Each run is its own process, as a user runs a trainer: runs that share a process inherit the
previous runs' heap and library state (when this script ran them all in one process, TRL's first
run made 80 samples/s and its later ones 100, crm's first 204 and its later ones 184 and 191).
Runs alternate (crm, TRL, crm, TRL, ...) so machine noise hits both alike; each run's first steps
(warm-up) are not timed.
Prints one JSON document: samples/s of each (median over rounds), their ratio, real-token fraction
of each, and crm's pairwise samples/s on the same data.

    python benchmarks/train_vs_trl.py [--steps 60] [--rounds 3] [--batch-size 32]
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import lightning as L
import torch
from omegaconf import OmegaConf
from transformers import AutoTokenizer

from crm.core.examples import LABEL_A
from crm.core.prompts import PromptEncoder, PromptTemplate
from crm.core.records import parse_train
from crm.data.demo import write_demo
from crm.data.manifest import load_manifest
from crm.data.reader import iter_shard
from crm.data.shard import shard
from crm.data.stream import StreamConfig
from crm.data.transforms import TransformConfig, record_rng, train_example
from crm.models.factory import LossConfig, ModelConfig, build_crm
from crm.models.tokenizer import train_bpe_tokenizer
from crm.training.datamodule import CRMDataModule
from crm.training.module import CRMModule, OptimConfig

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
WARMUP_STEPS = 5
LR = 1e-3


class StepTimer(L.Callback):
    """Seconds and samples from the end of warm-up to the last step."""

    def __init__(self):
        self.start, self.samples, self.real, self.computed = None, 0, 0, 0

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == WARMUP_STEPS and self.start is None:
            self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if self.start is not None:
            self.samples += len(batch["keys"])
            self.real += int(batch["attention_mask"].sum())
            self.computed += batch["input_ids"].numel()
            self.end = time.perf_counter()


def crm_run(kind: str, manifest_dir: str, tokenizer, arch: dict, args) -> dict:
    torch.manual_seed(0)
    transform = TransformConfig(direction="original", noise="none", swap_prob=0.0)
    stream = StreamConfig(batch_size=args.batch_size, mode=kind, max_tokens=args.max_tokens,
                          num_workers=args.num_workers)
    data = CRMDataModule(manifest_dir, tokenizer, stream, transform)
    make = lambda: build_crm(ModelConfig(arch=arch, attention="sdpa"), LossConfig(kind),  # noqa: E731
                             num_labels=2, pad_token_id=tokenizer.pad_token_id)
    module = CRMModule(make, OptimConfig(lr=LR, warmup_steps=0, weight_decay=0.0))
    timer = StepTimer()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=args.steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, callbacks=[timer])
    trainer.fit(module, datamodule=data)
    seconds = timer.end - timer.start
    return {"samples_per_s": timer.samples / seconds, "real_token_fraction": timer.real / timer.computed}


def trl_pairs(manifest, tokenizer, args) -> list[dict]:
    """The pairs crm trains on, as TRL's pre-tokenized chosen_ids / rejected_ids."""
    transform = TransformConfig(direction="original", noise="none", swap_prob=0.0)
    encoder = PromptEncoder(tokenizer, PromptTemplate(), args.max_tokens)
    rows = []
    for shard_info in manifest.shards("train"):
        for key, obj in iter_shard(shard_info.url):
            record = parse_train(obj)
            if record.human_winner == "tie":
                continue
            ex = train_example(record, key, transform, record_rng(0, 0, key))
            win, lose = (ex.conv_a, ex.conv_b) if ex.label == LABEL_A else (ex.conv_b, ex.conv_a)
            c, r = encoder.pointwise_many([(ex.criteria, ex.query, win), (ex.criteria, ex.query, lose)])
            if c is not None and r is not None:
                rows.append({"chosen_ids": c, "rejected_ids": r})
    return rows


def trl_run(rows: list[dict], tokenizer, arch: dict, out_dir: str, args) -> dict:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import RewardConfig, RewardTrainer

    class Timer(TrainerCallback):
        start = end = None
        samples = real = computed = 0

        def on_step_begin(self, targs, state, control, **kw):
            if state.global_step == WARMUP_STEPS and self.start is None:
                self.start = time.perf_counter()

        def on_step_end(self, targs, state, control, **kw):
            if self.start is not None:
                self.end = time.perf_counter()

    torch.manual_seed(0)
    model = build_crm(ModelConfig(arch=arch, attention="sdpa"), LossConfig("pointwise"), num_labels=1,
                      pad_token_id=tokenizer.pad_token_id).model
    config = RewardConfig(output_dir=out_dir, per_device_train_batch_size=args.batch_size,
                          max_steps=args.steps, learning_rate=LR, lr_scheduler_type="constant",
                          weight_decay=0.0, use_cpu=True, report_to="none", save_strategy="no",
                          logging_steps=10_000, disable_tqdm=True, dataloader_num_workers=0,
                          max_length=None, seed=0)
    timer = Timer()
    trainer = RewardTrainer(model=model, args=config, train_dataset=Dataset.from_list(rows),
                            processing_class=tokenizer, callbacks=[timer])
    # Real tokens of the batches TRL forms (the same sampler, replayed): padded to the longest.
    real = computed = 0
    for i, batch in enumerate(trainer.get_train_dataloader()):
        if i >= args.steps:
            break
        real += int(batch["attention_mask"].sum())
        computed += batch["input_ids"].numel()
    trainer.train()
    timed_steps = args.steps - WARMUP_STEPS
    return {"samples_per_s": timed_steps * args.batch_size / (timer.end - timer.start),
            "real_token_fraction": real / computed}


def tiny_config() -> dict:
    return OmegaConf.to_container(OmegaConf.load(CONFIGS / "model" / "tiny.yaml"))


def prepare(data_dir: str, args) -> None:
    """Demo shards and the tiny model's tokenizer, shared by every run."""
    tiny = tiny_config()
    write_demo(f"{data_dir}/raw", seed=0, n_train=args.n_train, n_test=10, n_bench=4)
    shard([f"{data_dir}/raw/train.jsonl"], f"{data_dir}/shards", shard_size=1000)
    manifest = load_manifest(f"{data_dir}/shards")
    texts = (" ".join(r.a_criteria + r.b_criteria + tuple(m.content for m in r.model_a + r.model_b))
             for r in (parse_train(o) for s in manifest.shards("train") for _, o in iter_shard(s.url)))
    train_bpe_tokenizer(texts, tiny["vocab_size"]).save_pretrained(f"{data_dir}/tokenizer")


def run_one(trainer: str, data_dir: str, args) -> dict:
    """One timed run in this process: crm_pointwise, crm_pairwise or trl."""
    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    tokenizer = AutoTokenizer.from_pretrained(f"{data_dir}/tokenizer", local_files_only=True)
    arch = {**tiny_config()["arch"], "vocab_size": len(tokenizer)}
    if trainer == "trl":
        rows = trl_pairs(load_manifest(f"{data_dir}/shards"), tokenizer, args)
        with tempfile.TemporaryDirectory() as out_dir:
            result = trl_run(rows, tokenizer, arch, out_dir, args)
        return {**result, "pairs_available": len(rows), "arch": arch}
    return crm_run(trainer.removeprefix("crm_"), f"{data_dir}/shards", tokenizer, arch, args)


def in_subprocess(trainer: str, data_dir: str, args) -> dict:
    command = [sys.executable, __file__, "--run", trainer, "--data", data_dir,
               "--steps", str(args.steps), "--batch-size", str(args.batch_size),
               "--max-tokens", str(args.max_tokens), "--num-workers", str(args.num_workers)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{trainer} run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60, help="steps per run (the first 5 untimed)")
    p.add_argument("--rounds", type=int, default=3, help="alternating runs of each trainer")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--n-train", type=int, default=3000)
    p.add_argument("--num-workers", type=int, default=0,
                   help="crm's DataLoader workers (0: tokenize in-process)")
    p.add_argument("--run", choices=["crm_pointwise", "crm_pairwise", "trl"], help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.run:  # one run, in a process of its own (see the module docstring)
        print(json.dumps(run_one(args.run, args.data, args)))
        return

    with tempfile.TemporaryDirectory() as tmp:
        prepare(tmp, args)
        ours, theirs = [], []
        for _ in range(args.rounds):
            ours.append(in_subprocess("crm_pointwise", tmp, args))
            theirs.append(in_subprocess("trl", tmp, args))
        pairwise = in_subprocess("crm_pairwise", tmp, args)

    median = lambda runs, k: round(statistics.median(r[k] for r in runs), 2)  # noqa: E731
    result = {
        "setup": {"arch": theirs[0]["arch"], "batch_size": args.batch_size,
                  "steps_per_run": args.steps, "timed_steps": args.steps - WARMUP_STEPS,
                  "rounds": args.rounds, "pairs_available": theirs[0]["pairs_available"],
                  "torch_threads": torch.get_num_threads(), "crm_num_workers": args.num_workers,
                  "process_per_run": True},
        "crm_pointwise": {"samples_per_s": median(ours, "samples_per_s"),
                          "real_token_fraction": median(ours, "real_token_fraction"),
                          "runs": [round(r["samples_per_s"], 2) for r in ours]},
        "trl_reward_trainer": {"samples_per_s": median(theirs, "samples_per_s"),
                               "real_token_fraction": median(theirs, "real_token_fraction"),
                               "runs": [round(r["samples_per_s"], 2) for r in theirs]},
        "crm_pairwise": {"samples_per_s": round(pairwise["samples_per_s"], 2),
                         "real_token_fraction": round(pairwise["real_token_fraction"], 4)},
    }
    result["ratio_crm_over_trl"] = round(result["crm_pointwise"]["samples_per_s"]
                                         / result["trl_reward_trainer"]["samples_per_s"], 2)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
