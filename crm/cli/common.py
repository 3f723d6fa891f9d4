"""What more than one entry point reads from its config: the model's architecture (crm-train,
crm-plan), the scorer of a checkpoint (crm-eval, crm-leaderboard), and configuration errors
reported as one line."""
from __future__ import annotations

import functools
import re
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from crm.core.errors import ConfigError
from crm.models.backbone import DTYPES


def model_arch(model: DictConfig, vocab_size: int | None) -> str | dict:
    """`model.arch`: a name in crm.models.backbone.ARCHITECTURES, or the tiny model's fields, whose
    vocabulary is its tokenizer's (`vocab_size`)."""
    if isinstance(model.arch, DictConfig):
        return {**OmegaConf.to_container(model.arch), "vocab_size": vocab_size}
    return model.arch


def load_scorer(cfg: DictConfig):
    """The CRMScorer of `cfg.checkpoint` (an export dir or a crm-train checkpoint)."""
    import torch

    from crm.inference.scorer import CRMScorer

    if not Path(cfg.checkpoint).exists():
        raise ConfigError(f"checkpoint={cfg.checkpoint}: no such export directory or checkpoint")
    device = None if cfg.device == "auto" else torch.device(cfg.device)
    dtype = None if cfg.dtype == "auto" else DTYPES[cfg.dtype]
    return CRMScorer.load(cfg.checkpoint, batch_size=cfg.batch_size, device=device, dtype=dtype,
                          prefix_reuse=cfg.prefix_reuse, progress=cfg.progress, compile=cfg.compile)


_MODEL = re.compile(r"^(\+{0,2})model(\.path)?=")


def checkpoint_argument(argv: list[str]) -> list[str]:
    """argv with the deprecated `model=DIR` / `model.path=DIR` of crm-eval and crm-leaderboard as
    `checkpoint=DIR`, saying so on stderr (`model` is crm-train's config group)."""
    out = argv[:1]
    for arg in argv[1:]:
        if _MODEL.match(arg):
            new = _MODEL.sub("checkpoint=", arg)
            print(f"{Path(argv[0]).name}: {arg.split('=', 1)[0]}= is deprecated, use {new}",
                  file=sys.stderr)
            arg = new
        out.append(arg)
    return out


def one_line_config_errors(task):
    """Wraps a Hydra task: a ConfigError (a setting that cannot work) is printed as one line and
    exits 2; Hydra would print it inside a traceback. Real crashes keep theirs."""
    @functools.wraps(task)
    def run(cfg: DictConfig):
        try:
            return task(cfg)
        except ConfigError as exc:
            print(f"{Path(sys.argv[0]).name}: {exc}", file=sys.stderr)
            sys.exit(2)
    return run
