"""What more than one entry point shares: how a command's config schema is declared and checked,
the `paths` group, the scorer of `checkpoint=` (crm-eval, crm-leaderboard, crm-usl), the deprecated
`model=` argument, and configuration errors reported as one line.

Every Hydra command declares its config once, as dataclasses (docs/DESIGN.md section 6): a field
is one line in a dataclass (its type and, for a library's own dataclass, its default) and one line
in the YAML (its value and the comment that documents it). `register_schema` stores the command's
dataclass in Hydra's ConfigStore as `<command>_schema`, which configs/<command>.yaml lists first
in its defaults: Hydra merges the YAML and the overrides onto it, so a value of the wrong type or
a key the schema lacks stops the composition. `settings` then turns the composed config into
those dataclasses, whose own checks (`__post_init__`) refuse a value that cannot work.
"""
from __future__ import annotations

import functools
import logging
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue

from crm.cli import errors
from crm.core.errors import ConfigError
from crm.core.records import RecordError

errors.install()  # Hydra's own errors (unknown key, wrong type) as one line too


def register_schema(command: str, schema: type) -> None:
    """`schema` as the config `<command>_schema`, named first in configs/<command>.yaml's defaults.

    A library's frozen dataclass (OptimConfig, Bootstrap, ...) makes its OmegaConf node read-only,
    and the YAML could not be merged onto it: the stored node is made writable. The objects a
    command gets (`settings`) are the frozen dataclasses again.
    """
    node = OmegaConf.structured(schema)
    _make_writable(node)
    ConfigStore.instance().store(name=f"{command}_schema", node=node, provider="crm")


def _make_writable(node: DictConfig | ListConfig) -> None:
    OmegaConf.set_readonly(node, False)
    for key in (node.keys() if isinstance(node, DictConfig) else range(len(node))):
        if OmegaConf.is_missing(node, key) or OmegaConf.is_interpolation(node, key):
            continue
        child = node[key]
        if isinstance(child, (DictConfig, ListConfig)):
            _make_writable(child)


def settings(cfg: DictConfig):
    """The composed config as its schema's dataclasses: every group and section a typed object.

    A value the dataclasses' own checks refuse, or a required value (`???`) left unset, is a
    ConfigError (one line, exit 2), before the command does anything.
    """
    try:
        return OmegaConf.to_object(cfg)
    except MissingMandatoryValue as exc:
        raise ConfigError(f"{exc.full_key}: required, and not set (add {exc.full_key}=... to the "
                          "command line)") from None
    except ValueError as exc:
        if hasattr(exc, "full_key"):  # OmegaConf's own: its message spans several lines
            raise
        raise ConfigError(str(exc)) from None


@dataclass
class PathsConfig:
    """configs/paths/default.yaml: where runs and caches live."""

    root_dir: str = MISSING
    cache_dir: str = MISSING
    output_dir: str = MISSING


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

    def __post_init__(self):
        from crm.models.backbone import DTYPES
        from crm.models.compile import SETTINGS

        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype}: expected auto, {', '.join(DTYPES)}")
        if self.compile not in SETTINGS:
            raise ValueError(f"compile={self.compile}: expected auto, true or false")


def load_scorer(cfg: ScorerSettings):
    """The CRMScorer of `cfg.checkpoint` (an export dir or a crm-train checkpoint)."""
    import torch

    from crm.inference.scorer import CRMScorer
    from crm.models.backbone import DTYPES

    if not Path(cfg.checkpoint).exists():
        raise ConfigError(f"checkpoint={cfg.checkpoint}: no such export directory or checkpoint")
    device = None if cfg.device == "auto" else torch.device(cfg.device)
    dtype = None if cfg.dtype == "auto" else DTYPES[cfg.dtype]
    # Bars redraw with carriage returns: in a terminal they vanish, in a log file or a pipe they
    # stay, glued to the results table the command prints next. Shown on a terminal only.
    progress = cfg.progress and sys.stderr.isatty()
    if not progress:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # "Loading weights" too
    return CRMScorer.load(cfg.checkpoint, batch_size=cfg.batch_size, device=device, dtype=dtype,
                          prefix_reuse=cfg.prefix_reuse, progress=progress, compile=cfg.compile)


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
    """Wraps a Hydra task: a ConfigError (a setting that cannot work) or a RecordError (a bad line
    of an input file) is printed as one line and exits 2; Hydra would print it inside a traceback.
    Real crashes keep theirs."""
    @functools.wraps(task)
    def run(cfg: DictConfig):
        try:
            return task(cfg)
        except (ConfigError, RecordError) as exc:
            print(f"{Path(sys.argv[0]).name}: {exc}", file=sys.stderr)
            sys.exit(2)
    return run


class _NoAdverts(logging.Filter):
    """Lightning's "💡 Tip: ... try installing litlogger / litmodels" lines: an advert for a cloud
    service in every run's log, nothing about the run."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip:")


for _name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
    logging.getLogger(_name).addFilter(_NoAdverts())
