"""crm-usl: serve the User-centric Subjective Leaderboard as a web page (and a JSON API).

    crm-usl checkpoint=DIR bench=FILE baseline=NAME [host=0.0.0.0] [port=7861]

With no overrides it serves the demo's CRM and benchmark when `make demo` has made them. It scores
the default board (or reads it from the verdict cache), prints the local URL and serves until
stopped (Ctrl-C or SIGTERM).
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
from omegaconf import MISSING, DictConfig

from crm.app.config import HttpLimits
from crm.app.service import Limits
from crm.cli.errors import one_line_config_errors
from crm.cli.record import save_run_record
from crm.cli.schema import PathsConfig, register_schema, settings
from crm.cli.scorer import ScorerSettings, close_scorer, load_scorer
from crm.core.errors import ConfigError
from crm.core.heap import freeze_startup_heap
from crm.evaluation.leaderboard import Bootstrap

log = logging.getLogger("crm.app")


@dataclass(frozen=True)
class ServeConfig(HttpLimits):
    """configs/usl.yaml's `serve`: the model gate's and Gradio queue's keys, and the HTTP guards'
    bounds (crm.app.config.HttpLimits: their types and check)."""

    scoring: int = MISSING  # crm.app.service.ModelGate
    waiting: int = MISSING
    wait_timeout: float = MISSING
    queue_size: int = MISSING  # Gradio's queue

    def __post_init__(self):
        try:
            super().__post_init__()
        except ValueError as exc:
            raise ValueError(f"serve.{exc}") from None


@dataclass
class CacheConfig:
    dir: str | None = MISSING  # crm.app.cache.VerdictCache
    memory_entries: int = MISSING
    disk_entries: int = MISSING


@dataclass
class UslConfig(ScorerSettings):
    """configs/usl.yaml's keys and their types."""

    paths: PathsConfig = MISSING
    name: str = MISSING
    bench: str = MISSING
    baseline: str = MISSING
    models: list[str] | None = MISSING
    default_criteria: list[str] = MISSING
    host: str = MISSING
    port: int = MISSING
    auth_env: str | None = MISSING
    both_orders: Any = MISSING  # true, false or auto (crm-leaderboard's)
    slot_sample: int = MISSING
    torch_threads: int | None = MISSING
    interval: Bootstrap = field(default_factory=Bootstrap)
    limits: Limits = field(default_factory=Limits)
    serve: ServeConfig = field(default_factory=ServeConfig)
    cache: CacheConfig = MISSING


register_schema("usl", UslConfig)


def basic_auth(variable: str | None) -> tuple[str, str] | None:
    value = os.environ.get(variable or "", "")
    if not value:
        return None
    user, sep, password = value.partition(":")
    if not sep or not user or not password:
        raise ConfigError(f"${variable}: expected user:password")
    return user, password


def check_inputs(cfg: UslConfig) -> None:
    """A missing model or benchmark stops the start with what to do about it."""
    if cfg.both_orders not in (True, False, "auto"):
        raise ConfigError(f"both_orders={cfg.both_orders}: true, false or auto")
    if cfg.slot_sample < 0 or (cfg.both_orders == "auto" and not cfg.slot_sample):
        raise ConfigError(f"slot_sample={cfg.slot_sample}: the pairs judged in both orders to "
                          "measure slot bias (>= 0; both_orders=auto needs at least 1)")
    if cfg.interval.method not in ("auto", "bootstrap"):
        raise ConfigError(f"interval.method={cfg.interval.method}: the app takes no votes file, so "
                          "its boards' intervals are the bootstrap's (auto or bootstrap)")
    missing = [f"{key}={getattr(cfg, key)}" for key in ("checkpoint", "bench")
               if not Path(getattr(cfg, key)).exists()]
    if missing:
        raise ConfigError(f"{' and '.join(missing)}: no such file or directory. The defaults are "
                          "the demo's CRM and benchmark: `make demo` makes them (about 5 minutes "
                          "on 2 CPU cores); or serve yours with `crm-usl checkpoint=EXPORT_OR_CKPT "
                          "bench=BENCH.jsonl baseline=NAME`")


def build_app(cfg: DictConfig):
    """(page, service): the CRM loaded, the default board ready, the page built (not served)."""
    cfg = settings(cfg)
    check_inputs(cfg)
    import torch  # after the checks: a refusal answers before torch and Gradio load

    from crm.app.cache import VerdictCache, crm_fingerprint
    from crm.app.page import build, default_board
    from crm.app.service import Leaderboards, ModelGate, version
    from crm.core.files import file_digest
    from crm.evaluation.leaderboard import select

    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    selection = select(cfg.bench, cfg.baseline, models=cfg.models)
    for r in selection.rejects[:10]:
        log.warning("rejected %s:%s: %s: %s", r["file"], r["line"], r["field"], r["reason"])
    crm_id, bench_id = crm_fingerprint(cfg.checkpoint), file_digest(Path(cfg.bench))
    scorer = load_scorer(cfg)
    # what it runs in (a RayScorer: what its workers run in)
    dtype = (getattr(scorer, "dtype", None)
             or str(next(scorer.model.parameters()).dtype).removeprefix("torch."))
    service = Leaderboards(
        scorer, selection, crm_fingerprint=crm_id, bench_fingerprint=bench_id,
        version=version(cfg.checkpoint, crm_id, bench_id), both_orders=cfg.both_orders,
        slot_sample=cfg.slot_sample, dtype=dtype, interval=cfg.interval, limits=cfg.limits,
        cache=VerdictCache(cfg.cache.dir, cfg.cache.memory_entries, cfg.cache.disk_entries),
        gate=ModelGate(cfg.serve.scoring, cfg.serve.waiting, cfg.serve.wait_timeout))
    started = time.perf_counter()
    default = default_board(service, cfg.default_criteria)
    log.info("%s: %d models x %d queries (%d rejected lines); default board in %.1f s",
             service.version, len(service.models), len(service.records),
             len(selection.rejects), time.perf_counter() - started)
    return build(service, default, cfg.serve.queue_size, cfg.serve.file_age), service


@hydra.main(version_base="1.3", config_path="pkg://crm_configs", config_name="usl")
@one_line_config_errors
def main(cfg: DictConfig) -> None:
    auth = basic_auth(cfg.auth_env)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # gradio's own start-up probes
    page, service = build_app(cfg)
    try:
        save_run_record(cfg)
        from crm.app.page import launch  # build_app loaded it, once its checks passed
        print(f"crm-usl: {service.version}, baseline {service.selection.baseline}; serving on "
              f"http://{cfg.host}:{cfg.port}{' (basic auth)' if auth else ''}. Ctrl-C stops.",
              flush=True)
        signal.signal(signal.SIGTERM, signal.default_int_handler)  # `kill` stops it as Ctrl-C does
        freeze_startup_heap()  # the model, torch and Gradio: out of the collector's full passes
        launch(page, cfg.host, cfg.port, auth=auth, limits=HttpLimits(**{
            key: value for key, value in cfg.serve.items() if key in HttpLimits.__dataclass_fields__}))
    finally:  # engine=ray: its workers, and a Ray it started, stop with the server
        close_scorer(service.scorer)


if __name__ == "__main__":
    sys.exit(main())
