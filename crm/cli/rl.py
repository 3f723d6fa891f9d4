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
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from crm.cli.common import one_line_config_errors
from crm.core.errors import ConfigError
from crm.core.files import write_json

log = logging.getLogger("crm.rl")


def check_inputs(cfg: DictConfig) -> None:
    """A missing CRM or prompt file stops the start with what to do about it."""
    missing = [f"{key}={cfg[key]}" for key in ("checkpoint", "prompts") if not Path(cfg[key]).exists()]
    if cfg.controls.flipped not in (None, "derived") and not Path(cfg.controls.flipped).exists():
        missing.append(f"controls.flipped={cfg.controls.flipped}")
    if missing:
        raise ConfigError(f"{' and '.join(missing)}: no such file or directory. The defaults are "
                          "the demo's CRM and data: `make demo` makes them (about 5 minutes on 2 "
                          "CPU cores); or train with yours: `crm-rl checkpoint=EXPORT_OR_CKPT "
                          "prompts=PROMPTS.jsonl`")
    if cfg.policy.path is not None and not Path(cfg.policy.path).is_dir():
        raise ConfigError(f"policy.path={cfg.policy.path}: no such directory (a local HF causal LM)")


def plan_of(cfg: DictConfig):
    """The harness's plan (plain dataclasses) from the config, every setting checked."""
    from crm.rl.demo import (EXPECT, Controls, Guards, Measure, Plan, RewardSettings, Run,
                             WarmUp)
    from crm.rl.grpo import GRPOSettings
    from crm.rl.policy import PolicyConfig

    if not cfg.runs:
        raise ConfigError("runs: no runs; e.g. 'runs=[{name: mine, criteria: [\"I like short answers.\"]}]'")
    runs = {}
    for i, spec in enumerate(cfg.runs):
        name = spec.get("name")
        if not isinstance(name, str) or not name or name in runs:
            raise ConfigError(f"runs[{i}].name: a name of its own is needed ({name!r})")
        criteria = spec.get("criteria")
        criteria = [criteria] if isinstance(criteria, str) else list(criteria or [])
        if not criteria or not all(isinstance(c, str) and c.strip() for c in criteria):
            raise ConfigError(f"runs[{i}].criteria: a non-empty list of non-empty strings")
        expect = spec.get("expect")
        if expect is not None and expect not in EXPECT:
            raise ConfigError(f"runs[{i}].expect={expect}: shorter, longer or null")
        runs[str(name)] = Run(tuple(criteria), expect)
    if cfg.guards.under is not None and cfg.guards.under not in runs:
        raise ConfigError(f"guards.under={cfg.guards.under}: not a run ({', '.join(runs)}); "
                          "null: no guard runs")
    if cfg.policy.path is None and cfg.policy.warm_up.steps < 1:
        raise ConfigError("policy.warm_up.steps: the tiny policy needs a warm-up (at least 1 step) "
                          "to stop before the length limit")
    grpo = GRPOSettings(**OmegaConf.to_container(cfg.grpo), seed=cfg.seed)
    if grpo.max_steps < 1 or grpo.num_generations < 2 or grpo.max_completion_length < 1:
        raise ConfigError("grpo: max_steps >= 1, num_generations >= 2 (GRPO compares a group) and "
                          "max_completion_length >= 1")
    return Plan(checkpoint=str(cfg.checkpoint), prompts=str(cfg.prompts), runs=runs,
                reward=RewardSettings(**OmegaConf.to_container(cfg.reward)), grpo=grpo,
                policy_path=cfg.policy.path,
                policy=PolicyConfig(**OmegaConf.to_container(cfg.policy.arch)),
                warm_up=WarmUp(**OmegaConf.to_container(cfg.policy.warm_up)),
                measure=Measure(**OmegaConf.to_container(cfg.measure)),
                controls=Controls(**OmegaConf.to_container(cfg.controls)),
                guards=Guards(**OmegaConf.to_container(cfg.guards)), seed=cfg.seed,
                device=cfg.device)


def run(cfg: DictConfig) -> dict:
    import torch

    from crm.core.records import RecordError
    from crm.inference.reward import CRMRewardError
    from crm.rl.demo import PlanError
    from crm.rl.demo import run as run_plan

    started = time.time()
    check_inputs(cfg)
    plan = plan_of(cfg)
    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        result = run_plan(plan, run_dir)
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
