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

import difflib
import functools
import logging
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException, MissingConfigException
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from crm.core.errors import ConfigError
from crm.core.records import RecordError
from crm.inference.engine import EngineConfig


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
    engine: EngineConfig = field(default_factory=EngineConfig)  # the `engine` group: local | ray

    def __post_init__(self):
        from crm.models.backbone import DTYPES
        from crm.models.compile import resolve

        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype}: expected auto, {', '.join(DTYPES)}")
        resolve(self.compile, "cpu")  # refuses all but auto, true and false (1 and 1.0 too)
        if self.engine.name == "ray":  # at start, before any file is read
            from crm.inference.engine import import_ray

            import_ray()


def load_scorer(cfg: ScorerSettings, run_dir: Path | None = None):
    """The CRMScorer of `cfg.checkpoint` (an export dir or a crm-train checkpoint), or with
    engine=ray a RayScorer whose workers each load it (`run_dir`: where its finished blocks go)."""
    import torch

    from crm.inference.scorer import CRMScorer
    from crm.models.backbone import DTYPES

    from crm.models.checkpoint import not_loadable

    problem = not_loadable(cfg.checkpoint)
    if problem:
        raise ConfigError(f"checkpoint={cfg.checkpoint}: {problem}")
    # Bars redraw with carriage returns: in a terminal they vanish, in a log file or a pipe they
    # stay, glued to the results table the command prints next. Shown on a terminal only.
    progress = cfg.progress and sys.stderr.isatty()
    if cfg.engine.name == "ray":
        from crm.inference.engine import RayScorer, ScorerLoader, checkpoint_identity

        if cfg.device != "auto":
            raise ConfigError(f"device={cfg.device} with engine=ray: each worker runs on what Ray "
                              "gives it (engine.gpus_per_worker; 0: CPU): leave device=auto")
        loader = ScorerLoader(str(cfg.checkpoint), cfg.batch_size, cfg.dtype, cfg.compile,
                              cfg.prefix_reuse)
        return RayScorer.start(loader, cfg.engine, run_dir=run_dir, progress=progress,
                               identity=checkpoint_identity(cfg.checkpoint) + f"/{cfg.dtype}")
    device = None if cfg.device == "auto" else torch.device(cfg.device)
    dtype = None if cfg.dtype == "auto" else DTYPES[cfg.dtype]
    if not progress:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # "Loading weights" too
    return CRMScorer.load(cfg.checkpoint, batch_size=cfg.batch_size, device=device, dtype=dtype,
                          prefix_reuse=cfg.prefix_reuse, progress=progress, compile=cfg.compile)


def close_scorer(scorer) -> None:
    """A RayScorer's workers stopped (and a Ray it started); a CRMScorer holds nothing to stop."""
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


def one_line_config_errors(task):
    """Wraps a Hydra task: a ConfigError (a setting that cannot work) or a RecordError (a bad line
    of an input file) is printed as one line and exits 2; Hydra would print it inside a traceback.
    Real crashes keep theirs."""
    @functools.wraps(task)
    def run(cfg: DictConfig):
        _task_started.append(task.__name__)
        try:
            return task(cfg)
        except (ConfigError, RecordError) as exc:
            print(f"{Path(sys.argv[0]).name}: {exc}", file=sys.stderr)
            sys.exit(2)
    return run


def benchmark_config(name: str, path: str):
    """configs/benchmark/<name>.yaml with `path` set: a benchmark that crm-train's `benchmarks`
    names, with the criteria crm-eval's `benchmark=<name>` would use."""
    import crm_configs
    from crm.evaluation.benchmarks import LAYOUTS, BenchmarkConfig

    if name not in LAYOUTS:
        raise ConfigError(f"benchmarks.{name}: not a benchmark; one of {', '.join(LAYOUTS)}")
    yaml_file = Path(crm_configs.__file__).parent / "benchmark" / f"{name}.yaml"
    node = OmegaConf.merge(OmegaConf.structured(BenchmarkConfig), OmegaConf.load(yaml_file),
                           {"path": str(path)})
    return settings(node)


class _NoAdverts(logging.Filter):
    """Lightning's "💡 Tip: ... try installing litlogger / litmodels" lines: an advert for a cloud
    service in every run's log, nothing about the run."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip:")


for _name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
    logging.getLogger(_name).addFilter(_NoAdverts())

# -- Hydra's own errors as one line --------------------------------------------------------------
# An unknown key, a value of the wrong type, a config group option that does not exist, an override
# that does not parse: Hydra prints them over several lines, suggests `+key=value` for a misspelt
# key (which then fails later, inside the code the key was meant for) and exits 1. `install` routes
# the entry points' Hydra run through `one_line`; it runs when this module is imported, as every
# Hydra command does. HYDRA_FULL_ERROR=1 keeps Hydra's own report (and its stack trace).

def install() -> None:
    """Hydra's `run_and_report` (which runs composition and the task) with `one_line` inside it."""
    from hydra._internal import utils

    if getattr(utils.run_and_report, "crm_one_line", False):
        return
    original = utils.run_and_report

    def run_and_report(func):
        return original(lambda: one_line(func))

    run_and_report.crm_one_line = True
    utils.run_and_report = run_and_report


def one_line(func):
    """func(), with a Hydra composition error printed as one line naming the command; exit 2.

    A crash inside a command stays a crash: only Hydra's own exceptions (composition, override
    parsing, instantiating a user's `_target_`) are a user's mistake."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        return func()
    _task_started.clear()
    try:
        return func()
    except HydraException as exc:
        print(f"{Path(sys.argv[0]).name}: {describe(exc)}", file=sys.stderr)
        sys.exit(2)
    except OSError as exc:
        if _task_started:  # the command's own: a crash keeps its traceback
            raise
        # Hydra makes the run dir before the task starts: CRM_ROOT unwritable, or under a file.
        root = os.environ.get("CRM_ROOT", ".")
        print(f"{Path(sys.argv[0]).name}: {exc.filename or ''}: {exc.strerror or exc}: the run dir "
              f"cannot be made under CRM_ROOT={root}: set CRM_ROOT (or hydra.run.dir=) to a "
              "directory you can write", file=sys.stderr)
        sys.exit(2)


_task_started: list[str] = []  # set by one_line_config_errors: an OSError after it is no setup error


def describe(exc: HydraException) -> str:
    """One line: the key at fault, what is wrong with it, and the nearest key that exists."""
    cause = exc.__cause__
    if isinstance(cause, OmegaConfBaseException) and getattr(cause, "full_key", None):
        reason = _first_line(cause.msg if hasattr(cause, "msg") else str(cause))
        key = cause.full_key
        if "not in" in reason or "not in struct" in reason:
            return f"{key}: no such key{_nearest(key, cause.parent_node)}"
        return f"{key}: {reason}"
    if isinstance(exc, MissingConfigException):
        options = getattr(exc, "options", None)
        found = f" (options: {', '.join(options)})" if options else ""
        return f"{_first_line(str(exc))}{found}"
    return "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), text)


def _nearest(full_key: str, parent) -> str:
    """' (did you mean X?)' for the closest existing key beside `full_key`, else a pointer to
    --cfg job. Under `trainer` (Lightning Trainer arguments, a free dict) the Trainer's own
    arguments count as existing: `+trainer.NAME=` adds one the group does not set."""
    prefix, _, name = full_key.rpartition(".")
    keys = [str(k) for k in parent.keys()] if parent is not None and hasattr(parent, "keys") else []
    if prefix == "trainer":
        from crm.training.checks import trainer_arguments

        keys += list(trainer_arguments())
    match = difflib.get_close_matches(name, keys, n=1, cutoff=0.6)
    dotted = f"{prefix}." if prefix else ""
    if match and prefix == "trainer" and match[0] not in parent:
        return f" (did you mean +{dotted}{match[0]}=...? a Trainer argument the group does not set)"
    if match:
        return f" (did you mean {dotted}{match[0]}?)"
    return " (--cfg job lists the keys)"


install()
