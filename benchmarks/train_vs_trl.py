"""Pointwise CRM training throughput: crm (Lightning) vs TRL's RewardTrainer, same work.

Same Qwen3 architecture (the tiny one of configs/model/tiny.yaml, or `--arch qwen3-0.6b` ...) and
initial weights, the same pairs (the demo's, or `--long`: benchmarks/long_pairs.py's rows of about
1.1k tokens) rendered to the same token ids (criteria + query + response, chosen and rejected),
the same batch size, AdamW at the same lr. TRL gets the pairs pre-tokenized; crm streams and
tokenizes them inside the timed loop, in-process (`--num-workers 1` moves tokenizing to a
DataLoader worker: slower on 2 cores, where the worker takes a core from the two torch threads).

`--device cuda`: both in bf16 autocast over float32 weights, crm with its compiled decoder layers
(`--compile`), TRL with fused AdamW, gradient checkpointing off in both (TRL's default is on) so
that they run at equal memory, which the JSON shows (torch's peak allocated of each run); the
timed window starts and ends on a synchronised GPU.

Each run is its own process, as a user runs a trainer: runs that share a process inherit the
previous runs' heap and library state (when this script ran them all in one process, TRL's first
run made 80 samples/s and its later ones 100, crm's first 204 and its later ones 184 and 191).
Runs alternate (crm, TRL, crm, TRL, ...) so machine noise hits both alike; each run's first steps
(warm-up) are not timed.
Prints one JSON document: samples/s of each (median over rounds), their ratio, real-token fraction
of each, and crm's pairwise samples/s on the same data (`--skip-pairwise` leaves that run out).

    python benchmarks/train_vs_trl.py [--steps 60] [--rounds 3] [--batch-size 32]
    python benchmarks/train_vs_trl.py --device cuda --arch qwen3-0.6b --long --batch-size 8 \
        --max-tokens 2048 --vocab-size 32000 --steps 30
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
from crm.data.config import StreamConfig
from crm.data.transforms import TransformConfig, record_rng, train_example
from crm.models.backbone import ARCHITECTURES
from crm.models.factory import LossConfig, ModelConfig, build_crm
from crm.models.tokenizer import train_bpe_tokenizer
from crm.training.datamodule import CRMDataModule
from crm.training.module import CRMModule, OptimConfig

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
WARMUP_STEPS = 5
RUNS = ("crm_pointwise", "crm_pointwise_packed", "crm_pairwise", "crm_pairwise_packed", "trl")
LR = 1e-3


def now() -> float:
    """perf_counter on a synchronised device: the GPU runs behind the host, a window must not."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def peak_gib() -> float | None:
    return torch.cuda.max_memory_allocated() / 2 ** 30 if torch.cuda.is_available() else None


class StepTimer(L.Callback):
    """Seconds (wall and this process's CPU), samples and tokens from the end of warm-up to the
    last step. A padded batch's real tokens are its mask's; a packed row's are all real, and
    `padded` counts what the padded path computes for the same records."""

    def __init__(self):
        self.start, self.samples, self.real, self.computed, self.padded = None, 0, 0, 0, 0

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == WARMUP_STEPS and self.start is None:
            self.start, self.cpu_start = now(), time.process_time()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if self.start is not None:
            self.samples += len(batch["keys"])
            if "read" in batch:
                self.real += batch["real_tokens"]
                self.computed += batch["real_tokens"]
                self.padded += batch["padded_tokens"]
            else:
                real = int(batch["attention_mask"].sum())
                self.real += real
                self.computed += batch["input_ids"].numel()
                self.padded += batch["input_ids"].numel()

    def on_train_end(self, trainer, module):
        self.end, self.cpu_end = now(), time.process_time()


def crm_run(kind: str, manifest_dir: str, tokenizer, arch: dict, args, packing: bool = False) -> dict:
    torch.manual_seed(0)
    transform = TransformConfig(direction="original", noise="none", swap_prob=0.0)
    stream = StreamConfig(batch_size=args.batch_size, mode=kind, max_tokens=args.max_tokens,
                          num_workers=args.num_workers, packing=packing)
    data = CRMDataModule(load_manifest(manifest_dir), tokenizer, stream, transform)
    make = lambda: build_crm(ModelConfig(arch=arch, attention="sdpa"), LossConfig(kind),  # noqa: E731
                             num_labels=2, pad_token_id=tokenizer.pad_token_id)
    cuda = args.device == "cuda"
    module = CRMModule(make, OptimConfig(lr=LR, warmup_steps=0, weight_decay=0.0),
                       compile=cuda and args.compile)
    timer = StepTimer()
    trainer = L.Trainer(accelerator="gpu" if cuda else "cpu", devices=1, max_steps=args.steps,
                        precision="bf16-mixed" if cuda else "32-true", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, callbacks=[timer])
    trainer.fit(module, datamodule=data)
    seconds = timer.end - timer.start
    return {"samples_per_s": timer.samples / seconds, "real_token_fraction": timer.real / timer.computed,
            "cpu_s_per_1000": 1000 * (timer.cpu_end - timer.cpu_start) / timer.samples,
            "wall_s_per_1000": 1000 * seconds / timer.samples,
            "tokens_per_sample": timer.computed / timer.samples,
            "padded_path_tokens_per_sample": timer.padded / timer.samples,
            "peak_allocated_gib": peak_gib(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "vocab_size": arch["vocab_size"]}


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
                self.start, self.cpu_start = now(), time.process_time()

        def on_step_end(self, targs, state, control, **kw):
            if self.start is not None:
                self.end, self.cpu_end = now(), time.process_time()

    torch.manual_seed(0)
    model = build_crm(ModelConfig(arch=arch, attention="sdpa"), LossConfig("pointwise"), num_labels=1,
                      pad_token_id=tokenizer.pad_token_id).model
    cuda = args.device == "cuda"
    config = RewardConfig(output_dir=out_dir, per_device_train_batch_size=args.batch_size,
                          max_steps=args.steps, learning_rate=LR, lr_scheduler_type="constant",
                          weight_decay=0.0, use_cpu=not cuda, bf16=cuda,
                          optim="adamw_torch_fused" if cuda else "adamw_torch",
                          gradient_checkpointing=False, report_to="none", save_strategy="no",
                          logging_steps=10_000, disable_tqdm=True, dataloader_num_workers=0,
                          max_length=None, seed=0)
    timer = Timer()
    trainer = RewardTrainer(model=model, args=config, train_dataset=Dataset.from_list(rows),
                            processing_class=tokenizer, callbacks=[timer])
    # Real tokens of the batches TRL forms (the same sampler, replayed): padded to the longest.
    real = computed = pairs = 0
    for i, batch in enumerate(trainer.get_train_dataloader()):
        if i >= args.steps:
            break
        real += int(batch["attention_mask"].sum())
        computed += batch["input_ids"].numel()
        pairs += batch["input_ids"].shape[0] // 2  # chosen rows, then rejected rows
    trainer.train()
    samples = (args.steps - WARMUP_STEPS) * args.batch_size
    return {"samples_per_s": samples / (timer.end - timer.start),
            "real_token_fraction": real / computed,
            "cpu_s_per_1000": 1000 * (timer.cpu_end - timer.cpu_start) / samples,
            "wall_s_per_1000": 1000 * (timer.end - timer.start) / samples,
            "tokens_per_sample": computed / pairs, "peak_allocated_gib": peak_gib()}


def tiny_config() -> dict:
    return OmegaConf.to_container(OmegaConf.load(CONFIGS / "model" / "tiny.yaml"))


def prepare(data_dir: str, args) -> None:
    """The pairs' shards and a tokenizer trained on them, shared by every run: the demo's pairs
    and the tiny model's vocabulary, or with --long benchmarks/long_pairs.py's."""
    if args.long:
        from long_pairs import write_long_pairs

        raw = str(write_long_pairs(f"{data_dir}/raw/long.jsonl", args.n_train))
    else:
        write_demo(f"{data_dir}/raw", seed=0, n_train=args.n_train, n_test=10, n_bench=4)
        raw = f"{data_dir}/raw/train.jsonl"
    shard([raw], f"{data_dir}/shards", shard_size=1000)
    manifest = load_manifest(f"{data_dir}/shards")
    texts = (" ".join(r.a_criteria + r.b_criteria + tuple(m.content for m in r.model_a + r.model_b))
             for r in (parse_train(o) for s in manifest.shards("train") for _, o in iter_shard(s.url)))
    vocab_size = args.vocab_size or tiny_config()["vocab_size"]
    train_bpe_tokenizer(texts, vocab_size).save_pretrained(f"{data_dir}/tokenizer")


def architecture(args, vocab_size: int) -> dict:
    """The tiny model's fields, or a published Qwen3 size's, with the tokenizer's vocabulary."""
    fields = tiny_config()["arch"] if args.arch == "tiny" else ARCHITECTURES[args.arch]
    return {**fields, "vocab_size": vocab_size}


def run_one(trainer: str, data_dir: str, args) -> dict:
    """One timed run in this process: one of RUNS."""
    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    tokenizer = AutoTokenizer.from_pretrained(f"{data_dir}/tokenizer", local_files_only=True)
    arch = architecture(args, len(tokenizer))
    if trainer == "trl":
        rows = trl_pairs(load_manifest(f"{data_dir}/shards"), tokenizer, args)
        with tempfile.TemporaryDirectory() as out_dir:
            result = trl_run(rows, tokenizer, arch, out_dir, args)
        return {**result, "pairs_available": len(rows), "arch": arch}
    kind = trainer.removeprefix("crm_").removesuffix("_packed")
    return crm_run(kind, f"{data_dir}/shards", tokenizer, arch, args, packing=trainer.endswith("_packed"))


def in_subprocess(trainer: str, data_dir: str, args) -> dict:
    command = [sys.executable, __file__, "--run", trainer, "--data", data_dir,
               "--steps", str(args.steps), "--batch-size", str(args.batch_size),
               "--max-tokens", str(args.max_tokens), "--num-workers", str(args.num_workers),
               "--device", args.device, "--arch", args.arch,
               *(["--compile"] if args.compile else []), *(["--long"] if args.long else [])]
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
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--arch", default="tiny", help="tiny (configs/model/tiny.yaml) or a published Qwen3 size")
    p.add_argument("--long", action="store_true", help="long rows (benchmarks/long_pairs.py), not the demo's")
    p.add_argument("--vocab-size", type=int, help="the BPE trained on the pairs (default: the tiny model's)")
    p.add_argument("--compile", action="store_true", help="crm's compiled decoder layers (CUDA)")
    p.add_argument("--skip-pairwise", action="store_true", help="no crm_pairwise runs (the CPU smoke test)")
    p.add_argument("--skip-trl", action="store_true", help="no TRL run (a machine without trl)")
    p.add_argument("--runs", help=f"only these runs, comma-separated (of {', '.join(RUNS)})")
    p.add_argument("--out", help="also write the JSON here (benchmarks/results/)")
    p.add_argument("--run", choices=RUNS, help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.run:  # one run, in a process of its own (see the module docstring)
        print(json.dumps(run_one(args.run, args.data, args)))
        return

    runs = ["crm_pointwise", "crm_pointwise_packed", *([] if args.skip_trl else ["trl"]),
            *([] if args.skip_pairwise else ["crm_pairwise", "crm_pairwise_packed"])]
    if args.runs:
        unknown = set(args.runs.split(",")) - set(RUNS)
        if unknown:
            p.error(f"--runs: {', '.join(sorted(unknown))} not among {', '.join(RUNS)}")
        runs = args.runs.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        prepare(tmp, args)
        results = {name: [] for name in runs}
        for _ in range(args.rounds):  # alternating, so that machine noise hits every run alike
            for name in runs:
                try:
                    results[name].append(in_subprocess(name, tmp, args))
                except RuntimeError as err:  # the others' figures still count; this one says why
                    results[name].append({"error": str(err)[-1500:]})
                if args.out:  # what is done so far survives a run cut short
                    Path(args.out).write_text(json.dumps({"partial": results}, indent=1) + "\n")

    def summary(runs: list[dict]) -> dict:
        done = [r for r in runs if "error" not in r]
        if not done:
            return {"errors": [r["error"] for r in runs]}
        out = {key: round(statistics.median(r[key] for r in done), 4)
               for key in ("samples_per_s", "cpu_s_per_1000", "wall_s_per_1000", "real_token_fraction",
                           "tokens_per_sample", "padded_path_tokens_per_sample") if key in done[0]}
        peaks = [r["peak_allocated_gib"] for r in done if r["peak_allocated_gib"] is not None]
        peak = round(max(peaks), 2) if peaks else None
        return {**out, "runs_samples_per_s": [round(r["samples_per_s"], 2) for r in done],
                "peak_allocated_gib": peak}

    first = next((r for done in results.values() for r in done if "error" not in r), {})
    result = {
        "setup": {"arch": args.arch, "vocab_size": first.get("vocab_size"),
                  "batch_size": args.batch_size, "steps_per_run": args.steps,
                  "timed_steps": args.steps - WARMUP_STEPS, "rounds": args.rounds,
                  "torch_threads": torch.get_num_threads(), "crm_num_workers": args.num_workers,
                  "process_per_run": True, "device": args.device, "long_rows": args.long,
                  "crm_compiled": args.device == "cuda" and args.compile,
                  "gradient_checkpointing": False, "gpu": first.get("gpu")},
        **{name: summary(done) for name, done in results.items()},
    }
    for kind in ("pointwise", "pairwise"):
        padded, packed = result.get(f"crm_{kind}"), result.get(f"crm_{kind}_packed")
        if padded and packed and "errors" not in padded and "errors" not in packed:
            for clock in ("cpu", "wall"):
                result[f"{kind}_packed_speedup_{clock}_s"] = round(
                    padded[f"{clock}_s_per_1000"] / packed[f"{clock}_s_per_1000"], 3)
            result[f"{kind}_tokens_computed_packed_over_padded"] = round(
                packed["tokens_per_sample"] / padded["tokens_per_sample"], 4)
    if "trl" in result and "errors" not in result["trl"]:
        for name in ("crm_pointwise", "crm_pointwise_packed"):
            if name not in result or "errors" in result[name]:
                continue
            result[f"ratio_{name}_over_trl"] = round(result[name]["samples_per_s"]
                                                     / result["trl"]["samples_per_s"], 2)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
