"""crm-train: compose the config, then data -> tokenizer -> model -> fit -> export -> evaluate
(metrics.json). `train` reads top to bottom as the run does. The config's schema is TrainConfig
below: each group and section is the dataclass of the layer that reads it (its torch-free
`config` module: crm.models.config, crm.data.config, crm.training.config)."""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import MISSING, DictConfig, OmegaConf

from crm.cli.errors import one_line_config_errors
from crm.cli.multirun import sweep_jobs
from crm.cli.record import save_run_record
from crm.cli.scorer import transformers_bars
from crm.cli.schema import (PathsConfig, benchmark_config, check_test_files, register_schema,
                            settings)
from crm.core.errors import ConfigError
from crm.core.files import write_json
from crm.core.prompts import PromptTemplate
from crm.data.config import StreamConfig, StreamSettings
from crm.data.demo import DemoConfig, demo_shard_dir, prepare_demo
from crm.data.transforms import DIRECTIONS, NOISES, TransformConfig, TransformSettings, tie_policy
from crm.evaluation.benchmarks import Benchmark, describe, load_benchmark
from crm.models.config import LoraConfig, LossConfig, ModelConfig
from crm.training import checks
from crm.training.config import (BatchSettings, DeviceSettings, LoggerConfig, OptimConfig,
                                 ParallelConfig, StartSettings)
from crm.training.sweeps import parse_overrides

if TYPE_CHECKING:
    from crm.training.resolve import Resolved

# torch, Lightning and transformers load inside `train`, once the config is composed and checked:
# `crm-train --help` and a refused setting answer in about a second, not after four seconds of
# imports (benchmarks/cli_start.py measures it; tests/test_layers.py keeps it so).

log = logging.getLogger(__name__)


# -- the config's schema: types here, values and their documentation in configs/ -----------------

@dataclass
class NoiseConfig:
    name: str = MISSING  # configs/noise/<name>.yaml: the criteria noise

    def __post_init__(self):
        if self.name not in NOISES:
            raise ValueError(f"noise={self.name}: expected one of {', '.join(NOISES)}")


@dataclass
class DirectionConfig:
    name: str = MISSING  # configs/direction/<name>.yaml: original | reverse | random | curriculum
    warmup: str = "original"  # the curriculum's first direction, for warmup_steps optimizer steps
    warmup_steps: int = 0
    then: str | None = None  # the curriculum's direction after them; None: `name` is the direction

    def __post_init__(self):
        for key, value in (("then" if self.then else "name", self.then or self.name),
                           ("warmup", self.warmup)):
            if value not in DIRECTIONS:
                raise ValueError(f"direction.{key}={value}: expected one of {', '.join(DIRECTIONS)}")


@dataclass
class DataConfig:
    name: str = MISSING  # configs/data/<name>.yaml
    path: str = MISSING  # the shard dir (manifest.json)
    demo: DemoConfig | None = None  # data=demo: generated and sharded into `path` on first use
    test_files: list[str] = field(default_factory=list)


@dataclass
class PreemptionConfig:
    signal: str = MISSING  # the signal's name
    requeue_command: str = MISSING

    def __post_init__(self):
        if not isinstance(getattr(signal, self.signal, None), signal.Signals):
            raise ValueError(f"preemption.signal={self.signal}: not a signal name (SIGUSR1, ...)")


@dataclass
class PerfConfig:
    log_every_n_steps: int = MISSING
    gpu: str | None = MISSING
    peak_tflops: float | None = MISSING


@dataclass
class TrainConfig:
    """configs/train.yaml: one field per key, in its order; a group is its options' schema."""

    model: ModelConfig = field(default_factory=ModelConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    noise: NoiseConfig = MISSING
    direction: DirectionConfig = MISSING
    data: DataConfig = MISSING
    trainer: dict[str, Any] = MISSING  # Lightning Trainer arguments, passed as they are
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    paths: PathsConfig = MISSING
    name: str = MISSING
    seed: int = MISSING
    torch_threads: int | None = MISSING
    global_batch_size: int = MISSING
    micro_batch_size: Any = MISSING  # a number, or auto
    max_micro_batch_size: int = MISSING
    optim: OptimConfig = field(default_factory=OptimConfig)
    transform: TransformSettings = field(default_factory=TransformSettings)
    stream: StreamSettings = field(default_factory=StreamSettings)
    template: PromptTemplate = field(default_factory=PromptTemplate)
    compile: Any = MISSING  # auto, true or false (crm.models.compile); Any: a str would take true as "True"
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    preemption: PreemptionConfig = MISSING
    perf: PerfConfig = MISSING
    callbacks: dict[str, Any] = MISSING  # name -> a `_target_` spec
    val_every_n_steps: int = MISSING
    early_stopping_patience: int = MISSING
    save_every_n_steps: int = MISSING
    resume: Any = MISSING  # auto, a path, or false
    export: bool = MISSING
    evaluate: bool = MISSING
    benchmarks: dict[str, str] = MISSING  # benchmark name -> its local copy (configs/benchmark/)

    def __post_init__(self):
        # Decided here, once, so that every reader (the stream, the head, the checks) and the
        # run's record see the same policy, never `auto`.
        self.transform = replace(self.transform, ties=tie_policy(self.transform.ties, self.loss.kind,
                                                                 self.loss.ties))

    def start_settings(self) -> StartSettings:
        """What the run's automatic choices are decided from (crm.training.resolve)."""
        return StartSettings(
            devices=DeviceSettings.of(self.trainer),
            batch=BatchSettings(self.global_batch_size, self.micro_batch_size,
                                self.max_micro_batch_size),
            model=self.model, loss=self.loss, lora=self.lora, parallel=self.parallel,
            compile=self.compile, packing=self.stream.packing, max_tokens=self.stream.max_tokens,
            transform=self.transform)


register_schema("train", TrainConfig)


def train(cfg: DictConfig) -> dict | None:
    """The run; its metrics on global rank 0, None on the other ranks."""
    started = time.time()
    # Rows of varying length fragment CUDA's caching allocator; expandable segments let freed blocks
    # grow into the next batch's sizes (an H100 at 0.6B reserved 55.8 GiB instead of 70, at the same
    # speed: docs/PERFORMANCE.md section 4). Read when CUDA first allocates, so set before anything.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    run: TrainConfig = settings(cfg)
    check_config(run)
    later_jobs = check_sweep()
    log_per_rank()  # before check_job, whose warnings go to each rank's own log
    job = check_job(run, run_dir, decide_resume=True)
    resolved = job.resolved
    check_later_jobs(later_jobs, run_dir)
    if job.resume_decided:
        save_run_record(cfg)

    import lightning as L
    import torch

    from crm.data.manifest import load_manifest
    from crm.data.reader import training_texts
    from crm.evaluation.accuracy import evaluate_files
    from crm.evaluation.benchmarks import score_benchmarks
    from crm.evaluation.criteria_check import check_validation
    from crm.inference.scorer import CRMScorer
    from crm.models.factory import build_crm
    from crm.models.tokenizer import load_or_train_tokenizer
    from crm.training.datamodule import CRMDataModule
    from crm.training.loggers import make_logger, plot_curves
    from crm.training.module import CRMModule
    from crm.training.trainer import AgreedResume, leave_process_group, make_trainer

    transformers_bars(sys.stderr.isatty())  # Lightning's bar is trainer.enable_progress_bar's
    L.seed_everything(run.seed, workers=True)
    if run.torch_threads:
        torch.set_num_threads(run.torch_threads)
    run_config = resolved.into(OmegaConf.to_container(cfg, resolve=True))
    sweep = sweep_info(run)
    logger = make_logger(run.logger, run_dir, run.name, sweep)
    if logger:
        logger.log_hyperparams({**run_config, "sweep": sweep or {}})
    manifest = load_manifest(job.shard_dir)  # read once: the tokenizer's texts and the stream
    tokenizer = load_or_train_tokenizer(
        run.model.tokenizer or run.model.path, run_dir / "tokenizer", vocab_size=run.model.vocab_size,
        texts=lambda: training_texts(manifest.shards("train"), run.template))
    parallel = replace(run.parallel, sharding=resolved.sharding,  # the section as it runs
                       timeout_minutes=resolved.timeout_minutes)
    callbacks = run_callbacks(run, run_dir, tokenizer, with_logger=bool(logger),
                              device=resolved.device, timeout=parallel.timeout)
    accum = resolved.accumulation
    stream = StreamConfig(**{**asdict(run.stream), "packing": resolved.packing},
                          batch_size=resolved.micro_batch_size, gather_views=resolved.device != "cuda",
                          mode=run.loss.kind, seed=run.seed, template=run.template)
    datamodule = CRMDataModule(manifest, tokenizer, stream, job.transform, step_batches=accum)
    make_crm = partial(build_crm, replace(run.model, attention=resolved.attention), run.loss,
                       num_labels=job.transform.num_labels, pad_token_id=tokenizer.pad_token_id,
                       vocab_size=len(tokenizer), compiled=resolved.compile, lora=run.lora)
    module = CRMModule(make_crm, run.optim, parallel, run_config=run_config, compile=resolved.compile,
                       lora=resolved.lora)
    trainer = make_trainer(run.trainer, world=resolved.world_size, accumulation=accum,
                           val_every_n_steps=run.val_every_n_steps,
                           callbacks=list(callbacks.values()), logger=logger, run_dir=run_dir,
                           parallel=parallel)
    resume = job.resume
    if not job.resume_decided:  # rank 0 decides, inside fit, once the ranks are connected
        resume = AgreedResume(run.resume, run_dir, run.data.path,
                              on_agreed=partial(save_run_record, cfg))
        resume.trainer = trainer
    trainer.fit(module, datamodule=datamodule, ckpt_path=resume, weights_only=True)
    resumed_from = resume.decide() if isinstance(resume, AgreedResume) else resume
    # Every rank leaves before rank 0's long work (export, evaluation): none waits in a collective.
    leave_process_group(trainer)

    # A late warning signal is ignored until here (crm.training.preemption), on every rank.
    try:
        best, throughput = callbacks["best"], callbacks.get("throughput")
        metrics = {
            "run_dir": str(run_dir),
            "preempted": callbacks["preemption"].preempted,
            "resolved": resolved.record(),
            "train": {"global_step": trainer.global_step,
                      "best_val_loss": _float(best.best_model_score), "best_checkpoint": best.best_model_path,
                      "resumed_from": resumed_from, "micro_batch_size": resolved.micro_batch_size,
                      "accumulation": accum, "world_size": trainer.world_size,
                      "per_rank_memory": callbacks["sharding"].per_rank,
                      "lora_trainable_parameters": resolved.lora and resolved.lora["trainable_parameters"],
                      "throughput": throughput.last if throughput else None,
                      "wall_seconds": round(time.time() - started, 1)},
        }
        if not trainer.is_global_zero:
            return None
        if "export" in callbacks:
            callbacks["export"].export(trainer, module)
            if not metrics["preempted"] and run.evaluate:
                scorer = CRMScorer.from_export(run_dir / "export", batch_size=64)
                metrics["shortcut_check"] = check_validation(scorer, job.shard_dir)
                if run.data.test_files:
                    metrics["eval"], _ = evaluate_files(scorer, run.data.test_files)
                if job.benchmarks:
                    metrics["benchmarks"] = score_benchmarks(scorer, job.benchmarks, run_dir / "benchmarks",
                                                             logger, trainer.global_step)
        curves = run_dir / "csv" / "metrics.csv"
        if run.logger.name == "csv" and curves.is_file():
            plot_curves(curves, run=f"{run.name} · {run_dir.name}")
        metrics["wall_seconds"] = round(time.time() - started, 1)
        keep_earlier_figures(metrics["train"], run_dir / "metrics.json")
        write_json(run_dir / "metrics.json", metrics)
        return metrics
    finally:
        callbacks["preemption"].release()


def keep_earlier_figures(train: dict, earlier: Path) -> None:
    """A finished run re-run resumes at its last step and trains none, so its throughput and
    memory figures are empty: the process that trained to this step measured them, and they are
    kept (`figures_from` says so) rather than replaced by nothing."""
    if not earlier.is_file():
        return
    try:
        before = json.loads(earlier.read_text(encoding="utf-8")).get("train") or {}
    except (OSError, ValueError, AttributeError):
        return
    if before.get("global_step") != train["global_step"]:
        return
    kept = [key for key in ("throughput", "per_rank_memory") if not train[key] and before.get(key)]
    for key in kept:
        train[key] = before[key]
    if kept:
        train["figures_from"] = before.get("figures_from") or "an earlier process (this one trained no step)"


def read_benchmarks(run: TrainConfig) -> list[Benchmark]:
    """The benchmarks global rank 0 scores after fit, read and checked at start: a file not in its
    layout stops the run before training. Every rank checks them, as each must stop by itself (no
    process group exists yet to share rank 0's verdict), and only global rank 0 keeps them."""
    if not run.benchmarks:
        return []
    benchmarks = [load_benchmark(benchmark_config(name, path)) for name, path in run.benchmarks.items()]
    return benchmarks if not launcher_rank() else []


# Lightning's own order (lightning.fabric.utilities.rank_zero._get_rank; tests/test_pinned_internals.py
# checks that it still is): SLURM_PROCID is set even where SLURM does not start the ranks.
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")


def launcher_rank() -> int:
    """The global rank the launcher gave this process, as Lightning reads it, without importing
    Lightning (3 s, more than a refused setting may take): 0 where no launcher set one."""
    for name in RANK_VARIABLES:
        if name in os.environ:
            return int(os.environ[name])
    return 0


def log_per_rank() -> None:
    """Hydra's <job>.log (train.log) for global rank 0 alone; rank N writes <job>.rankN.log beside it.

    Every rank of every node runs this command with the same run dir, and Hydra opens the same
    file in each: appended to by all, its lines interleave. The rank is what the launcher set
    (`launcher_rank`), before any process group exists.
    """
    rank = launcher_rank()
    if not rank:
        return
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, logging.FileHandler)]:
        path = Path(handler.baseFilename)
        own = logging.FileHandler(path.with_name(f"{path.stem}.rank{rank}{path.suffix}"))
        own.setFormatter(handler.formatter)
        own.setLevel(handler.level)
        root.removeHandler(handler)
        handler.close()
        root.addHandler(own)


class Job(NamedTuple):
    """What `check_job` decided and read for a run, each once."""

    resolved: Resolved  # every automatic choice, the layout (device, world size, batch plan) first
    transform: TransformConfig  # with the curriculum in the run's micro batches
    shard_dir: Path
    benchmarks: list[Benchmark]  # global rank 0's to score after fit
    resume_decided: bool  # a one-process run's, with decide_resume; several ranks agree inside fit
    resume: str | None  # the checkpoint to resume, where decided


def check_job(run: TrainConfig, run_dir: Path, *, decide_resume: bool = False) -> Job:
    """What a run decides and checks before Lightning loads (3 s) and anything trains: the
    benchmarks, the trainer group, the run laid out (`lay_out`: device, world size, batch plan),
    with `decide_resume` a one-process run's resume (another data set's checkpoint is refused
    before the model's libraries load, and before the tokenizer is trained into the run dir;
    several ranks agree on theirs inside fit, AgreedResume, which refuses it alike), the test
    files and the data against the settings (README-format records under a direction that needs
    the losing side's criteria included), then the rest of the automatic choices (`resolve`,
    whose model shape and compiler check import transformers and inductor: 2 s). The user's files
    are read before `resolve`; the demo's data (its test files among them) is generated only once
    every setting is accepted."""
    from crm.training.resolve import lay_out, resolve
    from crm.training.resume import resolve_resume

    start = run.start_settings()
    benchmarks = read_benchmarks(run)
    checks.check_trainer(run.trainer)
    layout = lay_out(start)
    direction = run.direction
    transform = TransformConfig(**asdict(run.transform), noise=run.noise.name,
                                direction=direction.then or direction.name,
                                warmup_direction=direction.warmup,
                                # the curriculum counts optimizer steps, the stream a rank's micro batches
                                warmup_batches=direction.warmup_steps * layout.accumulation)
    resume_decided = decide_resume and layout.world_size == 1
    resume = resolve_resume(run.resume, run_dir, run.data.path) if resume_decided else None

    def check_files(shard_dir: Path) -> Path:
        check_test_files(run.data.test_files, "data.test_files")
        checks.check_data_fits(run, shard_dir, run_dir, layout.world_size, transform)
        return shard_dir

    shard_dir = None if run.data.demo else check_files(Path(run.data.path))
    resolved = resolve(start, layout)  # before Lightning and the training stack are imported
    if shard_dir is None:
        own = demo_shard_dir(run.data.demo)
        if os.path.realpath(run.data.path) != os.path.realpath(own):
            # The demo's data is generated into its cache: a data.path of the user's is their
            # shards, and the demo must neither train on them by name nor overwrite them.
            raise ConfigError(f"data.path={run.data.path} with data=demo: the demo's data lives "
                              f"in {own}; add data=shards to train on the shards at {run.data.path}")
        shard_dir = check_files(prepare_demo(run.data.demo))
    return Job(resolved, transform, shard_dir, benchmarks, resume_decided, resume)


def check_later_jobs(jobs: list[tuple[int, list[str], DictConfig]], run_dir: Path) -> None:
    """Job 0 of a multirun runs every later job's `check_job` before it trains: a refusal that
    depends on the data (README-format shards with direction=random) stops the sweep in seconds,
    naming its job, not after job 0 has trained. Their warnings and notes are left to each job's
    own run (here they would read as job 0's)."""
    from crm.core.records import RecordError

    logging.disable(logging.WARNING)
    try:
        for number, overrides, job_cfg in jobs:
            try:
                check_job(settings(job_cfg), run_dir)
            except (ConfigError, RecordError) as exc:
                raise ConfigError(f"sweep job {number} ({' '.join(overrides)}), checked before "
                                  f"job 0 trains: {exc}") from None
    finally:
        logging.disable(logging.NOTSET)


def check_sweep() -> list[tuple[int, list[str], DictConfig]]:
    """A multirun's first job composes and checks every job's config as its own was: a typo in a
    plain sweep value (`transform.ties=drop,kepp`) stops the sweep before job 0 trains, not after.
    (Hydra's sweeper composes each job before it runs it, which finds a key or group that does
    not exist, not a value its dataclass refuses.) Returns the later jobs (number, overrides,
    config) for `check_later_jobs`; none outside job 0 of a multirun."""
    from hydra import compose
    from hydra._internal.utils import get_args_parser
    from hydra.errors import HydraException
    from hydra.types import RunMode

    from crm.cli.errors import describe as describe_hydra_error

    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN or hydra_cfg.job.num != 0:
        return []
    arguments = get_args_parser().parse_known_args(sys.argv[1:])[0].overrides
    try:
        jobs = sweep_jobs(hydra_cfg.sweeper.get("params"), arguments)
    except HydraException:
        return []  # not the command line the sweep came from (a launcher's own process)
    task = [o for o in hydra_cfg.overrides.task if not o.lstrip("+~").startswith("hydra.")]
    if not jobs or sorted(jobs[0]) != sorted(task):
        return []  # the same: job 0 of another sweep is no guide to this one
    later = []
    for number, overrides in enumerate(jobs[1:], start=1):
        try:
            job_cfg = compose(config_name=hydra_cfg.job.config_name, overrides=overrides)
            check_config(settings(job_cfg))
        except (ValueError, HydraException) as exc:
            reason = describe_hydra_error(exc) if isinstance(exc, HydraException) else exc
            raise ConfigError(f"sweep job {number} ({' '.join(overrides)}), checked before job 0 "
                              f"trains: {reason}") from None
        later.append((number, overrides, job_cfg))
    return later


def check_config(run: TrainConfig) -> None:
    """Settings that cannot work, refused before anything runs (the rest: `check_job`)."""
    if str(run.trainer.get("precision")).endswith("-mixed") and run.model.dtype != "float32":
        # Lightning's mixed precision autocasts the compute and never converts the parameters:
        # built in bfloat16, the weights, gradients and AdamW states would all be bfloat16.
        raise ConfigError(f"trainer.precision={run.trainer['precision']} keeps float32 master "
                          f"weights, but model.dtype={run.model.dtype} builds the parameters in that "
                          "dtype: set model.dtype=float32, or trainer.precision=bf16-true")
    model = run.model
    if not (model.path or model.tokenizer or model.vocab_size):
        raise ConfigError(f"model={model.name}: no model.path or model.tokenizer to read a "
                          "tokenizer from, and no model.vocab_size to train one; set model.path to "
                          "a local checkpoint dir")
    for key, value in (("model.path", model.path), ("model.tokenizer", model.tokenizer)):
        if value and not Path(value).is_dir():
            raise ConfigError(f"{key}={value}: no such directory (a local HF checkpoint dir)")
    if not run.data.demo and not (Path(run.data.path) / "manifest.json").is_file():
        raise ConfigError(f"data.path={run.data.path}: no manifest.json there (make shards with "
                          "`crm-data shard FILE.jsonl DIR`)")


def run_callbacks(run: TrainConfig, run_dir: Path, tokenizer, *, with_logger: bool,
                  device: str = "cpu", timeout=None) -> dict:
    """The run's callbacks by name (train reads some of them back), then the `callbacks` group's;
    `device`: the run's (Resolved.device)."""
    import lightning as L
    from hydra.utils import instantiate

    from crm.training.callbacks import CheckpointCard, ExportBest, ModelSize, ShardingReport
    from crm.training.preemption import Preemption
    from crm.training.progress import progress_bar
    from crm.training.throughput import Throughput

    ckpt_dir = run_dir / "checkpoints"
    callbacks = {
        "best": L.pytorch.callbacks.ModelCheckpoint(  # the best model by val/loss
            dirpath=ckpt_dir, filename="best", monitor="val/loss", mode="min", save_top_k=1,
            enable_version_counter=False),
        "last": L.pytorch.callbacks.ModelCheckpoint(  # last.ckpt every save_every_n_steps, to resume
            dirpath=ckpt_dir, save_top_k=0, save_last=True, every_n_train_steps=run.save_every_n_steps,
            enable_version_counter=False),
        "card": CheckpointCard(tokenizer, kind=run.loss.kind, template=run.template,
                               max_tokens=run.stream.max_tokens),
        "preemption": Preemption(str(ckpt_dir / "last.ckpt"), signum=getattr(signal, run.preemption.signal),
                                 requeue_command=run.preemption.requeue_command, timeout=timeout),
        "sharding": ShardingReport(),
        "size": ModelSize(),
    }
    perf = run.perf
    if perf.log_every_n_steps:
        peak = None if perf.peak_tflops is None else perf.peak_tflops * 1e12
        callbacks["throughput"] = Throughput(perf.log_every_n_steps, gpu=perf.gpu, peak_flops=peak)
    if run.trainer.get("enable_progress_bar", True):  # counted in micro batches (crm.training.progress)
        # On CUDA it redraws every log_every_n_steps and shows no loss (CRMModule._log_sums): a
        # number read from the GPU would make the host wait at each refresh.
        cuda = device == "cuda"
        callbacks["progress"] = progress_bar(run.trainer.get("log_every_n_steps", 50) if cuda else None)
    if with_logger:  # LearningRateMonitor refuses a Trainer without a logger (logger=none)
        callbacks["lr"] = L.pytorch.callbacks.LearningRateMonitor(logging_interval="step")
    if run.early_stopping_patience:
        callbacks["early_stopping"] = L.pytorch.callbacks.EarlyStopping(
            monitor="val/loss", patience=run.early_stopping_patience, mode="min")
    if run.export:
        callbacks["export"] = ExportBest(run_dir / "export", callbacks["card"],
                                         preemption=callbacks["preemption"])
    for name, spec in run.callbacks.items():
        if name in callbacks:
            raise ConfigError(f"callbacks.{name}: the name of one of crm's own callbacks; choose another")
        callbacks[name] = instantiate(spec)
    return callbacks


def run_plan_arguments(train_overrides: list[str]) -> list[str]:
    """crm-plan's settings for the crm-train run that `train_overrides` compose: its model, row
    length, packing, batch, loss kind, sharding, gradient sync, compilation and LoRA as the run will have
    them, `experiment=` and every other group included (launch/train.sbatch plans with these;
    here, beside train.yaml's schema, which composing needs)."""
    from hydra import compose, initialize_config_module

    with initialize_config_module(version_base="1.3", config_module="crm_configs"):
        cfg = compose("train", overrides=list(train_overrides))
    args = [f"model={cfg.model.name}", f"seq_len={cfg.stream.max_tokens}",
            f"global_batch_size={cfg.global_batch_size}",
            f"max_micro_batch_size={cfg.max_micro_batch_size}", f"kind={cfg.loss.kind}",
            f"sharding={cfg.parallel.sharding}", f"grad_sync={cfg.parallel.grad_sync}",
            f"activation_checkpointing={str(cfg.parallel.activation_checkpointing).lower()}",
            f"lora.rank={cfg.lora.rank}", f"lora.target_modules=[{','.join(cfg.lora.target_modules)}]"]
    # The plan is a GPU run's: packed and compiled unless the run turns them off.
    if str(cfg.stream.packing).lower() == "false":
        args.append("packing=false")
    if str(cfg.compile).lower() == "false":
        args.append("compile=false")
    return args


def sweep_info(run: TrainConfig) -> dict | None:
    """In a multirun: the sweep's group (the logger's group, else the run name) and this job's
    axis values (its overrides), so that wandb groups and tags a sweep's runs."""
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return None
    return {"group": run.logger.group or run.name,
            "axes": parse_overrides(hydra_cfg.overrides.task), "job": hydra_cfg.job.num}


def _float(x) -> float | None:
    return None if x is None else round(float(x), 6)


@hydra.main(version_base="1.3", config_path="pkg://crm_configs", config_name="train")
@one_line_config_errors
def main(cfg: DictConfig) -> None:
    metrics = train(cfg)
    if metrics is None:  # not global rank 0
        return
    for path, m in metrics.get("eval", {}).items():
        print(f"{Path(path).stem:>20}: accuracy {m['accuracy_mean']:.4f} "
              f"(given {m['accuracy']:.4f}, swapped {m['accuracy_swapped']:.4f}, "
              f"flip {m['flip_rate']:.4f})")
    for result in metrics.get("benchmarks", {}).values():
        print(describe(result))
    print(f"metrics: {metrics['run_dir']}/metrics.json")


if __name__ == "__main__":
    sys.exit(main())
