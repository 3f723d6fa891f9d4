"""The host's time per training step of crm-train outside forward, backward and the optimizer's
own update, taken apart (docs/PERFORMANCE.md section 13). Prints one JSON document.

    python benchmarks/step_overhead.py [--models tiny,tiny-l] [--packing true,false] [--worlds 1,2]
                                       [--modes pairwise] [--steps 30] [--warmup 5] [--repeats 1]
                                       [--token-budget N] [--out FILE]

Each run is `crm-train` as a user starts it (the demo's data, sized down; `trainer=cpu`, or
`trainer=fsdp` on CPU at 2 ranks started together as torchrun starts them), with `HostTimes`
(below) added through crm-train's `callbacks` key. In the training process(es) it times, per
micro batch, every region of Lightning's own profiler (each Lightning hook, each callback's hook,
the data loader's `next`, the strategy's batch transfer, backward and optimizer-step hooks) and
crm's own parts inside them (tokenizing, `pack()`, `pad_rows()`, the stream's bookkeeping, the
forward and loss, the training step's logging and reductions, the torch optimizer's update, the
LR scheduler, Lightning's logger connector), each as *own* time: a region's seconds less those of
the regions inside it, so that the parts add up to the step. It also counts what would make a
host wait for a GPU, by the region and source line it happens in: `Tensor.item`, `.tolist`,
`.cpu`, `.numpy`, `bool(tensor)` (a Python branch on a tensor's value) and every
`torch.distributed` collective; and the distinct shapes of the micro batches' `input_ids` (what a
compiled graph and a CUDA graph see).

On CPU, forward, backward and the optimizer run on the host too, so the figures here are the
host's whole cost of each part; on a GPU the compute parts are kernel launches and the rest is
what the GPU may wait for. Steps up to `--warmup` are not counted. A step is an optimizer step:
its micro batches' times summed. Each part is reported as mean and median ms per optimizer
step over the timed steps, and apart for the steps that log (`trainer.log_every_n_steps`).
"""
from __future__ import annotations

import argparse
import collections
import functools
import gc
import json
import math
import os
import platform
import shutil
import socket
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
READS = ("item", "tolist", "cpu", "numpy", "__bool__")
COLLECTIVES = ("all_reduce", "broadcast", "barrier", "all_gather", "all_gather_object",
               "broadcast_object_list", "reduce", "gather", "reduce_scatter_tensor")
# What each table row of docs/PERFORMANCE.md section 13 sums: a region's name starts with one of
# these prefixes (the first that matches).
PARTS = [
    ("compute: forward + loss", ("crm: forward + loss",)),
    ("compute: backward", ("[Strategy]", "backward")),
    ("compute: optimizer update (AdamW)", ("torch: optimizer.step",)),
    ("compute: clip grad norm", ("[LightningModule]", "configure_gradient_clipping")),
]


class Regions:
    """Own (exclusive) seconds per named region, nested: a region's seconds less those of the
    regions started inside it; wall seconds and this thread's CPU seconds (on a busy machine the
    wall clock also counts the time other processes took the core; the CPU clock does not, nor
    does it count a wait, for another rank or a worker)."""

    def __init__(self, clocks=(time.perf_counter, time.thread_time)):
        self.clocks = clocks
        self.stack: list[list] = []  # [name, starts, seconds of the regions inside (per clock)]
        self.own = [collections.Counter() for _ in clocks]
        self.calls: collections.Counter = collections.Counter()

    def start(self, name: str) -> None:
        self.stack.append([name, [clock() for clock in self.clocks], [0.0] * len(self.clocks)])

    def stop(self, name: str) -> None:
        now = [clock() for clock in self.clocks]
        # Lightning's start/stop pairs nest; one left open by an exception closes with its parent
        while self.stack:
            entry = self.stack.pop()
            elapsed = [t - t0 for t, t0 in zip(now, entry[1])]
            for own, spent, inside in zip(self.own, elapsed, entry[2]):
                own[entry[0]] += spent - inside
            self.calls[entry[0]] += 1
            if self.stack:
                self.stack[-1][2] = [a + b for a, b in zip(self.stack[-1][2], elapsed)]
            if entry[0] == name:
                return

    @property
    def current(self) -> str:
        return self.stack[-1][0] if self.stack else "outside any region"

    def wrap(self, function, name: str):
        @functools.wraps(function)
        def timed(*args, **kwargs):
            self.start(name)
            try:
                return function(*args, **kwargs)
            finally:
                self.stop(name)
        return timed

    def take(self) -> tuple[dict, dict, dict]:
        (wall, cpu), calls = (dict(c) for c in self.own), dict(self.calls)
        self.own = [collections.Counter() for _ in self.clocks]
        self.calls = collections.Counter()
        return wall, cpu, calls


def short_name(action: str) -> str:
    """Lightning's profiler names without a callback's state key: `[Callback]ModelCheckpoint{...}.hook`
    -> `[Callback]ModelCheckpoint.hook` (the two checkpoint callbacks add up)."""
    if "{" in action:
        head, _, rest = action.partition("{")
        action = head + rest[rest.rindex("}") + 1:]
    return action


def host_profiler(regions: Regions):
    from lightning.pytorch.profilers import Profiler

    class HostProfiler(Profiler):
        """Lightning's profiler interface feeding `regions` (Lightning calls start/stop around each
        hook, callback, fetch and strategy call)."""

        def start(self, action_name: str) -> None:
            regions.start(short_name(action_name))

        def stop(self, action_name: str) -> None:
            regions.stop(short_name(action_name))

        def summary(self) -> str:
            return ""

    return HostProfiler()


class HostTimes(L.Callback):
    """The in-process side: patches the training process's parts to time and count them from
    training's start, and writes, per rank, one record per micro batch after `warmup` optimizer
    steps to `out` (`-rank<N>.json` appended)."""

    def __init__(self, out: str, warmup: int = 5):
        self.out, self.warmup = out, warmup
        self.regions = Regions()
        self.reads: collections.Counter = collections.Counter()  # (kind, region, site)
        self.micro: list[dict] = []
        self.shape, self.step = None, 0
        self._undo: list = []

    # -- patches --------------------------------------------------------------------------------

    def _patch(self, owner, name: str, replacement) -> None:
        own = vars(owner)
        self._undo.append((owner, name, name in own, own.get(name)))
        setattr(owner, name, replacement)

    def _counting(self, kind: str, original):
        regions, reads = self.regions, self.reads

        def counted(*args, **kwargs):
            caller = sys._getframe(1)
            site = f"{'/'.join(Path(caller.f_code.co_filename).parts[-2:])}:{caller.f_lineno}"
            reads[(kind, regions.current, site)] += 1
            return original(*args, **kwargs)
        return counted

    def on_train_start(self, trainer, pl_module) -> None:
        import crm.data.stream as stream
        import crm.training.module as module
        import crm.training.throughput as throughput

        r = self.regions
        trainer.profiler = host_profiler(r)
        loop = trainer.fit_loop.epoch_loop
        self._patch(loop, "advance", r.wrap(loop.advance, "lightning: training loop (own)"))
        advance_end = r.wrap(loop.on_advance_end, "lightning: on_advance_end (own)")

        def on_advance_end(*args, **kwargs):  # the end of a micro batch: its window closes
            try:
                return advance_end(*args, **kwargs)
            finally:
                self._close_micro_batch(trainer)
        self._patch(loop, "on_advance_end", on_advance_end)
        connector = trainer._logger_connector
        for name in ("on_batch_start", "on_batch_end", "update_train_step_metrics"):
            self._patch(connector, name, r.wrap(getattr(connector, name), "lightning: logger connector"))
        for config in trainer.lr_scheduler_configs:
            scheduler = config.scheduler
            self._patch(scheduler, "step", r.wrap(scheduler.step, "lightning: lr scheduler step"))
        optimizer = trainer.optimizers[0]
        self._patch(optimizer, "step", r.wrap(optimizer.step, "torch: optimizer.step"))
        crm = pl_module.crm
        self._patch(crm, "loss_sums", r.wrap(crm.loss_sums, "crm: forward + loss"))
        self._patch(pl_module, "training_step", r.wrap(pl_module.training_step, "crm: training_step (own)"))
        self._patch(pl_module, "log_dict", r.wrap(pl_module.log_dict, "crm: module.log_dict"))
        self._patch(pl_module, "log", r.wrap(pl_module.log, "crm: module.log"))
        self._patch(module, "all_ranks_sum", r.wrap(module.all_ranks_sum, "crm: all_ranks_sum (module)"))
        self._patch(throughput, "all_ranks_sum",
                    r.wrap(throughput.all_ranks_sum, "crm: all_ranks_sum (perf)"))
        self._patch(stream, "pack", r.wrap(stream.pack, "crm: pack()"))
        self._patch(stream, "pad_rows", r.wrap(stream.pad_rows, "crm: pad_rows()"))
        self._patch(stream, "split_shared", r.wrap(stream.split_shared, "crm: split_shared()"))
        self._patch(stream, "plan_rank", r.wrap(stream.plan_rank, "crm: plan_rank()"))
        self._patch(stream.PairStream, "encode", r.wrap(stream.PairStream.encode, "crm: tokenize (encode)"))
        self._patch(stream.PairStream, "collate", r.wrap(stream.PairStream.collate, "crm: collate (own)"))
        self._patch(stream.StreamLoader, "mark_consumed",
                    r.wrap(stream.StreamLoader.mark_consumed, "crm: mark_consumed"))
        for kind in READS:
            self._patch(torch.Tensor, kind, self._counting(kind, getattr(torch.Tensor, kind)))
        gc.callbacks.append(self._collecting)
        dist = torch.distributed
        for name in COLLECTIVES:
            if hasattr(dist, name):
                self._patch(dist, name, self._counting(f"collective:{name}", getattr(dist, name)))

    def _collecting(self, phase: str, info: dict) -> None:
        """Python's garbage collector, a region of its own wherever it interrupts."""
        name = f"python: garbage collector (generation {info['generation']})"
        (self.regions.start if phase == "start" else self.regions.stop)(name)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.shape = tuple(batch["input_ids"].shape)
        self.step = trainer.global_step + 1  # the optimizer step this micro batch belongs to

    def _close_micro_batch(self, trainer) -> None:
        own, cpu, calls = self.regions.take()
        reads = collections.Counter()
        for (kind, region, site), n in self.reads.items():
            reads[f"{kind}|{region}|{site}"] += n
        self.reads.clear()
        self.micro.append({"step": self.step, "own": own, "cpu": cpu, "calls": calls,
                           "reads": dict(reads), "shape": self.shape})

    def on_train_end(self, trainer, pl_module) -> None:
        gc.callbacks.remove(self._collecting)
        for owner, name, had_own, original in reversed(self._undo):
            if had_own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)
        self._undo.clear()
        from crm.models.compile import compile_stats

        out = Path(f"{self.out}-rank{trainer.global_rank}.json")
        out.write_text(json.dumps({"rank": trainer.global_rank, "warmup": self.warmup,
                                   "log_every": trainer.log_every_n_steps,
                                   "micro_batches": self.micro, "compile": compile_stats()}))




# The rows of docs/PERFORMANCE.md section 13's table: each sums the parts (`part_of`) that match,
# with its goal per optimizer step in the training process. The anchor is torchtitan's hand-written
# loop: its loader prepares batches off the step's thread, it reads a device value only on the
# steps that log, and it runs Python's garbage collector itself every `gc_freq` steps.
TABLE = [
    ("data: the loader's next, own (mean: records, transforms, sorting, a window at a time)",
     ("data: loader next",), "0 with stream.num_workers >= 1"),
    ("data: tokenizing (mean: a window of 32 micro batches at a time)", ("crm: tokenize",),
     "0 with stream.num_workers >= 1"),
    ("data: pack() or pad_rows() (split_shared)", ("crm: pack()", "crm: pad_rows()", "crm: split_shared()"),
     "0 with stream.num_workers >= 1"),
    ("data: collate, the rest", ("crm: collate",), "0 with stream.num_workers >= 1"),
    ("data: the stream's position (mark_consumed, plan_rank)", ("crm: mark_consumed", "crm: plan_rank()",
                                                              "data: CRMDataModule"), "<= 0.5"),
    ("data: batch to device", ("data: batch to device",
                               "lightning: [LightningModule]CRMModule.transfer_batch",
                               "lightning: [LightningModule]CRMModule.on_after_batch"), "<= 1"),
    ("crm: training_step's own work", ("crm: training_step",), "<= 1.5"),
    ("crm: the step's example count and metric sums, all-reduced", ("crm: all_ranks_sum (module)",),
     "one all-reduce, <= 1"),
    ("crm: Lightning's `log` from the module", ("crm: module.log",), "0 on a step that does not log"),
    ("Lightning: loop, closure, hooks", ("lightning: training loop", "lightning: run_training_batch",
                                         "lightning: on_advance_end", "lightning: [Strategy]",
                                         "lightning: [LightningModule]", "lightning: lr scheduler"), "<= 6"),
    ("Lightning: logger connector (and the loggers)", ("lightning: logger connector",), "<= 0.5"),
    ("callback: progress bar", ("callback StepRichBar", "callback StepTQDMBar"), "<= 1 (off in batch jobs)"),
    ("callback: preemption flag", ("callback Preemption",), "<= 1 (one async all-reduce)"),
    ("callback: throughput (perf/*)", ("callback Throughput", "crm: all_ranks_sum (perf)"), "<= 0.5"),
    ("callbacks: checkpoints, LR monitor, card, size, sharding", (
        "callback ModelCheckpoint", "callback LearningRateMonitor", "callback CheckpointCard",
        "callback ModelSize", "callback ShardingReport"), "<= 0.5"),
    ("Python's garbage collector (mean: a collection every few steps)",
     ("python: garbage collector", "lightning: python: garbage collector"), "<= 0.5"),
]
COMPUTE = ["compute: forward + loss", "compute: backward", "compute: optimizer update (AdamW)",
           "compute: clip grad norm"]


def table_row(parts: dict, keys: tuple[str, ...], group: str, stat: str) -> float:
    return sum(row.get(group, {}).get(stat, 0.0) for part, row in parts.items()
               if part.startswith(keys))


def table(files: list[str], code: str | None = None, stat: str = "cpu_median_ms") -> str:
    """Markdown: per row, the range over the runs (of `code`, where several were compared) of the
    quiet steps' `stat` per step, per model and world size, from rank 0."""
    runs = [run for f in files for run in json.loads(Path(f).read_text())["runs"]
            if code is None or run.get("code") == code]
    columns = sorted({(r["model"], r["world"]) for r in runs})
    head = "| part | " + " | ".join(f"{m}, {w} rank{'s' if w > 1 else ''}" for m, w in columns) + " | goal |"
    lines = [head, "|---|" + "---:|" * len(columns) + "---|"]

    def cell(keys, group="quiet", stat=stat) -> list[str]:
        out = []
        for column in columns:
            values = [table_row(r["ranks"][0]["parts_ms_per_step"], keys, group, stat)
                      for r in runs if (r["model"], r["world"]) == column]
            out.append(f"{min(values):.2f}-{max(values):.2f}" if values else "")
        return out

    for name, keys, goal in TABLE:
        bursty = "(mean:" in name
        lines.append(f"| {name} | " + " | ".join(cell(keys, stat=stat.replace("median", "mean") if bursty
                                                  else stat)) + f" | {goal} |")
    outside = []
    for column in columns:
        total = ("cpu_" if stat.startswith("cpu_") else "") + "outside_compute_median_ms"
        values = [r["ranks"][0]["totals"]["quiet"][total] for r in runs if (r["model"], r["world"]) == column]
        outside.append(f"{min(values):.1f}-{max(values):.1f}")
    lines.append("| **all of the above** (median step) | " + " | ".join(outside) + " | <= 15 |")
    for name in COMPUTE:
        lines.append(f"| {name} | " + " | ".join(cell((name,))) + " | |")
    return "\n".join(lines)


# -- the driver: runs, and what they add up to --------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_overrides(model: str, packing: bool, world: int, mode: str, steps: int, warmup: int,
                  micro: int, accumulation: int, log_every: int, out: Path, name: str,
                  token_budget: int | None, records: int, extra: list[str]) -> list[str]:
    overrides = [
        f"data.demo.n_train={records}", "data.demo.n_user=0", "data.demo.n_test=20", "data.demo.n_bench=4",
        f"model={model}", "loss=cls" if mode == "pairwise" else "loss=ranking", "transform.ties=drop",
        f"stream.packing={str(packing).lower()}", f"micro_batch_size={micro}",
        f"global_batch_size={micro * accumulation * world}", f"trainer.max_steps={warmup + steps}",
        "val_every_n_steps=1000000", "save_every_n_steps=1000000", "early_stopping_patience=0",
        "evaluate=false", "export=false", f"trainer.log_every_n_steps={log_every}",
        f"perf.log_every_n_steps={log_every}", "torch_threads=1", f"name={name}",
        "+trainer.num_sanity_val_steps=0",
        f"+callbacks.overhead={{_target_: step_overhead.HostTimes, out: '{out}', warmup: {warmup}}}",
    ]
    if token_budget:
        overrides.append(f"stream.token_budget={token_budget}")
    if world > 1:
        overrides += ["trainer=fsdp", "trainer.accelerator=cpu", f"trainer.devices={world}",
                      "parallel.param_dtype=float32"]
    return overrides + extra


def run(root: Path, overrides: list[str], world: int, name: str, code_dir: str | None = None) -> float:
    """crm-train once (`world` ranks started together, as torchrun does), with crm (and
    crm_configs) from `code_dir` where given; its wall seconds."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "MASTER_", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE"))}
    path = [code_dir, str(HERE), env.get("PYTHONPATH")]
    env.update(CRM_ROOT=str(root), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONWARNINGS="ignore", PYTHONPATH=os.pathsep.join(filter(None, path)))
    if world > 1:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), NODE_RANK="0",
                   WORLD_SIZE=str(world))
    started = time.perf_counter()
    logs = [root / "logs" / f"{name}-{rank}.log" for rank in range(world)]
    logs[0].parent.mkdir(parents=True, exist_ok=True)
    procs = []
    for rank, log in enumerate(logs):
        with open(log, "wb") as sink:
            procs.append(subprocess.Popen([str(BIN / "crm-train"), *overrides], stdout=sink,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          env={**env, **({"LOCAL_RANK": str(rank)} if world > 1 else {})}))
    codes = [p.wait() for p in procs]
    if any(codes):
        tail = logs[0].read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{name}: crm-train exited {codes}:\n{tail}")
    shutil.rmtree(root / "outputs" / name, ignore_errors=True)  # checkpoints and logs of the run
    return time.perf_counter() - started


def part_of(region: str) -> str:
    """The table row a region belongs to."""
    for part, keys in PARTS:
        if all(key in region for key in keys):
            return part
    if region.startswith(("crm: ", "lightning: ", "python: ")):
        return region
    if region.startswith("[Callback]"):
        return "callback " + region.removeprefix("[Callback]")
    if region.startswith("[_TrainingEpochLoop].train_dataloader_next"):
        return "data: loader next (own: reading, transforms, batching)"
    if region.startswith("[Strategy]") and region.endswith("batch_to_device"):
        return "data: batch to device"
    if region.startswith("[LightningDataModule]"):
        return "data: " + region.removeprefix("[LightningDataModule]")
    return "lightning: " + region


def summarise(records: list[dict], warmup: int, log_every: int) -> dict:
    """Per part, ms per optimizer step (mean and median; wall and this thread's CPU) over the timed
    steps, apart for the steps that log; host-wait counts per step; distinct shapes."""
    clocks = ("own", "cpu")
    steps: dict[int, dict] = collections.defaultdict(lambda: {
        **{c: collections.Counter() for c in clocks}, "reads": collections.Counter(), "micro": 0})
    shapes = collections.Counter()
    for micro in records:
        shapes[tuple(micro["shape"])] += 1
        if micro["step"] <= warmup:
            continue
        step = steps[micro["step"]]
        step["micro"] += 1
        for clock in clocks:
            for region, seconds in micro.get(clock, {}).items():
                step[clock][part_of(region)] += seconds
        step["reads"].update(micro["reads"])
    # The last step seen may be cut short by the end of training: whole steps only.
    full = max((s["micro"] for s in steps.values()), default=0)
    kept = {n: s for n, s in steps.items() if s["micro"] == full}
    groups = {"quiet": [s for n, s in kept.items() if n % log_every],
              "logging": [s for n, s in kept.items() if not n % log_every]}
    prefix = {"own": "", "cpu": "cpu_"}

    def figures(values: list[float], clock: str) -> dict:
        return {f"{prefix[clock]}mean_ms": round(statistics.fmean(values), 3),
                f"{prefix[clock]}median_ms": round(statistics.median(values), 3)}

    table = {}
    for part in sorted({p for s in kept.values() for p in s["own"]}):
        table[part] = {group: {k: v for clock in clocks
                               for k, v in figures([s[clock].get(part, 0.0) * 1e3 for s in members],
                                                   clock).items()}
                       for group, members in groups.items() if members}
    totals = {}
    for group, members in groups.items():
        if not members:
            continue
        totals[group] = {}
        for clock in clocks:
            whole = [sum(s[clock].values()) * 1e3 for s in members]
            outside = [sum(v for p, v in s[clock].items() if not p.startswith("compute:")) * 1e3
                       for s in members]
            for name, values in (("step", whole), ("outside_compute", outside)):
                key = f"{prefix[clock]}{name}"
                totals[group].update({f"{key}_mean_ms": round(statistics.fmean(values), 3),
                                      f"{key}_median_ms": round(statistics.median(values), 3)})
    reads = {}
    for group, members in groups.items():
        counted = collections.Counter()
        for s in members:
            counted.update(s["reads"])
        reads[group] = {k: round(v / len(members), 3) for k, v in counted.most_common()} if members else {}
    return {"steps": {g: len(m) for g, m in groups.items()}, "micro_batches_per_step": full,
            "parts_ms_per_step": table, "totals": totals, "host_waits_per_step": reads,
            "distinct_shapes": len(shapes), "micro_batches": sum(shapes.values()),
            "widest_micro_batch_tokens": max((math.prod(k) for k in shapes), default=0),
            "shapes_most_common": [[list(k), v] for k, v in shapes.most_common(5)]}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def load() -> dict:
    try:
        with open("/proc/loadavg") as f:
            return {"loadavg_1_5_15": [float(x) for x in f.read().split()[:3]]}
    except OSError:
        return {}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="tiny,tiny-l")
    p.add_argument("--packing", default="true,false")
    p.add_argument("--worlds", default="1,2")
    p.add_argument("--modes", default="pairwise")
    p.add_argument("--steps", type=int, default=30, help="timed optimizer steps per run")
    p.add_argument("--warmup", type=int, default=5, help="untimed optimizer steps first")
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--accumulation", type=int, default=2)
    p.add_argument("--log-every", type=int, default=10, help="trainer's and perf's logging cadence")
    p.add_argument("--records", type=int, default=3000, help="demo training pairs generated")
    p.add_argument("--token-budget", type=int, default=None, help="stream.token_budget of packed runs")
    p.add_argument("--repeats", type=int, default=1, help="rounds over all runs, alternating")
    p.add_argument("--out", help="write the JSON here too, after every run")
    p.add_argument("--code", action="append", default=[],
                   help="NAME=DIR: crm and its configs from DIR (a copy of the tree); several are run "
                        "back to back per setting (default: the installed crm)")
    p.add_argument("--skip", default="tiny-l:pointwise", help="MODEL:MODE pairs left out, comma-separated")
    p.add_argument("--table", nargs="+", help="print docs/PERFORMANCE.md's table from these results; no run")
    p.add_argument("--table-code", help="the table of this --code's runs")
    p.add_argument("--table-stat", default="cpu_median_ms",
                   choices=("cpu_median_ms", "median_ms", "cpu_mean_ms", "mean_ms"))
    p.add_argument("extra", nargs="*", help="more crm-train overrides for every run")
    args = p.parse_args()
    missing = [f for f in args.table or () if not Path(f).is_file()]
    if missing:
        p.error(f"--table: {missing[0]}: no such file")
    if args.table:
        print(table(args.table, args.table_code, args.table_stat))
        return
    codes = [tuple(c.split("=", 1)) for c in args.code] or [(None, None)]
    commit = subprocess.run(["git", "-C", str(HERE), "describe", "--always", "--dirty"],
                            capture_output=True, text=True).stdout.strip()
    result = {"machine": {"cpu": cpu_model(), "cores": os.cpu_count(),
                          "torch": torch.__version__, "lightning": L.__version__},
              "commit": commit,
              "settings": vars(args), "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for repeat in range(args.repeats):
            settings = [(model, mode, packing, world) for model in args.models.split(",")
                        for mode in args.modes.split(",") if f"{model}:{mode}" not in args.skip.split(",")
                        for packing in (v == "true" for v in args.packing.split(","))
                        for world in (int(w) for w in args.worlds.split(","))]
            for (model, mode, packing, world), (code, code_dir) in (
                    (setting, code) for setting in settings for code in codes):
                name = (f"{model}-{mode}-{'packed' if packing else 'padded'}-w{world}-r{repeat}"
                        + (f"-{code}" if code else ""))
                out = root / "times" / name
                out.parent.mkdir(parents=True, exist_ok=True)
                before = load()
                wall = run(root, run_overrides(
                    model, packing, world, mode, args.steps, args.warmup, args.micro_batch,
                    args.accumulation, args.log_every, out, name,
                    args.token_budget if packing else None, args.records, args.extra),
                    world, name, code_dir)
                ranks = [json.loads(Path(f"{out}-rank{r}.json").read_text()) for r in range(world)]
                result["runs"].append({
                    "code": code, "model": model, "mode": mode, "packing": packing, "world": world,
                    "repeat": repeat, "wall_seconds": round(wall, 1), "load_before": before,
                    "load_after": load(), "compile": ranks[0]["compile"],
                    "ranks": [summarise(r["micro_batches"], args.warmup, args.log_every) for r in ranks]})
                if args.out:
                    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
