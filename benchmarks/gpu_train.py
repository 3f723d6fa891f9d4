"""crm on one GPU as users run it, in one script for a GPU turn (docs/PERFORMANCE.md section 8):
`crm-train`'s packed, compiled path, with and without static shapes and CUDA graphs, the 4B, a
long FlexAttention row, scoring (crm-eval's and crm-leaderboard's paths, engine=local and
engine=ray) and crm against TRL, in that order.

Tasks, run in the order given (`--tasks`, comma-separated; the default is the order of issue 59's
priorities) within `--budget` seconds: a task whose estimate no longer fits is skipped and the
JSON says so. The JSON (`--out`, and printed at the end) names the device and is rewritten after
every task, so a call cut short keeps what it finished; each run's checkpoints are deleted as it
ends (they filled the 64 GiB disk of the first GPU turn).
- `train=SIZE:MICRO:CKPT:MODE[:VARIANT]` (CKPT on|off, MODE pairwise|pointwise): `crm-train` in a
  process of its own on synthetic README-format pairs of realistic length (benchmarks/long_pairs.py:
  answers of 300-700 words, pairwise rows of about 1.1k tokens), a 32k BPE trained on them once,
  `trainer=fsdp` on one GPU, `compile=true`, `stream.packing=auto` (packed on a GPU), bf16 compute.
  VARIANT: `today` (the default: the settings as they are), `static` (`stream.token_budget`: every
  packed row filled to one length, the widest micro batch an earlier run of the same size and mode
  met rounded up to 128 tokens, else micro x max_tokens (x2 pointwise): one shape for every step),
  `graphs` (static, and inductor's CUDA graphs, what torch.compile's mode "reduce-overhead" turns
  on: `InductorMode` below). `StepStats` (below, added through crm-train's `callbacks` key)
  synchronises the GPU at each optimizer step after the warm-up and records step times, real and
  computed tokens, torch's memory peaks and the compile figures. The result: steady-state MFU
  (docs/PERFORMANCE.md section 2: real tokens, the trained model's non-embedding FLOPs; the
  embedding does not count) and `mfu_computed` (filling included), tokens/s, and `planned_gib`,
  what `crm-plan` prints for the same overrides (rows at stream.max_tokens), beside the same plan at
  the widest micro batch the run met. The first run of each mode also counts the host syncs of 20
  micro batches that neither Lightning nor crm's perf logging reads
  (`torch.cuda.set_sync_debug_mode("warn")`), by the Python line that caused each. The first
  pairwise run exports its model for `scoring`.
- `flex`: `crm-train` pointwise at packed rows of about 30k tokens (micro batch 4) and then 8k
  (micro batch 1): records of two ~4k-token answers, FlexAttention's path (a record's two
  responses are branches of one row), step time and peak memory.
- `scoring`: the exported CRM loaded as crm-eval and crm-leaderboard load it (`CRMScorer.load`,
  compiled layers on CUDA): rows/s of a best-of-4 benchmark in RewardBench 2's layout
  (benchmarks/benchmark_scoring.py: crm-eval's path) and of a leaderboard (crm-leaderboard's
  `judge`), plain and with prefix reuse, after a warm-up of each, with `engine=local`; and the
  leaderboard with `engine=ray` and one worker (`--engines`; a local Ray's start-up is timed apart).
- `trl`: benchmarks/train_vs_trl.py, crm's packed pointwise run against TRL's RewardTrainer on the
  same pairs, batch and GPU (qwen3-0.6b), gradient checkpointing off in both (TRL's default is on).

Without CUDA it runs the tiny model, eagerly, for a few steps: a smoke test of this harness (the
test suite runs it); its figures are not GPU figures and the JSON says `"device": "cpu"`. There
`graphs` and `flex` say they need CUDA, engine=ray is left out unless `--engines` names it (a local
Ray's start-up is most of a smoke test's time), and `trl` says so where TRL is not installed.

    python benchmarks/gpu_train.py [--tasks train=qwen3-0.6b:16:off:pairwise,trl,...] [--budget 480]
                                   [--steps 8] [--warmup 3] [--engines local,ray] [--out results.json]
"""
from __future__ import annotations

import argparse
import contextlib
import collections
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import lightning as L
import torch

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
# Issue 59's order: crm-train's MFU at 0.6B and 1.7B, pairwise and pointwise, as it is and with
# static shapes and CUDA graphs; the 4B; the ~30k-token FlexAttention row; scoring; crm vs TRL.
GPU_TASKS = ",".join([
    "train=qwen3-0.6b:16:off:pairwise", "train=qwen3-0.6b:16:off:pointwise",
    "train=qwen3-1.7b:8:off:pairwise", "train=qwen3-1.7b:8:off:pointwise",
    "train=qwen3-0.6b:16:off:pairwise:static", "train=qwen3-0.6b:16:off:pairwise:graphs",
    "train=qwen3-0.6b:16:off:pointwise:graphs", "train=qwen3-1.7b:8:off:pairwise:graphs",
    "train=qwen3-4b:8:on:pairwise", "flex", "scoring", "trl"])
CPU_TASKS = "train=tiny:8:off:pairwise,scoring,trl,flex"
VARIANTS = ("today", "static", "graphs")
# Seconds a task took on one H100 (its first call, compile included), to skip what cannot finish.
ESTIMATES = {"tiny": 30, "qwen3-0.6b": 75, "qwen3-1.7b": 95, "qwen3-4b": 140, "trl": 120, "scoring": 90,
             "flex": 110}
SYNC_MICRO_BATCHES = 20
SYNC_MESSAGE = "synchroniz"  # torch's "called a synchronizing CUDA operation"


class StepStats(L.Callback):
    """Optimizer-step times (synchronised on CUDA), tokens and memory peaks of a run, as JSON in `out`.

    Steps up to `warmup` are not timed, the next `timed` are; with `sync_micro_batches`, the micro
    batches after them run with CUDA's sync debug mode at "warn", and the syncs of those that no
    logging step reads (`log_every`: the trainer's and crm's perf cadences) are counted by the
    Python line that raised them."""

    def __init__(self, out: str, warmup: int = 10, timed: int | None = None, sync_micro_batches: int = 0,
                 log_every: tuple[int, ...] = ()):
        self.out, self.warmup, self.timed = Path(out), warmup, timed
        self.step_seconds: list[float] = []
        self.real = self.padded = self.rows = self.samples = 0
        # (records, longest sequence) of the micro batch that computed the most tokens, packed
        # or not, and whether it was packed
        self.widest, self._widest_tokens, self.packed = (0, 0), 0, False
        self._last_step, self._mark = -1, None
        self.sync_wanted, self.log_every = sync_micro_batches, tuple(n for n in log_every if n > 0)
        self.syncs: list[dict] = []  # one per watched micro batch: its step, whether it logs, its syncs
        self._watch = None
        self.shapes: set[tuple] = set()  # of the micro batches' input_ids

    def _sync(self) -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter()

    def _timing(self, step: int) -> bool:
        return step > self.warmup and (self.timed is None or step <= self.warmup + self.timed)

    def _logging_step(self, step: int) -> bool:
        # Both neighbours of each cadence's multiple: which one Lightning counts from is its detail.
        return any(s % n == 0 for n in self.log_every for s in (step, step + 1))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        step = trainer.global_step
        watched = sum(1 for s in self.syncs if not s["logging_step"])
        if (torch.cuda.is_available() and self.timed is not None and step > self.warmup + self.timed
                and watched < self.sync_wanted):
            self._watch = warnings.catch_warnings(record=True)
            self._caught = self._watch.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if self._watch is not None:
            torch.cuda.set_sync_debug_mode("default")
            self._watch.__exit__(None, None, None)
            self._watch = None
            sites = [f"{'/'.join(Path(w.filename).parts[-3:])}:{w.lineno}" for w in self._caught
                     if SYNC_MESSAGE in str(w.message)]
            # the step the micro batch belonged to: global_step moves on at its optimizer step
            self.syncs.append({"step": step, "logging_step": self._logging_step(step), "sites": sites})
        if self._timing(step):
            if "read" in batch:  # a packed row: every token real but its filling to a token budget
                self.real += batch["real_tokens"]
                self.padded += batch["input_ids"].shape[1]
                self.rows += batch["read"].numel()
            else:
                mask = batch["attention_mask"]
                self.real += int(mask.sum())
                self.padded += mask.numel()
                self.rows += mask.shape[0]
            self.samples += len(batch["keys"])
        tokens = batch["input_ids"].numel()
        self.shapes.add(tuple(batch["input_ids"].shape))
        if tokens > self._widest_tokens:
            self.packed = "read" in batch
            width = batch["max_length"] if self.packed else batch["input_ids"].shape[1]
            self.widest, self._widest_tokens = (len(batch["keys"]), width), tokens
        if step == self._last_step:  # accumulating: no optimizer step yet
            return
        self._last_step, now = step, self._sync()
        if self._timing(step) and self._mark is not None:
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
        quiet = [s for s in self.syncs if not s["logging_step"]]
        counted = collections.Counter(site for s in quiet for site in s["sites"])
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
            # the tokens computed, padding and a token budget's filling included
            "mfu_computed": (self.padded / seconds * per_token / peak) if (seconds and peak) else None,
            "shapes": len(self.shapes),
            "widest_micro_batch": list(self.widest), "widest_micro_batch_tokens": self._widest_tokens,
            "packed": self.packed,
            "peak_allocated_gib": torch.cuda.max_memory_allocated() / gib if cuda else None,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / gib if cuda else None,
            "compile": compile_stats(),
            "cudagraphs": _cudagraph_counters(),
        }
        if self.sync_wanted and cuda:
            result["host_syncs"] = {
                "micro_batches": len(quiet), "syncs": sum(counted.values()),
                "per_micro_batch": [len(s["sites"]) for s in quiet],
                "sites": dict(counted.most_common(12)),
                "logging_micro_batches_left_out": len(self.syncs) - len(quiet)}
        self.out.write_text(json.dumps(result))


class InductorMode(L.Callback):
    """What torch.compile's mode "reduce-overhead" turns on, for the decoder layers crm compiles:
    inductor's CUDA graphs (read when a graph is compiled, at the first forward, after `setup`).
    `static`: no dimension marked dynamic (crm marks batch and sequence, and the packed kernels'
    inputs, so that varying rows share one graph): with a token budget every step has one shape,
    and the graph is compiled for it (dynamo turns a dimension dynamic by itself if it changes)."""

    def __init__(self, cudagraphs: bool = True, static: bool = True):
        self.cudagraphs, self.static = cudagraphs, static

    def setup(self, trainer, pl_module, stage: str) -> None:
        import torch._inductor.config as inductor

        inductor.triton.cudagraphs = self.cudagraphs
        if self.static:
            torch._dynamo.maybe_mark_dynamic = lambda *args, **kwargs: None


def _cudagraph_counters() -> dict:
    """inductor's counters that name CUDA graphs (recorded, skipped and why), where torch keeps them."""
    from torch._dynamo.utils import counters

    return {f"{group}/{key}": n for group in ("inductor", "stats") for key, n in counters[group].items()
            if "cudagraph" in key}


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


class Runner:
    """The tasks of one call, their shared data and their JSON."""

    def __init__(self, args, cuda: bool, data_dir: Path):
        self.args, self.cuda, self.data_dir = args, cuda, data_dir
        self.export: Path | None = None  # the first pairwise run's model, for `scoring`
        self.sync_done: set[str] = set()  # modes whose host syncs were counted
        self.widest: dict[tuple, int] = {}  # (size, mode, micro) -> the widest micro batch's tokens
        self.result = {"device": torch.cuda.get_device_name() if cuda else "cpu",
                       "torch": torch.__version__, "versions": _versions(),
                       "settings": {k: v for k, v in vars(args).items()},
                       "crm_train": [], "tasks": []}

    def write(self) -> None:
        if self.args.out:
            Path(self.args.out).write_text(json.dumps(self.result, indent=1) + "\n")

    def token_budget(self, size: str, mode: str, micro: int, max_tokens: int) -> int:
        """A static run's `stream.token_budget`: the widest micro batch a run of the same size,
        mode and micro batch met in this call, rounded up to FlexAttention's 128-token tile; else
        what no micro batch exceeds."""
        widest = self.widest.get((size, mode, micro))
        if widest is None:
            return micro * max_tokens * (2 if mode == "pointwise" else 1)
        return -(-widest // 128) * 128

    def crm_train(self, size: str, micro: int, checkpointing: bool, mode: str, variant: str = "today", *,
                  data: Path | None = None, max_tokens: int | None = None, global_batch: int | None = None,
                  steps: int | None = None, warmup: int | None = None, name: str | None = None) -> dict:
        """One `crm-train` run in a process of its own; StepStats' JSON with the run's settings."""
        args, cuda = self.args, self.cuda
        if variant == "graphs" and not cuda:
            return {"size": size, "mode": mode, "variant": variant,
                    "skipped": "CUDA graphs need CUDA (inductor records them on the GPU)"}
        name = name or f"{size}-{mode}" + ("" if variant == "today" else f"-{variant}")
        max_tokens = max_tokens or args.max_tokens
        global_batch = global_batch or args.global_batch
        warmup = args.warmup if warmup is None else warmup
        timed = args.steps if steps is None else steps
        sync = mode not in self.sync_done and cuda and data is None
        micro_per_step = max(1, global_batch // micro)
        # the sync window: 20 micro batches that log nothing, with room for one logging step
        extra = -(-SYNC_MICRO_BATCHES // micro_per_step) + 2 if sync else 0
        export = mode == "pairwise" and self.export is None and data is None
        out = self.data_dir / f"stats-{name}.json"
        log_every = (args.log_every, args.log_every)  # trainer.log_every_n_steps, perf.log_every_n_steps
        overrides = [
            "data=shards", f"data.path={data or self.data_dir / 'shards'}", "direction=original",
            f"model={size}", f"model.tokenizer={self.data_dir / 'tokenizer'}",
            f"global_batch_size={global_batch}", f"micro_batch_size={micro}",
            f"stream.max_tokens={max_tokens}",
            f"parallel.activation_checkpointing={str(checkpointing).lower()}",
            f"trainer.max_steps={warmup + timed + extra}", "val_every_n_steps=1000000",
            "save_every_n_steps=1000000", f"export={str(export).lower()}", "evaluate=false", "logger=none",
            "trainer.enable_progress_bar=false", f"trainer.log_every_n_steps={log_every[0]}",
            f"perf.log_every_n_steps={log_every[1]}", f"name=bench-{name}",
            f"+callbacks.bench={{_target_: gpu_train.StepStats, out: '{out}', warmup: {warmup}, "
            f"timed: {timed}, sync_micro_batches: {SYNC_MICRO_BATCHES if sync else 0}, "
            f"log_every: [{log_every[0]}, {log_every[1]}]}}",
            *(["loss=ranking"] if mode == "pointwise" else ["loss=cls"]),
        ]
        budget = None
        if variant != "today":  # static shapes: packed rows filled to one budget
            budget = self.token_budget(size, mode, micro, max_tokens)
            overrides += ["stream.packing=true", f"stream.token_budget={budget}"]
        if variant == "graphs":
            overrides.append("+callbacks.inductor_mode={_target_: gpu_train.InductorMode, cudagraphs: true, "
                             "static: true}")
        if cuda:
            overrides += ["trainer=fsdp", "trainer.devices=1", "compile=true",
                          f"stream.num_workers={args.num_workers}"]
        else:  # the smoke test: the tiny model as the demo trains it, eagerly
            overrides += ["trainer=cpu", "compile=false", "torch_threads=1",
                          f"model.vocab_size={args.vocab_size}"]
        env = {**os.environ, "CRM_ROOT": str(self.data_dir), "PYTHONPATH": os.pathsep.join(
            filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
        started = time.perf_counter()
        done = subprocess.run([str(BIN / "crm-train"), *overrides], env=env, capture_output=True, text=True)
        wall = round(time.perf_counter() - started, 1)
        # crm-train leaves last.ckpt at the end (fp32 weights and AdamW's moments: about 9 GiB at
        # 0.6B, 25 at 1.7B, 60 at 4B). Kept, they filled the H100 machine's 64 GiB disk during the
        # 4B run's save; a 4B run still needs about 60 GiB free.
        shutil.rmtree(self.data_dir / "outputs" / f"bench-{name}" / "checkpoints", ignore_errors=True)
        if done.returncode:
            return {"size": size, "mode": mode, "variant": variant, "error": done.stderr[-3000:],
                    "wall_seconds": wall}
        stats = json.loads(out.read_text())
        if variant == "today":
            self.widest[(size, mode, micro)] = stats["widest_micro_batch_tokens"]
        if sync:
            self.sync_done.add(mode)
        if export:
            self.export = self.data_dir / "outputs" / f"bench-{name}" / "export"
        planned = self.plan(size, micro, checkpointing, mode, stats, max_tokens, global_batch)
        return {"size": size, "mode": mode, "variant": variant, "token_budget": budget,
                "packing": stats["packed"], "micro_batch": micro,
                "global_batch": global_batch, "max_tokens": max_tokens,
                "activation_checkpointing": checkpointing, "wall_seconds": wall,
                "mfu": stats["mfu"], "tokens_per_s": stats["tokens_per_s"],
                "peak_gib": stats["peak_allocated_gib"], "planned_gib": planned["crm_plan_total_gib"],
                **stats, "plan": planned}

    def plan(self, size: str, micro: int, checkpointing: bool, mode: str, stats: dict, max_tokens: int,
             global_batch: int) -> dict:
        """`crm-plan` for the run's overrides (what a user is told before the run: rows at
        stream.max_tokens), and the same plan at the widest micro batch the run met."""
        from omegaconf import OmegaConf

        from crm.perf.flops import ModelShape
        from crm.perf.memory import memory_plan

        command = [str(BIN / "crm-plan"), f"model={size}", "trainer.devices=1", "trainer.num_nodes=1",
                   f"seq_len={max_tokens}", f"micro_batch_size={micro}", f"global_batch_size={global_batch}",
                   f"activation_checkpointing={str(checkpointing).lower()}",
                   f"compile={str(self.cuda).lower()}",
                   f"kind={mode}", f"packing={str(stats['packed']).lower()}", "sharding=fsdp",
                   f"gpu_memory_gib={self.gpu_gib()}", f"name=plan-{size}-{mode}-{micro}-{max_tokens}"]
        if not self.cuda:  # the tiny model: the BPE's vocabulary, as crm-train gives it
            command.append(f"model.vocab_size={self.args.vocab_size}")
        done = subprocess.run(command, env={**os.environ, "CRM_ROOT": str(self.data_dir)},
                              capture_output=True, text=True)
        plan_file = next((line.removeprefix("plan: ") for line in done.stdout.splitlines()
                          if line.startswith("plan: ")), None)
        total = json.loads(Path(plan_file).read_text())["memory"]["total_gib"] if plan_file else None
        # What crm-train builds: a published size keeps its vocabulary, a dict arch takes the tokenizer's.
        model_config = OmegaConf.load(HERE.parent / "configs" / "model" / f"{size}.yaml")
        arch = OmegaConf.to_container(model_config)["arch"]
        shape = ModelShape.from_arch(arch, vocab_size=None if isinstance(arch, str) else self.args.vocab_size)
        rows, width = stats["widest_micro_batch"]
        if not rows:  # every record dropped by the length policy: nothing was trained
            return {"crm_plan_total_gib": total, "crm_plan_command": " ".join(command[1:]),
                    "error": "no micro batch held a record"}
        widest = memory_plan(shape, world=1, seq_len=width, micro_batch_size=rows, kind=mode,
                             precision="bf16-mixed", activation_checkpointing=checkpointing,
                             compiled=self.cuda, packing=stats["packed"],
                             prompt_share=0.2 if mode == "pointwise" else 0.0,
                             accumulating=global_batch > micro)
        measured = stats["peak_allocated_gib"]
        return {"crm_plan_total_gib": total, "crm_plan_command": " ".join(command[1:]),
                "crm_plan_error": None if plan_file else done.stderr[-1500:],
                "at_widest_batch_gib": widest["total_gib"],
                "error_at_widest": None if not measured else widest["total_gib"] / measured - 1}

    def gpu_gib(self) -> int:
        return round(torch.cuda.get_device_properties(0).total_memory / 2 ** 30) if self.cuda else 80

    def trl(self) -> dict:
        """benchmarks/train_vs_trl.py at equal memory (gradient checkpointing off in both)."""
        import importlib.util

        if importlib.util.find_spec("trl") is None:
            return {"ratio_crm_over_trl": None, "skipped": "TRL is not installed here (pip install "
                                                           "trl==1.16.0: docs/PERFORMANCE.md section 8)"}
        args = self.args
        command = [sys.executable, str(HERE / "train_vs_trl.py"), "--rounds", "1",
                   "--steps", str(args.trl_steps)]
        if self.cuda:
            command += ["--device", "cuda", "--arch", "qwen3-0.6b", "--long", "--compile",
                        "--batch-size", "8",
                        "--max-tokens", str(args.max_tokens), "--vocab-size", str(args.vocab_size),
                        "--n-train", "1000", "--runs", "crm_pointwise_packed,trl"]
        else:  # the smoke test: the packed path against TRL, in this process
            return self.trl_here()
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            return {"error": done.stderr[-3000:]}
        return self.against_trl(json.loads(done.stdout))

    def trl_here(self) -> dict:
        """train_vs_trl.py's two runs (crm's packed pointwise, TRL's RewardTrainer) in this process
        on the tiny model: a process each, as on a GPU, would import torch, transformers and TRL
        again, most of the smoke test's time."""
        import logging

        import train_vs_trl

        options = argparse.Namespace(long=False, n_train=120, vocab_size=None, arch="tiny",
                                     steps=self.args.trl_steps, batch_size=8, max_tokens=256,
                                     num_workers=0, device="cpu", compile=False)
        data = self.data_dir / "trl"
        data.mkdir(parents=True, exist_ok=True)
        try:
            train_vs_trl.prepare(str(data), options)
            with contextlib.redirect_stdout(sys.stderr):  # TRL prints its metrics: stdout is the JSON's
                runs = {name: train_vs_trl.run_one(name, str(data), options)
                        for name in ("crm_pointwise_packed", "trl")}
        except Exception as err:  # the other tasks' figures still count; this one says why
            return {"error": f"{type(err).__name__}: {err}"[-3000:]}
        finally:
            logging.disable(logging.NOTSET)  # run_one quiets the warnings of the process
        crm, trl = runs["crm_pointwise_packed"], runs["trl"]
        full = {"setup": {"arch": "tiny", "batch_size": 8, "steps_per_run": options.steps,
                          "timed_steps": options.steps - train_vs_trl.WARMUP_STEPS, "device": "cpu",
                          "process_per_run": False},
                **runs, "ratio_crm_pointwise_packed_over_trl": round(crm["samples_per_s"]
                                                                      / trl["samples_per_s"], 2)}
        return self.against_trl(full)

    @staticmethod
    def against_trl(full: dict) -> dict:
        crm = full.get("crm_pointwise_packed", {})
        trl = full.get("trl", {})
        ratio = full.get("ratio_crm_pointwise_packed_over_trl")
        return {"ratio_crm_over_trl": ratio, "crm_records_per_s": crm.get("samples_per_s"),
                "trl_records_per_s": trl.get("samples_per_s"), "crm_peak_gib": crm.get("peak_allocated_gib"),
                "trl_peak_gib": trl.get("peak_allocated_gib"), "goal": ">= 2.0", "train_vs_trl": full}

    def flex(self) -> dict:
        """Pointwise rows of about 30k and then 8k tokens: FlexAttention's branches on CUDA."""
        if not self.cuda:
            return {"skipped": "FlexAttention is the CUDA path for packed pointwise rows; on CPU they "
                               "take the gather path (crm/models/packing.py)"}
        from long_pairs import write_long_pairs

        from crm.data.shard import shard

        # answers of 3,500-3,900 words: a record's two branches are about 8k tokens of one row
        raw = write_long_pairs(self.data_dir / "flex" / "long.jsonl", 48, min_words=3500, max_words=3900,
                               seed=1)
        shard([str(raw)], str(self.data_dir / "flex" / "shards"), shard_size=1000)
        runs = []
        for micro in (4, 1):  # the ~30k-token row first: the one never measured
            runs.append(self.crm_train(
                "qwen3-0.6b", micro, False, "pointwise", data=self.data_dir / "flex" / "shards",
                max_tokens=6144, global_batch=4, steps=4, warmup=2, name=f"flex-micro{micro}"))
            self.result["flex"] = {"runs": runs}
            self.write()
        return {"runs": runs}

    def scoring(self) -> dict:
        if self.export is None:
            return {"skipped": "no pairwise crm-train run exported a model in this call"}
        try:  # in this process: the training runs were processes of their own, its GPU is unused
            return score(self.export, self.data_dir, self.args.engines.split(","))
        except Exception as err:  # the other tasks' figures still count; this one says why
            return {"error": f"{type(err).__name__}: {err}"[-3000:]}
        finally:
            # The scorer is gone, but torch's allocator keeps its blocks: 36.5 GiB of them made the
            # 4B and 1.7B runs after `scoring` fail out of memory (H100, 2026-11-26).
            gc.collect()
            if self.cuda:
                torch.cuda.empty_cache()


def score(export: Path, data_dir: Path, engines: list[str]) -> dict:
    """Scoring throughput of `export`, loaded as crm-eval and crm-leaderboard load it: crm-eval's
    best-of-4 benchmark and crm-leaderboard's board with engine=local, then the board with each
    other engine of `engines` (engine=ray: one worker)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from benchmark_scoring import benchmark_rows, timed_run
    from leaderboard_prefix import timed
    from long_pairs import write_long_bench

    from crm.evaluation.leaderboard import select
    from crm.inference.scorer import CRMScorer

    cuda = torch.cuda.is_available()
    # on CPU, texts the tiny model's 384 tokens hold
    queries, models, words, query_words = (64, 8, (300, 700), (20, 80)) if cuda else (6, 4, (5, 12), (3, 8))
    bench = write_long_bench(data_dir / "score" / "bench.jsonl", queries, models, min_words=words[0],
                             max_words=words[1], query_words=query_words, seed=2)
    rows = benchmark_rows(bench, queries)
    full, warm = data_dir / "score" / "rb2.parquet", data_dir / "score" / "rb2_warm.parquet"
    pq.write_table(pa.Table.from_pylist(rows), full)
    pq.write_table(pa.Table.from_pylist(rows[:4]), warm)
    scorer = CRMScorer.load(export, batch_size=32, compile="auto", prefix_reuse=True)
    result = {"export": str(export), "device": str(scorer.device),
              "dtype": str(next(scorer.model.parameters()).dtype),
              "batch_size": 32, "benchmark": {"prompts": len(rows), "completions": 4 * len(rows)},
              "leaderboard": {"queries": queries, "models": models, "baseline": "model-0"}}
    for reuse in (True, False):
        scorer.prefix_reuse = reuse
        path = "prefix_reuse" if reuse else "plain"
        timed_run(scorer, warm, data_dir / "score" / f"warm-{path}")  # compile and allocator warm-up
        if cuda:
            torch.cuda.synchronize()
        result["benchmark"][path] = timed_run(scorer, full, data_dir / "score" / path)
    selection = select(bench, "model-0")
    criteria = ["Prefers concise answers."]
    for reuse in (False, True):
        scorer.prefix_reuse = reuse
        figures, _ = timed(scorer, selection, criteria, repeats=1)  # its own warm-up pass first
        result["leaderboard"]["prefix_reuse" if reuse else "plain"] = figures
    if cuda:
        result["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
    # rows (a benchmark's sequences, a board's pairs) per wall second, per path and engine
    paths = ("plain", "prefix_reuse")
    bench_rates = {path: result["benchmark"][path]["sequences_per_s"] for path in paths}
    board_rates = {path: result["leaderboard"][path]["pairs_per_wall_s"] for path in paths}
    result["rows_per_s"] = {"crm_eval": {"local": bench_rates},
                            "crm_leaderboard": {"local": board_rates}}
    del scorer
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()  # the worker's GPU memory, not this process's cached blocks
    for engine in engines:
        if engine != "local":
            outcome = ray_board(export, selection, criteria)
            result["rows_per_s"]["crm_leaderboard"][engine] = outcome
    return result


def ray_board(export: Path, selection, criteria: list[str]) -> dict:
    """crm-leaderboard's board with engine=ray and one worker (a GPU where there is one): start-up,
    then a warm-up pass, then the timed pass, plain path (prefix reuse left as crm-leaderboard
    leaves it)."""
    try:
        import ray  # noqa: F401
    except ImportError:
        return {"skipped": "ray is not installed here (pip install ray)"}
    from crm.evaluation.leaderboard import judge
    from crm.inference.config import EngineConfig
    from crm.inference.engine import RayScorer, ScorerLoader, checkpoint_identity

    started = time.perf_counter()
    scorer = RayScorer.start(ScorerLoader(str(export), batch_size=32), EngineConfig(name="ray", workers=1),
                             identity=checkpoint_identity(export))
    startup = time.perf_counter() - started
    try:
        judge(scorer, selection, criteria)  # the worker's compile and allocator warm-up
        started = time.perf_counter()
        outcomes = judge(scorer, selection, criteria)
        seconds = time.perf_counter() - started
    finally:
        scorer.close()
    return {"workers": 1, "startup_seconds": round(startup, 1), "pairs": len(outcomes),
            "seconds": round(seconds, 2), "prefix_reuse": True,
            "pairs_per_wall_s": round(len(outcomes) / seconds, 1)}


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("torch", "transformers", "lightning", "tokenizers", "trl", "triton"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", help=f"comma-separated (default on CUDA {GPU_TASKS}; without, {CPU_TASKS})")
    p.add_argument("--budget", type=float, default=None, help="seconds for all tasks (default: no limit)")
    p.add_argument("--steps", type=int, help="timed optimizer steps per run (default 8 on CUDA, 2 on CPU)")
    p.add_argument("--warmup", type=int, help="untimed steps (compile, allocator; default 3, CPU 1)")
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--records", type=int, help="long pairs generated (default 2000, CPU 120)")
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--num-workers", type=int, default=4)
    p.add_argument("--log-every", type=int, default=10, help="trainer's and crm's perf logging cadence")
    p.add_argument("--trl-steps", type=int,
                   help="steps per crm/TRL run, the first 5 untimed (default 20, CPU 7)")
    p.add_argument("--engines", help="scoring engines (default on CUDA local,ray; without, local)")
    p.add_argument("--out", help="write the JSON here too, after every task")
    args = p.parse_args()
    sys.path.insert(0, str(HERE))
    cuda = torch.cuda.is_available()
    defaults = (dict(tasks=GPU_TASKS, steps=8, warmup=3, records=2000, trl_steps=20, engines="local,ray")
                if cuda else
                dict(tasks=CPU_TASKS, steps=2, warmup=1, records=120, trl_steps=7, engines="local",
                     vocab_size=512, max_tokens=384, global_batch=8))
    for key, value in defaults.items():
        if getattr(args, key) is None or (not cuda and key in ("vocab_size", "max_tokens", "global_batch")):
            setattr(args, key, value)
    unknown = set(args.engines.split(",")) - {"local", "ray"}
    if unknown:
        p.error(f"--engines: {','.join(sorted(unknown))}: expected local, ray or both, comma-separated")
    for task in args.tasks.split(","):  # all checked before minutes of data preparation
        kind, _, spec = task.partition("=")
        parts = spec.split(":")
        if kind == "train" and not (len(parts) in (4, 5) and parts[1].isdigit() and parts[2] in ("on", "off")
                                    and parts[3] in ("pairwise", "pointwise")
                                    and (len(parts) == 4 or parts[4] in VARIANTS)):
            p.error(f"--tasks: {task}: expected "
                    f"train=SIZE:MICRO:on|off:pairwise|pointwise[:{'|'.join(VARIANTS)}]")
        if kind not in ("train", "trl", "flex", "scoring") or (kind != "train" and spec):
            p.error(f"--tasks: {task}: expected train=..., trl, flex or scoring")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        runner = Runner(args, cuda, Path(tmp))
        prepare(Path(tmp), args.records, args.vocab_size, *((300, 700) if cuda else (20, 60)))
        runner.result["prepare_seconds"] = round(time.perf_counter() - started, 1)
        for task in args.tasks.split(","):
            kind, _, spec = task.partition("=")
            estimate = ESTIMATES.get(spec.split(":")[0] if spec else kind, 60)
            left = None if args.budget is None else args.budget - (time.perf_counter() - started)
            task_started = time.perf_counter()
            if left is not None and left < estimate:
                outcome = {"skipped": f"{left:.0f} s of the {args.budget:.0f} s budget left, "
                                      f"the task takes about {estimate} s"}
            elif kind == "train":
                size, micro, ckpt, mode, *variant = spec.split(":")
                outcome = runner.crm_train(size, int(micro), ckpt == "on", mode, *variant)
                runner.result["crm_train"].append(outcome)
            else:
                outcome = {"trl": runner.trl, "flex": runner.flex, "scoring": runner.scoring}[kind]()
                runner.result["crm_vs_trl" if kind == "trl" else kind] = outcome
            if "skipped" in outcome and kind == "train" and outcome not in runner.result["crm_train"]:
                runner.result["crm_train"].append({"size": spec, "skipped": outcome["skipped"]})
            seconds = round(time.perf_counter() - task_started, 1)
            runner.result["tasks"].append({"task": task, "seconds": seconds,
                                           **{k: outcome[k] for k in ("skipped",) if k in outcome},
                                           **({"error": True} if "error" in outcome else {})})
            runner.write()
    print(json.dumps(runner.result, indent=1))


if __name__ == "__main__":
    main()
