"""crm-train: compose the config, then data -> tokenizer -> model -> fit -> export -> evaluate
(metrics.json). `train` reads top to bottom as the run does; the helpers below it only translate
config groups into the library's arguments."""
from __future__ import annotations

import logging
import os
import signal
import sys
import time
from functools import partial
from pathlib import Path

import hydra
import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from crm.cli.common import model_arch, one_line_config_errors
from crm.core.errors import ConfigError
from crm.core.files import write_json
from crm.core.prompts import PromptTemplate
from crm.data.demo import prepare_demo
from crm.data.manifest import load_manifest
from crm.data.reader import training_texts
from crm.data.stream import StreamConfig
from crm.data.transforms import TransformConfig
from crm.evaluation.accuracy import evaluate_files
from crm.inference.scorer import CRMScorer
from crm.models import compile as compiling
from crm.models.backbone import DTYPES
from crm.models.factory import build_crm
from crm.models.tokenizer import load_or_train_tokenizer
from crm.training.callbacks import CheckpointCard, ExportBest, ShardingReport
from crm.training.datamodule import CRMDataModule
from crm.training.loggers import make_logger
from crm.training.module import CRMModule, OptimConfig
from crm.training.parallel import ParallelConfig
from crm.training.preemption import Preemption
from crm.training.sweeps import parse_overrides
from crm.training.throughput import Throughput
from crm.training.trainer import batch_plan, device_type, make_trainer, resolve_resume, world_size

log = logging.getLogger(__name__)


def train(cfg: DictConfig) -> dict | None:
    """The run; its metrics on global rank 0, None on the other ranks."""
    started = time.time()
    # Rows of varying length fragment CUDA's caching allocator; expandable segments let freed blocks
    # grow into the next batch's sizes (an H100 at 0.6B reserved 55.8 GiB instead of 70, at the same
    # speed: docs/PERFORMANCE.md section 4). Read when CUDA first allocates, so set before anything.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    check_config(cfg)
    trainer_args = OmegaConf.to_container(cfg.trainer, resolve=True)
    compile = compile_layers(cfg, trainer_args)
    L.seed_everything(cfg.seed, workers=True)
    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)

    shard_dir = prepare_demo(cfg.data.path, **cfg.data.demo) if cfg.data.demo else Path(cfg.data.path)
    template = prompt_template(cfg)
    tokenizer = load_or_train_tokenizer(
        cfg.model.tokenizer or cfg.model.path, run_dir / "tokenizer", vocab_size=cfg.model.vocab_size,
        texts=lambda: training_texts(load_manifest(shard_dir).shards("train"), template))
    micro_batch, accum = batch_plan(cfg.global_batch_size, cfg.micro_batch_size,
                                    world_size(trainer_args), cfg.max_micro_batch_size)
    datamodule = CRMDataModule(shard_dir, tokenizer, stream_config(cfg, template, micro_batch),
                               transform_config(cfg, accum), num_workers=cfg.stream.num_workers)
    run_config = OmegaConf.to_container(cfg, resolve=True)
    module = CRMModule(partial(build_crm, cfg.loss.kind, **crm_kwargs(cfg, tokenizer, datamodule)),
                       OptimConfig(**cfg.optim), ParallelConfig(**cfg.parallel),
                       run_config=run_config, compile=compile)
    sweep = sweep_info(cfg)
    logger = make_logger(OmegaConf.to_container(cfg.logger), run_dir, cfg.name, sweep)
    if logger:
        logger.log_hyperparams({**run_config, "sweep": sweep or {}})
    callbacks = run_callbacks(cfg, run_dir, tokenizer, template, with_logger=bool(logger))
    trainer = make_trainer(trainer_args, accumulation=accum, val_every_n_steps=cfg.val_every_n_steps,
                           callbacks=list(callbacks.values()), logger=logger, run_dir=run_dir)
    resumed_from = resolve_resume(cfg.resume, run_dir)
    trainer.fit(module, datamodule=datamodule, ckpt_path=resumed_from, weights_only=True)
    # Export happened inside fit (ExportBest, run_dir/export): gathering FSDP shards needs every rank.

    best, throughput = callbacks["best"], callbacks.get("throughput")
    metrics = {
        "run_dir": str(run_dir),
        "preempted": callbacks["preemption"].preempted,
        "train": {"global_step": trainer.global_step,
                  "best_val_loss": _float(best.best_model_score), "best_checkpoint": best.best_model_path,
                  "resumed_from": resumed_from, "micro_batch_size": micro_batch,
                  "accumulation": accum, "world_size": trainer.world_size,
                  "per_rank_memory": callbacks["sharding"].per_rank,
                  "throughput": throughput.last if throughput else None,
                  "wall_seconds": round(time.time() - started, 1)},
    }
    if not trainer.is_global_zero:
        return None
    if "export" in callbacks and not metrics["preempted"] and cfg.evaluate and cfg.data.test_files:
        scorer = CRMScorer.from_export(run_dir / "export", batch_size=64)
        metrics["eval"], _ = evaluate_files(scorer, cfg.data.test_files)
    metrics["wall_seconds"] = round(time.time() - started, 1)
    write_json(run_dir / "metrics.json", metrics)
    return metrics


def check_config(cfg: DictConfig) -> None:
    """Settings that cannot work, refused before anything runs."""
    if str(cfg.trainer.precision).endswith("-mixed") and cfg.model.dtype != "float32":
        # Lightning's mixed precision autocasts the compute and never converts the parameters:
        # built in bfloat16, the weights, gradients and AdamW states would all be bfloat16.
        raise ConfigError(f"trainer.precision={cfg.trainer.precision} keeps float32 master weights, "
                         f"but model.dtype={cfg.model.dtype} builds the parameters in that dtype: "
                         "set model.dtype=float32, or trainer.precision=bf16-true")
    if not (cfg.model.path or cfg.model.tokenizer or cfg.model.vocab_size):
        raise ConfigError(f"model={cfg.model.name}: no model.path or model.tokenizer to read a "
                         "tokenizer from, and no model.vocab_size to train one; set model.path to "
                         "a local checkpoint dir")
    for key in ("model.path", "model.tokenizer"):
        value = OmegaConf.select(cfg, key)
        if value and not Path(value).is_dir():
            raise ConfigError(f"{key}={value}: no such directory (a local HF checkpoint dir)")
    if not cfg.data.demo and not (Path(cfg.data.path) / "manifest.json").is_file():
        raise ConfigError(f"data.path={cfg.data.path}: no manifest.json there (make shards with "
                          "`crm-data shard FILE.jsonl DIR`)")


def compile_layers(cfg: DictConfig, trainer_args: dict) -> bool:
    """Whether to compile each decoder layer: `compile` for the trainer's device (auto: on CUDA,
    where inductor can; compile=true where it cannot is refused at start)."""
    device = device_type(trainer_args)
    try:
        wanted = compiling.resolve(cfg.compile, device)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    reason = compiling.why_not_compilable(device) if wanted else None
    if reason and cfg.compile is True:
        raise ConfigError(f"compile=true on {device}: {reason}; set compile=false (or auto)")
    if reason:
        log.warning("compile=auto: decoder layers stay eager on %s: %s", device, reason)
        return False
    return wanted


def prompt_template(cfg: DictConfig) -> PromptTemplate:
    """crm's prompt wording with the fields `template` sets (null keeps the default)."""
    fields = OmegaConf.to_container(cfg.template, resolve=True)
    try:
        return PromptTemplate(**{k: v for k, v in fields.items() if v is not None})
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"template: {exc}") from None


def stream_config(cfg: DictConfig, template: PromptTemplate, micro_batch: int) -> StreamConfig:
    s = cfg.stream
    return StreamConfig(batch_size=micro_batch, mode=cfg.loss.kind, seed=cfg.seed,
                        max_tokens=s.max_tokens, min_turn_tokens=s.min_turn_tokens,
                        shuffle_buffer=s.shuffle_buffer, window_batches=s.window_batches,
                        template=template)


def transform_config(cfg: DictConfig, accumulation: int = 1) -> TransformConfig:
    """The direction/noise groups and `transform`; the direction curriculum's optimizer steps
    become micro batches of one rank."""
    t, direction = cfg.transform, cfg.direction
    return TransformConfig(direction=direction.get("then", direction.name), noise=cfg.noise.name,
                           arithmetic=t.arithmetic, swap_prob=t.swap_prob, ties=t.ties,
                           redraw_each_epoch=t.redraw_each_epoch,
                           warmup_direction=direction.get("warmup", "original"),
                           warmup_batches=direction.get("warmup_steps", 0) * accumulation)


def crm_kwargs(cfg: DictConfig, tokenizer, datamodule: CRMDataModule) -> dict:
    """crm.models.factory.build_crm's arguments from the model and loss groups."""
    return dict(num_labels=datamodule.transform.num_labels, path=cfg.model.path,
                arch=model_arch(cfg.model, len(tokenizer)), attention=cfg.model.attention,
                dtype=DTYPES[cfg.model.dtype], pad_token_id=tokenizer.pad_token_id,
                margin=cfg.loss.get("margin", 0.0), center_coef=cfg.loss.get("center_coef", 0.0))


def run_callbacks(cfg: DictConfig, run_dir: Path, tokenizer, template: PromptTemplate, *,
                  with_logger: bool) -> dict[str, L.Callback]:
    """The run's callbacks by name (train reads some of them back), then the `callbacks` group's."""
    ckpt_dir = run_dir / "checkpoints"
    callbacks = {
        "best": L.pytorch.callbacks.ModelCheckpoint(  # the best model by val/loss
            dirpath=ckpt_dir, filename="best", monitor="val/loss", mode="min", save_top_k=1,
            enable_version_counter=False),
        "last": L.pytorch.callbacks.ModelCheckpoint(  # last.ckpt every save_every_n_steps, to resume
            dirpath=ckpt_dir, save_top_k=0, save_last=True, every_n_train_steps=cfg.save_every_n_steps,
            enable_version_counter=False),
        "card": CheckpointCard(tokenizer, kind=cfg.loss.kind, template=template,
                               max_tokens=cfg.stream.max_tokens),
        "preemption": Preemption(str(ckpt_dir / "last.ckpt"), signum=getattr(signal, cfg.preemption.signal),
                                 requeue_command=cfg.preemption.requeue_command),
        "sharding": ShardingReport(),
    }
    if cfg.perf.log_every_n_steps:
        peak = None if cfg.perf.peak_tflops is None else cfg.perf.peak_tflops * 1e12
        callbacks["throughput"] = Throughput(cfg.perf.log_every_n_steps, gpu=cfg.perf.gpu, peak_flops=peak)
    if cfg.trainer.enable_progress_bar and device_type(OmegaConf.to_container(cfg.trainer)) == "cuda":
        # The bar reads the logged loss as a number: each refresh makes the host wait for the GPU.
        callbacks["progress"] = L.pytorch.callbacks.TQDMProgressBar(
            refresh_rate=cfg.trainer.log_every_n_steps)
    if with_logger:  # LearningRateMonitor refuses a Trainer without a logger (logger=none)
        callbacks["lr"] = L.pytorch.callbacks.LearningRateMonitor(logging_interval="step")
    if cfg.early_stopping_patience:
        callbacks["early_stopping"] = L.pytorch.callbacks.EarlyStopping(
            monitor="val/loss", patience=cfg.early_stopping_patience, mode="min")
    if cfg.export:
        callbacks["export"] = ExportBest(run_dir / "export", callbacks["card"],
                                         preemption=callbacks["preemption"])
    for name, spec in (cfg.callbacks or {}).items():
        if name in callbacks:
            raise ConfigError(f"callbacks.{name}: the name of one of crm's own callbacks; choose another")
        callbacks[name] = instantiate(spec)
    return callbacks


def sweep_info(cfg: DictConfig) -> dict | None:
    """In a multirun: the sweep's group (the logger's group, else the run name) and this job's
    axis values (its overrides), so that wandb groups and tags a sweep's runs."""
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return None
    return {"group": cfg.logger.get("group") or cfg.name,
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
    print(f"metrics: {metrics['run_dir']}/metrics.json")


if __name__ == "__main__":
    sys.exit(main())
