"""Config -> objects for the command-line entry points (the only place that reads Hydra configs)."""
from __future__ import annotations

import csv
import fcntl
import json
import logging
import os
from contextlib import contextmanager
import warnings
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from crm.data.manifest import Manifest
from crm.data.reader import iter_shard
from crm.parallel import fsdp_strategy, is_complete_checkpoint
from crm.prompts import PromptTemplate
from crm.records import parse_train
from crm.transforms import TransformConfig

log = logging.getLogger("crm")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    tmp.replace(path)


@contextmanager
def file_lock(path: Path):
    """An exclusive lock on `path` (a lock file): under srun every rank starts at once, and the
    first one prepares what the others then find ready."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def prepare_data(data: DictConfig) -> Path:
    """The shard dir; for the demo, generate the data and shard it first if they are absent."""
    shard_dir = Path(data.path)
    if data.get("demo"):
        with file_lock(Path(data.demo.out_dir) / ".prepare.lock"):
            _prepare_demo(data, shard_dir)
    return shard_dir


def _prepare_demo(data: DictConfig, shard_dir: Path) -> None:
    # A cache from an older demo (fewer test files) is regenerated, not trained on and then failed.
    complete = (shard_dir / "manifest.json").is_file() and all(Path(f).is_file() for f in data.test_files)
    if not complete:
        from crm.data.demo import write_demo
        from crm.data.shard import shard

        raw = Path(data.demo.out_dir) / "raw"
        log.info("generating the demo data into %s", raw)
        write_demo(raw, seed=data.demo.seed, n_train=data.demo.n_train, n_test=data.demo.n_test,
                   n_bench=data.demo.n_bench)
        shard([str(raw / "train.jsonl")], shard_dir, shard_size=1000)


def training_texts(manifest: Manifest, template: PromptTemplate):
    """The text a tokenizer for this data should know: the template and every training record."""
    yield template.pairwise + template.pointwise
    for shard in manifest.shards("train"):
        for _, obj in iter_shard(shard.url):
            r = parse_train(obj)
            yield "\n".join(r.a_criteria + r.b_criteria + tuple(m.content for m in r.model_a + r.model_b))


def load_or_train_tokenizer(model: DictConfig, manifest: Manifest, run_dir: Path):
    """The model's tokenizer; a tiny model trains a BPE on the training data once per run dir."""
    from transformers import AutoTokenizer

    source = model.tokenizer or model.path
    if source:
        return AutoTokenizer.from_pretrained(source, local_files_only=True)
    saved = run_dir / "tokenizer"
    with file_lock(run_dir / ".tokenizer.lock"):
        if not (saved / "tokenizer.json").is_file():  # a resumed run keeps its vocabulary
            _train_tokenizer(model, manifest, saved)
    return AutoTokenizer.from_pretrained(saved, local_files_only=True)


def _train_tokenizer(model: DictConfig, manifest: Manifest, saved: Path) -> None:
    if not model.vocab_size:
        raise ValueError(f"model={model.name}: no model.path or model.tokenizer to read a "
                         "tokenizer from, and no model.vocab_size to train one; set model.path to "
                         "a local checkpoint dir")
    from crm.models.tokenizer import train_bpe_tokenizer

    tokenizer = train_bpe_tokenizer(training_texts(manifest, PromptTemplate()), model.vocab_size)
    partial = saved.with_name(saved.name + ".partial")
    tokenizer.save_pretrained(partial)
    partial.rename(saved)
    log.info("trained a %d-token BPE on the training data: %s", len(tokenizer), saved)


def build_transform(cfg: DictConfig, accumulation: int = 1) -> TransformConfig:
    """The transform from the direction/noise groups and `transform`; the direction curriculum's
    optimizer steps become micro batches of one rank."""
    t, direction = cfg.transform, cfg.direction
    return TransformConfig(direction=direction.get("then", direction.name), noise=cfg.noise.name,
                           arithmetic=t.arithmetic, swap_prob=t.swap_prob, ties=t.ties,
                           redraw_each_epoch=t.redraw_each_epoch,
                           warmup_direction=direction.get("warmup", "original"),
                           warmup_batches=direction.get("warmup_steps", 0) * accumulation)


def crm_kwargs(model: DictConfig, loss: DictConfig, tokenizer) -> dict:
    """Arguments of crm.models.factory.build_crm from the model and loss groups."""
    arch = model.arch
    if isinstance(arch, DictConfig):  # the tiny model: its vocabulary is the trained tokenizer's
        arch = {**arch, "vocab_size": len(tokenizer)}
    return dict(path=model.path, arch=arch, attention=model.attention,
                dtype=DTYPES[model.dtype], pad_token_id=tokenizer.pad_token_id,
                margin=loss.get("margin", 0.0), center_coef=loss.get("center_coef", 0.0))


def world_size(trainer: DictConfig) -> int:
    devices = trainer.devices
    if devices in ("auto", -1, "-1"):
        gpu = trainer.accelerator in ("gpu", "cuda") or (trainer.accelerator == "auto"
                                                        and torch.cuda.is_available())
        devices = torch.cuda.device_count() if gpu else 1
        if not devices:
            raise ValueError(f"trainer.devices={trainer.devices} with trainer.accelerator="
                             f"{trainer.accelerator}, but no CUDA device is visible")
    elif isinstance(devices, (list, tuple)) or hasattr(devices, "__len__") and not isinstance(devices, str):
        devices = len(devices)
    return int(devices) * int(trainer.get("num_nodes", 1))


def resolve_resume(resume, run_dir: Path) -> str | None:
    """auto: this run dir's last checkpoint if a complete one exists; a path: that; false: none.

    A sharded checkpoint is swapped into place only when complete (crm.parallel.FSDPStrategy); a
    job killed between the swap's two renames leaves the complete `.partial` or `.old` copy.
    """
    if resume in (None, False, "false", "False"):
        return None
    if resume == "auto":
        last = run_dir / "checkpoints" / "last.ckpt"
        for candidate in (last, last.with_name("last.ckpt.partial"), last.with_name("last.ckpt.old")):
            if is_complete_checkpoint(candidate):
                log.info("resuming from %s", candidate)
                return str(candidate)
            if candidate.exists():
                log.warning("ignoring the incomplete checkpoint %s", candidate)
        return None
    if not is_complete_checkpoint(resume):
        raise FileNotFoundError(f"resume={resume}: no such checkpoint, or an incomplete one")
    return str(resume)


def trainer_kwargs(trainer: DictConfig) -> dict:
    """Lightning Trainer arguments from the trainer group; `strategy: fsdp` is crm's FSDP2.

    On SLURM, Lightning's own auto-requeue is switched off: crm.lit.preemption owns the signal.
    """
    kwargs = OmegaConf.to_container(trainer, resolve=True)
    if kwargs.get("strategy") == "fsdp":
        kwargs["strategy"] = fsdp_strategy(world_size(trainer))
    if SLURMEnvironment.detect():
        kwargs["plugins"] = [SLURMEnvironment(auto_requeue=False)]
    return kwargs


def checkpoint_callbacks(run_dir: Path, cfg: DictConfig):
    """The best model by val/loss, and last.ckpt every `save_every_n_steps` for resume."""
    ckpt_dir = run_dir / "checkpoints"
    best = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=ckpt_dir, filename="best", monitor="val/loss", mode="min", save_top_k=1,
        enable_version_counter=False)
    last = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=ckpt_dir, save_top_k=0, save_last=True, every_n_train_steps=cfg.save_every_n_steps,
        enable_version_counter=False)
    return best, last


def sweep_info(cfg: DictConfig) -> dict | None:
    """In a multirun: the sweep's group (the logger's group, else the run name) and this job's
    axis values (its overrides), so that wandb groups and tags a sweep's runs."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN:
        return None
    axes = dict(o.lstrip("+~").split("=", 1) for o in hydra_cfg.overrides.task if "=" in o)
    return {"group": cfg.logger.get("group") or cfg.name, "axes": axes, "job": hydra_cfg.job.num}


def make_logger(logger: DictConfig, run_dir: Path, name: str, sweep: dict | None = None):
    if logger.name == "none":
        return False
    if logger.name == "csv":
        return ResumableCSVLogger(save_dir=str(run_dir), name="csv", version="")
    if logger.name == "wandb":
        from crm.lit.preemption import slurm_job_id

        os.environ.setdefault("WANDB_MODE", "offline")  # no key, no network unless asked
        run_id = slurm_job_id()  # a requeued job continues its own wandb run
        group, tags = logger.group, list(logger.tags)
        if sweep:
            group = group or sweep["group"]
            tags += [f"{k}={v}" for k, v in sweep["axes"].items()]
            name = f"{name}-{sweep['job']}"
        return L.pytorch.loggers.WandbLogger(
            project=logger.project, entity=logger.entity, group=group, tags=tags, name=name,
            save_dir=str(run_dir), id=run_id, resume="allow" if run_id else None)
    raise ValueError(f"logger {logger.name!r}: expected csv, wandb or none")


class ResumableCSVLogger(L.pytorch.loggers.CSVLogger):
    """Appends to the run's csv/metrics.csv. Lightning's CSVLogger deletes the file it finds, so a
    resumed run (resume=auto, a requeued job) would lose the earlier steps' metrics.

    Steps run again after a crash appear twice; the later row is the resumed run's.
    """

    @property
    def experiment(self):
        path = Path(self.log_dir) / "metrics.csv"
        if self._experiment is not None or rank_zero_only.rank != 0 or not path.is_file():
            return super().experiment
        aside = path.with_name(path.name + ".resumed")
        path.replace(aside)  # out of the writer's way while it starts
        with warnings.catch_warnings():  # "Previous log files ... will be deleted": not here
            warnings.filterwarnings("ignore", message="Experiment logs directory")
            writer = super().experiment
        with aside.open(newline="") as f:
            writer.metrics_keys = next(csv.reader(f), [])  # rows are appended under this header
        aside.replace(path)
        return writer
