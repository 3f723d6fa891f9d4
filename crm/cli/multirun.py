"""A Hydra multirun's jobs: each job's overrides as Hydra's basic sweeper splits the sweep, for
crm-train's job 0 (which checks every later job before it trains) and crm-report (which names
the jobs that never started). Hydra's parser, so here in `cli/`, the only layer that reads
Hydra's configs."""
from __future__ import annotations

from pathlib import Path

import yaml


def sweep_jobs(params: dict | None, arguments: list[str]) -> list[list[str]]:
    """Each job's overrides (`hydra.*` ones left out), as Hydra's basic sweeper splits a sweep:
    its `hydra.sweeper.params`, then the command line's. Raises HydraException on overrides
    Hydra cannot parse."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    items = [f"{k}={v}" for k, v in (params or {}).items()] + list(arguments)
    parsed = OverridesParser.create().parse_overrides(items)
    return [[o for o in job if not o.lstrip("+~").startswith("hydra.")]
            for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def planned_jobs(sweep_dir: Path) -> list[list[str]]:
    """The jobs the sweep in `sweep_dir` was asked for, from its multirun.yaml; [] when it has
    none or Hydra cannot read it."""
    record = sweep_dir / "multirun.yaml"
    if not record.is_file():
        return []
    from hydra.errors import HydraException

    hydra = (yaml.safe_load(record.read_text(encoding="utf-8")) or {}).get("hydra") or {}
    try:
        return sweep_jobs((hydra.get("sweeper") or {}).get("params"),
                          (hydra.get("overrides") or {}).get("task") or [])
    except HydraException:
        return []
