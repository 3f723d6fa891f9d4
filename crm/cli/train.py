"""crm-train: compose the config, then data -> model -> fit -> export -> evaluate (metrics.json)."""
from __future__ import annotations

import logging
import signal
import sys
import time
from functools import partial
from pathlib import Path

import hydra
import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from crm.cli.common import (build_transform, checkpoint_callbacks, crm_kwargs,
                            load_or_train_tokenizer, make_logger, prepare_data, resolve_resume,
                            sweep_info, trainer_kwargs, world_size, write_json)
from crm.data.manifest import load_manifest
from crm.data.stream import StreamConfig
from crm.lit.callbacks import ExportBest, ShardingReport
from crm.lit.preemption import Preemption
from crm.lit.throughput import Throughput
from crm.lit.datamodule import CRMDataModule
from crm.lit.module import CRMModule, OptimConfig
from crm.parallel import ParallelConfig
from crm.models.factory import build_crm
from crm.prompts import PromptTemplate

log = logging.getLogger("crm.train")


def accumulation(global_batch: int, micro_batch: int, world: int) -> int:
    per_step = micro_batch * world
    if global_batch % per_step:
        raise ValueError(f"global_batch_size={global_batch} is not a multiple of micro_batch_size="
                         f"{micro_batch} x {world} ranks; accumulation must be a whole number")
    return global_batch // per_step


def train(cfg: DictConfig) -> dict:
    started = time.time()
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    if str(cfg.trainer.precision).endswith("-mixed") and cfg.model.dtype != "float32":
        # Lightning's mixed precision autocasts the compute and never converts the parameters:
        # built in bfloat16, the weights, gradients and AdamW states would all be bfloat16.
        raise ValueError(f"trainer.precision={cfg.trainer.precision} keeps float32 master weights, "
                         f"but model.dtype={cfg.model.dtype} builds the parameters in that dtype: "
                         "set model.dtype=float32, or trainer.precision=bf16-true")
    L.seed_everything(cfg.seed, workers=True)
    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    shard_dir = prepare_data(cfg.data)
    manifest = load_manifest(shard_dir)
    tokenizer = load_or_train_tokenizer(cfg.model, manifest, run_dir)
    template = PromptTemplate()
    kind = cfg.loss.kind
    accum = accumulation(cfg.global_batch_size, cfg.micro_batch_size, world_size(cfg.trainer))
    transform = build_transform(cfg, accum)
    make_crm = partial(build_crm, kind, num_labels=transform.num_labels,
                       **crm_kwargs(cfg.model, cfg.loss, tokenizer))
    stream = StreamConfig(batch_size=cfg.micro_batch_size, mode=kind, seed=cfg.seed,
                          max_tokens=cfg.stream.max_tokens, min_turn_tokens=cfg.stream.min_turn_tokens,
                          shuffle_buffer=cfg.stream.shuffle_buffer,
                          window_batches=cfg.stream.window_batches, template=template)
    datamodule = CRMDataModule(shard_dir, tokenizer, stream, transform,
                               num_workers=cfg.stream.num_workers)
    # The run dir as the job saw it (absolute, a multirun job's own): crm-export finds the run's
    # tokenizer through it.
    run_config = {**OmegaConf.to_container(cfg, resolve=True), "run_dir": str(run_dir.resolve())}
    module = CRMModule(make_crm, OptimConfig(**cfg.optim), ParallelConfig(**cfg.parallel),
                       run_config=run_config)

    best, last = checkpoint_callbacks(run_dir, cfg)
    sweep = sweep_info(cfg)
    logger = make_logger(cfg.logger, run_dir, cfg.name, sweep)
    if logger:
        logger.log_hyperparams({**run_config, "sweep": sweep or {}})
    preemption = Preemption(str(run_dir / "checkpoints" / "last.ckpt"),
                            signum=getattr(signal, cfg.preemption.signal),
                            requeue_command=cfg.preemption.requeue_command)
    sharding = ShardingReport()
    callbacks = [best, last, preemption, sharding]
    throughput = None
    if cfg.perf.log_every_n_steps:
        peak = None if cfg.perf.peak_tflops is None else cfg.perf.peak_tflops * 1e12
        throughput = Throughput(cfg.perf.log_every_n_steps, gpu=cfg.perf.gpu, peak_flops=peak)
        callbacks.append(throughput)
    if logger:  # LearningRateMonitor refuses a Trainer without a logger (logger=none)
        callbacks.append(L.pytorch.callbacks.LearningRateMonitor(logging_interval="step"))
    if cfg.early_stopping_patience:
        callbacks.append(L.pytorch.callbacks.EarlyStopping(
            monitor="val/loss", patience=cfg.early_stopping_patience, mode="min"))
    export_dir = run_dir / "export"
    if cfg.export:
        callbacks.append(ExportBest(export_dir, tokenizer, kind=kind, template=template,
                                    max_tokens=cfg.stream.max_tokens,
                                    extra={"config": run_config}, preemption=preemption))
    trainer = L.Trainer(**trainer_kwargs(cfg.trainer),
                        accumulate_grad_batches=accum, callbacks=callbacks,
                        logger=logger,
                        val_check_interval=cfg.val_every_n_steps * accum,
                        check_val_every_n_epoch=None, default_root_dir=str(run_dir))
    ckpt_path = resolve_resume(cfg.resume, run_dir)
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True)

    metrics = {
        "run_dir": str(run_dir),
        "preempted": preemption.preempted,
        "train": {"global_step": trainer.global_step,
                  "best_val_loss": _float(best.best_model_score), "best_checkpoint": best.best_model_path,
                  "resumed_from": ckpt_path, "accumulation": accum, "world_size": trainer.world_size,
                  "per_rank_memory": sharding.per_rank,
                  "throughput": throughput.last if throughput else None,
                  "wall_seconds": round(time.time() - started, 1)},
    }
    finished = cfg.export and not preemption.preempted
    if finished and cfg.evaluate and cfg.data.test_files and trainer.is_global_zero:
        from crm.cli.eval import evaluate_files
        from crm.scoring import CRMScorer

        scorer = CRMScorer.from_export(export_dir, batch_size=64)
        metrics["eval"], _ = evaluate_files(scorer, cfg.data.test_files)
    metrics["wall_seconds"] = round(time.time() - started, 1)
    if not trainer.is_global_zero:
        return None
    write_json(run_dir / "metrics.json", metrics)
    return metrics


def _float(x) -> float | None:
    return None if x is None else round(float(x), 6)


@hydra.main(version_base="1.3", config_path="pkg://crm_configs", config_name="train")
def main(cfg: DictConfig) -> None:
    metrics = train(cfg)
    if metrics is None:  # not global rank 0
        return
    if "eval" in metrics:
        for path, m in metrics["eval"].items():
            print(f"{Path(path).stem:>20}: accuracy {m['accuracy_mean']:.4f} "
                  f"(given {m['accuracy']:.4f}, swapped {m['accuracy_swapped']:.4f}, "
                  f"flip {m['flip_rate']:.4f})")
    print(f"metrics: {metrics['run_dir']}/metrics.json")


if __name__ == "__main__":
    sys.exit(main())
