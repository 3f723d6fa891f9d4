"""GPU training speed: `crm-train` itself on long rows, and crm against TRL's RewardTrainer.

Part 1, the command users run (not a probe): for each size, `crm-train` in a process of its own
on synthetic README-format pairs of realistic length (benchmarks/long_pairs.py: answers of 300-700
words, rows of about 1.1k tokens), a 32k BPE trained on them once, `trainer=fsdp` on one GPU,
`compile=true`, the micro batch and activation checkpointing given per size. `StepStats` (below,
added through crm-train's `callbacks` key) synchronises the GPU at each optimizer step after the
warm-up steps and records the step times and the real and padded tokens; at the end it records
torch's peak allocated and reserved memory and torch.compile's graphs, breaks and seconds. Per size
the result holds steady-state MFU (docs/PERFORMANCE.md section 2: 6N + 12 L H d S per real token,
S the mean real row length), real and padded tokens/s, p50/p95 step seconds, the memory peaks
against `crm-plan`'s prediction for the same setting (section 4) and the compile figures.

Part 2, crm against TRL at equal memory: benchmarks/train_vs_trl.py on CUDA (pointwise, as TRL's
RewardTrainer is; same architecture, initial weights, rendered pairs, batch and AdamW; gradient
checkpointing off in both, TRL's default being on; a process per run, runs alternating).

Without CUDA it runs the tiny model for a few steps, eagerly, as a smoke test of this harness (the
test suite runs it); its figures are not GPU figures and the JSON says `"device": "cpu"`.

    python benchmarks/gpu_train.py [--sizes qwen3-0.6b:16:off,qwen3-1.7b:8:off,qwen3-4b:8:on]
                                   [--steps 40] [--warmup 10] [--records 4000] [--skip-trl]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
GPU_SIZES = "qwen3-0.6b:16:off,qwen3-1.7b:8:off,qwen3-4b:8:on"  # size:micro batch:activation ckpt
CPU_SIZES = "tiny:8:off"


class StepStats(L.Callback):
    """Optimizer-step times (synchronised on CUDA), tokens and memory peaks of a run, as JSON in `out`."""

    def __init__(self, out: str, warmup: int = 10):
        self.out, self.warmup = Path(out), warmup
        self.step_seconds: list[float] = []
        self.real = self.padded = self.rows = self.samples = 0
        self.widest = (0, 0)  # (rows, width) of the largest micro batch
        self._last_step, self._mark = -1, None

    def _sync(self) -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step > self.warmup:
            mask = batch["attention_mask"]
            self.real += int(mask.sum())
            self.padded += mask.numel()
            self.rows += mask.shape[0]
            self.samples += len(batch["keys"])
        self.widest = max(self.widest, tuple(batch["input_ids"].shape), key=lambda s: s[0] * s[1])
        if step == self._last_step:  # accumulating: no optimizer step yet
            return
        self._last_step, now = step, self._sync()
        if step > self.warmup and self._mark is not None:
            self.step_seconds.append(now - self._mark)
        self._mark = now

    def on_train_end(self, trainer, pl_module) -> None:
        from crm.models.compile import compile_stats
        from crm.perf.flops import ModelShape, flops_per_token, peak_flops

        seconds = sum(self.step_seconds)
        shape = ModelShape.from_config(pl_module.crm.model.config)
        per_token = flops_per_token(shape, self.real / max(self.rows, 1))
        peak = peak_flops("auto")
        cuda = torch.cuda.is_available()
        gib = 2 ** 30
        result = {
            "timed_steps": len(self.step_seconds),
            "step_seconds_p50": statistics.median(self.step_seconds) if self.step_seconds else None,
            "step_seconds_p95": _quantile(self.step_seconds, 0.95),
            "tokens_per_s": self.real / seconds if seconds else None,
            "padded_tokens_per_s": self.padded / seconds if seconds else None,
            "samples_per_s": self.samples / seconds if seconds else None,
            "real_token_fraction": self.real / self.padded if self.padded else None,
            "mean_row_tokens": self.real / self.rows if self.rows else None,
            "mfu": (self.real / seconds * per_token / peak) if (seconds and peak) else None,
            "widest_micro_batch": list(self.widest),
            "peak_allocated_gib": torch.cuda.max_memory_allocated() / gib if cuda else None,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / gib if cuda else None,
            "compile": compile_stats(),
        }
        self.out.write_text(json.dumps(result))


def _quantile(values: list[float], q: float) -> float | None:
    if len(values) < 2:
        return values[0] if values else None
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def prepare(data_dir: Path, records: int, vocab_size: int, min_words: int, max_words: int) -> Path:
    """Long pairs -> shards -> a BPE of `vocab_size` trained on them once (model.tokenizer of every run)."""
    from long_pairs import write_long_pairs

    from crm.core.prompts import PromptTemplate
    from crm.data.manifest import load_manifest
    from crm.data.reader import training_texts
    from crm.data.shard import shard
    from crm.models.tokenizer import train_bpe_tokenizer

    raw = write_long_pairs(data_dir / "long.jsonl", records, min_words=min_words, max_words=max_words)
    shard([str(raw)], str(data_dir / "shards"), shard_size=1000)
    texts = training_texts(load_manifest(data_dir / "shards").shards("train"), PromptTemplate())
    train_bpe_tokenizer(texts, vocab_size).save_pretrained(data_dir / "tokenizer")
    return data_dir


def crm_train(size: str, micro: int, checkpointing: bool, data_dir: Path, args, cuda: bool) -> dict:
    """One `crm-train` run in a process of its own; StepStats' JSON with the run's settings."""
    out = data_dir / f"stats-{size}.json"
    overrides = [
        "data=shards", f"data.path={data_dir / 'shards'}", "direction=original", f"model={size}",
        f"model.tokenizer={data_dir / 'tokenizer'}", f"global_batch_size={args.global_batch}",
        f"micro_batch_size={micro}", f"stream.max_tokens={args.max_tokens}",
        f"parallel.activation_checkpointing={str(checkpointing).lower()}",
        f"trainer.max_steps={args.steps}", "val_every_n_steps=1000000", "save_every_n_steps=1000000",
        "export=false", "evaluate=false", "logger=none", "trainer.enable_progress_bar=false",
        "perf.log_every_n_steps=5", f"name=bench-{size}",
        f"+callbacks.bench={{_target_: gpu_train.StepStats, out: '{out}', warmup: {args.warmup}}}",
    ]
    if cuda:
        overrides += ["trainer=fsdp", "trainer.devices=1", "compile=true",
                      f"stream.num_workers={args.num_workers}"]
    else:  # the smoke test: the tiny model as the demo trains it, eagerly
        overrides += ["trainer=cpu", "compile=false", "torch_threads=1",
                      f"model.vocab_size={args.vocab_size}"]
    env = {**os.environ, "CRM_ROOT": str(data_dir), "PYTHONPATH": os.pathsep.join(
        filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
    started = time.perf_counter()
    done = subprocess.run([str(BIN / "crm-train"), *overrides], env=env, capture_output=True, text=True)
    if done.returncode:
        return {"size": size, "error": done.stderr[-3000:]}
    stats = json.loads(out.read_text())
    return {"size": size, "micro_batch": micro, "activation_checkpointing": checkpointing,
            "wall_seconds": round(time.perf_counter() - started, 1), **stats,
            "plan": plan(size, micro, checkpointing, stats, args, cuda)}


def plan(size: str, micro: int, checkpointing: bool, stats: dict, args, cuda: bool) -> dict:
    """crm-plan's peak for the run's setting: at the widest micro batch the run met, and at the
    stream's limit (what crm-plan is given before a run), against torch's peak allocated."""
    from omegaconf import OmegaConf

    from crm.perf.flops import ModelShape
    from crm.perf.memory import memory_plan

    # What crm-train builds: a published size keeps its vocabulary, a dict arch takes the tokenizer's.
    arch = OmegaConf.to_container(OmegaConf.load(HERE.parent / "configs" / "model" / f"{size}.yaml"))["arch"]
    shape = ModelShape.from_arch(arch, vocab_size=None if isinstance(arch, str) else args.vocab_size)
    rows, width = stats["widest_micro_batch"]
    common = dict(world=1, micro_batch_size=micro, kind="pairwise", precision="bf16-mixed",
                  activation_checkpointing=checkpointing, compiled=cuda)
    widest = memory_plan(shape, seq_len=width, **{**common, "micro_batch_size": rows})
    limit = memory_plan(shape, seq_len=args.max_tokens, **common)
    measured = stats["peak_allocated_gib"]
    return {"at_widest_batch_gib": widest["total_gib"], "at_max_tokens_gib": limit["total_gib"],
            "error_at_widest": None if not measured else widest["total_gib"] / measured - 1}


def crm_vs_trl(args, cuda: bool) -> dict:
    """benchmarks/train_vs_trl.py at equal memory (gradient checkpointing off in both)."""
    command = [sys.executable, str(HERE / "train_vs_trl.py"), "--rounds", str(args.trl_rounds),
               "--steps", str(args.trl_steps)]
    if cuda:
        command += ["--device", "cuda", "--arch", "qwen3-0.6b", "--long", "--compile", "--batch-size", "8",
                    "--max-tokens", str(args.max_tokens), "--vocab-size", str(args.vocab_size)]
    else:
        command += ["--batch-size", "8", "--n-train", "300", "--max-tokens", "256", "--skip-pairwise"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        return {"error": done.stderr[-3000:]}
    return json.loads(done.stdout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", help=f"size:micro:ckpt,... (default on CUDA {GPU_SIZES}; without, {CPU_SIZES})")
    p.add_argument("--steps", type=int, help="optimizer steps per run (default 40 on CUDA, 6 on CPU)")
    p.add_argument("--warmup", type=int, help="untimed steps (compile, allocator; default 10, CPU 2)")
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--records", type=int, help="long pairs generated (default 4000, CPU 200)")
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--num-workers", type=int, default=4)
    p.add_argument("--trl-rounds", type=int, help="alternating crm/TRL rounds (default 3, CPU 1)")
    p.add_argument("--trl-steps", type=int, help="steps per crm/TRL run (default 30, CPU 8)")
    p.add_argument("--skip-trl", action="store_true")
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    defaults = (dict(sizes=GPU_SIZES, steps=40, warmup=10, records=4000, trl_rounds=3, trl_steps=30)
                if cuda else
                dict(sizes=CPU_SIZES, steps=6, warmup=2, records=200, trl_rounds=1, trl_steps=8,
                     vocab_size=512, max_tokens=384, global_batch=8))
    for key, value in defaults.items():
        if getattr(args, key) is None or (not cuda and key in ("vocab_size", "max_tokens", "global_batch")):
            setattr(args, key, value)
    sys.path.insert(0, str(HERE))
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu",
              "torch": torch.__version__, "settings": {k: v for k, v in vars(args).items()}}
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = prepare(Path(tmp), args.records, args.vocab_size, *((300, 700) if cuda else (20, 60)))
        runs = []
        for spec in args.sizes.split(","):
            size, micro, ckpt = spec.split(":")
            runs.append(crm_train(size, int(micro), ckpt == "on", data_dir, args, cuda))
        result["crm_train"] = runs
    if not args.skip_trl:
        result["crm_vs_trl"] = crm_vs_trl(args, cuda)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
