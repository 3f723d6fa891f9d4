"""crm-rl: GRPO (TRL) with a CRM and one user's criteria as the reward, and the evidence it works.

    crm-rl [checkpoint=DIR] [prompts=FILE.jsonl] ['runs=[{name: mine, criteria: ["..."]}]']

With no overrides it is the embedded CPU demo on the demo's CRM (`make demo` makes it). Writes
rl.json into outputs/rl/<name> and prints its evidence (docs/RL.md).
"""
from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import MISSING, DictConfig

from crm.cli.errors import one_line_config_errors
from crm.cli.record import save_run_record
from crm.cli.schema import PathsConfig, register_schema, settings
from crm.core.errors import ConfigError
from crm.core.files import write_json
from crm.rl.config import Plan

log = logging.getLogger("crm.rl")


@dataclass(frozen=True)
class RlConfig(Plan):
    """configs/rl.yaml's keys and their types: the harness's Plan, and where and how it runs."""

    paths: PathsConfig = MISSING
    name: str = MISSING
    torch_threads: int | None = MISSING


register_schema("rl", RlConfig)


def check_inputs(cfg: RlConfig) -> None:
    """A missing CRM or prompt file stops the start with what to do about it."""
    missing = [f"{key}={getattr(cfg, key)}" for key in ("checkpoint", "prompts")
               if not Path(getattr(cfg, key)).exists()]
    if cfg.controls.flipped not in (None, "derived") and not Path(cfg.controls.flipped).exists():
        missing.append(f"controls.flipped={cfg.controls.flipped}")
    if missing:
        raise ConfigError(f"{' and '.join(missing)}: no such file or directory. The defaults are "
                          "the demo's CRM and data: `make demo` makes them (about 5 minutes on 2 "
                          "CPU cores); or train with yours: `crm-rl checkpoint=EXPORT_OR_CKPT "
                          "prompts=PROMPTS.jsonl`")
    if cfg.policy.path is not None and not Path(cfg.policy.path).is_dir():
        raise ConfigError(f"policy.path={cfg.policy.path}: no such directory (a local HF causal LM)")


def run(composed: DictConfig) -> dict:
    started = time.time()
    cfg = settings(composed)
    check_inputs(cfg)
    save_run_record(composed)
    import torch  # after the checks: a refusal answers before torch and TRL load

    from crm.core.records import RecordError
    from crm.inference.reward import CRMRewardError
    from crm.rl.demo import PlanError
    from crm.rl.demo import run as run_plan

    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        result = run_plan(cfg, run_dir)
    except (CRMRewardError, PlanError, RecordError) as exc:  # bad input: one line, exit 2
        raise ConfigError(str(exc)) from None
    result["wall_seconds"] = round(time.time() - started, 1)
    write_json(run_dir / "rl.json", result)
    return result


def summary(result: dict) -> str:
    lines = [f"initial policy: {result['initial']['mean_tokens']} tokens "
             f"({result['initial']['clipped_share']:.0%} clipped)"]
    for name, entry in {**result["runs"], **{f"guard {k}": v for k, v in result["guards"].items()
                                            if isinstance(v, dict)}}.items():
        crm = entry.get("crm")
        reward = (f"; CRM reward {crm['reward_start']} -> {crm['reward_end']}, final beats "
                  f"initial {crm['final_beats_initial']}" if crm else "")
        lines.append(f"{name:>24}: {entry['length']['mean_tokens']:6.2f} tokens "
                     f"({entry['length_change']:+.2f}; {entry['length']['clipped_share']:.0%} "
                     f"clipped){reward}")
    ev = result["evidence"]
    failed = [k for k, ok in ev["checks"].items() if not ok]
    if not ev["checks"]:
        lines.append("evidence: no checks (no run expects a direction: runs[].expect)")
    else:
        lines.append("evidence: " + ("all checks pass" if ev["all_passed"] else f"FAILED {failed}")
                     + f" ({json.dumps(ev['checks'])})")
    return "\n".join(lines)


@hydra.main(version_base="1.3", config_path="pkg://crm_configs", config_name="rl")
@one_line_config_errors
def main(cfg: DictConfig) -> None:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    result = run(cfg)
    print(summary(result))
    print(f"crm-rl: {Path(HydraConfig.get().runtime.output_dir) / 'rl.json'} "
          f"({result['wall_seconds']} s)")


if __name__ == "__main__":
    sys.exit(main())
