"""crm-leaderboard: rank the models of a benchmark for one user's criteria.

    crm-leaderboard checkpoint=DIR bench=FILE baseline=NAME 'criteria=["line 1","line 2"]'
                    [topics=[...]] ['contrast=[...]'] [default=true]

Writes leaderboard.json, leaderboard.md and leaderboard.png into outputs/leaderboard/<name>.
`default=true` ranks under `default_criteria` (the crowd's average preference) instead of
`criteria`; with `contrast` it is compared with another criteria set (Kendall tau). `checkpoint`
is an export dir or a crm-train checkpoint (the former `model=DIR` still works, with a deprecation
message).
"""
from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import MISSING, DictConfig

from crm.cli.common import (PathsConfig, ScorerSettings, checkpoint_argument, close_scorer,
                            load_scorer, one_line_config_errors, register_schema, settings)
from crm.core.errors import ConfigError
from crm.core.files import write_json
from crm.evaluation.leaderboard import Bootstrap, leaderboard, select
from crm.evaluation.render import markdown, plot

log = logging.getLogger("crm.evaluation.leaderboard")


@dataclass
class Labels:
    criteria: str = MISSING
    contrast: str = MISSING


@dataclass
class LeaderboardConfig(ScorerSettings):
    """configs/leaderboard.yaml's keys and their types."""

    paths: PathsConfig = MISSING
    name: str = MISSING
    bench: str = MISSING
    baseline: str = MISSING
    criteria: Any = MISSING  # a list of lines, or one string (one criterion): `_lines`
    topics: Any = MISSING  # null, a list, or one string
    models: Any = MISSING  # null, a list, or one string
    contrast: Any = MISSING  # null, a list of lines, or one string
    default: bool = MISSING
    default_criteria: list[str] = MISSING
    labels: Labels = MISSING
    both_orders: bool = MISSING
    interval: Bootstrap = field(default_factory=Bootstrap)
    strict: bool = MISSING


register_schema("leaderboard", LeaderboardConfig)


def _lines(value) -> list[str]:
    """A criteria list from the config; one string is one criterion."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value]


def criteria_sets(cfg: LeaderboardConfig) -> tuple[list[str], list[str], tuple[str, str]]:
    """(criteria, contrast, labels) as the config asks."""
    criteria, contrast = _lines(cfg.criteria), _lines(cfg.contrast)
    if cfg.default:
        if criteria:
            raise ConfigError("default=true ranks under default_criteria: give criteria=[...] or "
                             "default=true, not both (contrast=[...] compares with another set)")
        criteria = _lines(cfg.default_criteria)
    if not criteria:
        raise ConfigError("no criteria: criteria=[\"...\",...] (one line each), or default=true")
    labels = (cfg.labels.criteria if not cfg.default else "default", cfg.labels.contrast)
    return criteria, contrast, labels


def run(cfg: DictConfig) -> dict:
    started = time.time()
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    cfg = settings(cfg)
    criteria, contrast, labels = criteria_sets(cfg)
    topics = None if cfg.topics is None else _lines(cfg.topics)
    models = None if cfg.models is None else _lines(cfg.models)
    if not Path(cfg.bench).is_file():
        raise ConfigError(f"bench={cfg.bench}: no such file")
    try:  # a baseline, model or topic the benchmark lacks: the user's to fix, named in one line
        selection = select(cfg.bench, cfg.baseline, topics=topics, models=models)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if selection.rejects:
        for r in selection.rejects[:10]:
            log.warning("rejected %s:%s: %s: %s", r["file"], r["line"], r["field"], r["reason"])
        if cfg.strict:
            raise ValueError(f"{cfg.bench}: {len(selection.rejects)} benchmark lines rejected "
                             f"(strict=true); first: {selection.rejects[0]}")
    run_dir.mkdir(parents=True, exist_ok=True)
    scorer = load_scorer(cfg, run_dir)
    try:
        result = leaderboard(scorer, selection, criteria, contrast or None,
                             both_orders=cfg.both_orders, labels=labels,
                             interval=cfg.interval)
    finally:
        close_scorer(scorer)
    result.update(model=str(cfg.checkpoint), kind=scorer.kind,
                  sequences={k: int(v) for k, v in sorted(scorer.counts.items())},
                  wall_seconds=round(time.time() - started, 1))
    write_json(run_dir / "leaderboard.json", result)
    (run_dir / "leaderboard.md").write_text(markdown(result), encoding="utf-8")
    plot(result, run_dir / "leaderboard.png")
    return result


@hydra.main(version_base="1.3", config_path="pkg://crm_configs", config_name="leaderboard")
@one_line_config_errors
def _main(cfg: DictConfig) -> None:
    result = run(cfg)
    print(markdown(result))
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    print(f"leaderboard: {run_dir / 'leaderboard.md'} (.json, .png)")


def main() -> None:
    sys.argv = checkpoint_argument(sys.argv)
    _main()


if __name__ == "__main__":
    sys.exit(main())
