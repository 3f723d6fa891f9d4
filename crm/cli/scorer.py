"""The scorer of `checkpoint=` that crm-eval, crm-leaderboard and crm-usl share: its settings
(`ScorerSettings`, the fields each of their schemas starts with), loading and closing it, and the
deprecated `model=` argument of crm-eval and crm-leaderboard."""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING

from crm.core.errors import ConfigError
from crm.inference.config import EngineConfig
from crm.models.config import DTYPE_NAMES, resolve_compile


@dataclass
class ScorerSettings:
    """What crm-eval, crm-leaderboard and crm-usl load and how they run it (`load_scorer`)."""

    checkpoint: str = MISSING
    batch_size: int = MISSING
    device: str = MISSING
    dtype: str = MISSING
    compile: Any = MISSING  # auto, true or false (crm.models.compile); Any: a str would take true as "True"
    prefix_reuse: bool = MISSING
    progress: bool = MISSING
    engine: EngineConfig = field(default_factory=EngineConfig)  # the `engine` group: local | ray

    def __post_init__(self):
        if self.dtype != "auto" and self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype={self.dtype}: expected auto, {', '.join(DTYPE_NAMES)}")
        resolve_compile(self.compile, "cpu")  # refuses all but auto, true and false (1 and 1.0 too)
        if self.engine.name == "ray":  # at start, before any file is read
            from crm.inference.engine import import_ray

            import_ray()


def transformers_bars(show: bool) -> None:
    """transformers' own progress bars (loading and writing weights) off unless `show`: they
    redraw with carriage returns, noise in a log file or a pipe. Every command asks with
    `sys.stderr.isatty()` at least."""
    if not show:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


def load_scorer(cfg: ScorerSettings, run_dir: Path | None = None):
    """The CRMScorer of `cfg.checkpoint` (an export dir or a crm-train checkpoint), or with
    engine=ray a RayScorer whose workers each load it (`run_dir`: where its finished blocks go)."""
    from crm.models.checkpoint import not_loadable

    problem = not_loadable(cfg.checkpoint)  # before transformers' import: the refusal in a second
    if problem:
        raise ConfigError(f"checkpoint={cfg.checkpoint}: {problem}")
    # Bars redraw with carriage returns: in a terminal they vanish, in a log file or a pipe they
    # stay, glued to the results table the command prints next. Shown on a terminal only.
    progress = cfg.progress and sys.stderr.isatty()
    if cfg.engine.name == "ray":  # Ray starts behind the command, before it imports torch
        from crm.inference.engine import RayScorer, ScorerLoader, checkpoint_identity

        if cfg.device != "auto":
            raise ConfigError(f"device={cfg.device} with engine=ray: each worker runs on what Ray "
                              "gives it (engine.gpus_per_worker; 0: CPU): leave device=auto")
        loader = ScorerLoader(str(cfg.checkpoint), cfg.batch_size, cfg.dtype, cfg.compile,
                              cfg.prefix_reuse)
        # the dtype each worker resolves is in the blocks' fingerprint (crm.inference.engine)
        return RayScorer.start(loader, cfg.engine, run_dir=run_dir, progress=progress,
                               identity=checkpoint_identity(cfg.checkpoint))
    import torch

    from crm.inference.scorer import CRMScorer
    from crm.models.backbone import DTYPES

    device = None if cfg.device == "auto" else torch.device(cfg.device)
    dtype = None if cfg.dtype == "auto" else DTYPES[cfg.dtype]
    transformers_bars(progress)  # "Loading weights" too
    return CRMScorer.load(cfg.checkpoint, batch_size=cfg.batch_size, device=device, dtype=dtype,
                          prefix_reuse=cfg.prefix_reuse, progress=progress, compile=cfg.compile)


def close_scorer(scorer) -> None:
    """A RayScorer's workers stopped (and a Ray it started, once its start is over); a CRMScorer
    holds nothing to stop."""
    close = getattr(scorer, "close", None)
    if close is not None:
        close()


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
