"""crm-rl's settings: the harness's `Plan` (configs/rl.yaml's schema extends it), the GRPO run's
and the tiny policy's, read by crm.rl.demo, crm.rl.grpo and crm.rl.policy.

Plain Python, no torch: a command composes and checks its config before loading torch
(crm.models.config says why).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

from crm.inference.config import STRATEGIES

EXPECT = {"shorter": -1, "longer": 1}


@dataclass(frozen=True)
class GRPOSettings:
    max_steps: int = 15
    prompts_per_step: int = 8  # prompts per optimizer step; each gets num_generations completions
    num_generations: int = 4
    max_completion_length: int = 48
    learning_rate: float = 1e-3
    beta: float = 0.0  # KL coefficient to the initial policy (TRL's default is 0: no reference model)
    temperature: float = 1.0
    overlong_cache: int = 0  # > 0: DAPO's soft overlong punishment over the last this-many tokens
    scale_rewards: str = "group"  # TRL's advantage scaling: group (GRPO) | batch | none
    logging_steps: int = 5

    def __post_init__(self):
        if self.max_steps < 1 or self.prompts_per_step < 1 or self.max_completion_length < 1:
            raise ValueError("grpo: max_steps, prompts_per_step and max_completion_length are >= 1")
        if self.num_generations < 2:
            raise ValueError(f"grpo.num_generations={self.num_generations}: at least 2 (GRPO "
                             "compares the completions of a group)")
        if self.scale_rewards not in ("group", "batch", "none"):
            raise ValueError(f"grpo.scale_rewards={self.scale_rewards}: group, batch or none")


@dataclass(frozen=True)
class PolicyConfig:
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    max_position_embeddings: int = 512


@dataclass  # not frozen: a list's elements stay overridable (runs.0.expect=...)
class Run:
    """One GRPO run under the CRM: its name, the criteria, the direction the harness checks."""

    name: str = MISSING
    criteria: list[str] = MISSING
    expect: str | None = None  # shorter | longer | None (no check: criteria not about length)

    def __post_init__(self):
        if not self.criteria or not all(isinstance(c, str) and c.strip() for c in self.criteria):
            raise ValueError(f"runs: {self.name}: criteria must be a non-empty list of non-empty "
                             "strings")
        if self.expect is not None and self.expect not in EXPECT:
            raise ValueError(f"runs: {self.name}: expect={self.expect}: shorter, longer or null")


@dataclass(frozen=True)
class RewardSettings:
    strategy: str | None = None  # None: pointwise for a pointwise CRM, round_robin for a pairwise one
    tau: float = 1.0
    log_odds: bool = False
    batch_size: int = 32

    def __post_init__(self):
        if self.strategy is not None and self.strategy not in STRATEGIES:
            raise ValueError(f"reward.strategy={self.strategy}: null or one of {', '.join(STRATEGIES)}")


@dataclass(frozen=True)
class WarmUp:
    steps: int = 150
    batch_size: int = 16
    lr: float = 3e-3
    max_sentences: int = 5


@dataclass(frozen=True)
class PolicySettings:
    path: str | None = None  # a local HF causal LM and its tokenizer; None: the tiny one, warmed up
    arch: PolicyConfig = field(default_factory=PolicyConfig)
    warm_up: WarmUp = field(default_factory=WarmUp)

    def __post_init__(self):
        if self.path is None and self.warm_up.steps < 1:
            raise ValueError("policy.warm_up.steps: the tiny policy needs a warm-up (at least 1 "
                             "step) to stop before the length limit")


@dataclass(frozen=True)
class Measure:
    prompts: int = 16  # held-out prompts, never trained on
    per_prompt: int = 4
    seed: int = 1234
    examples: int = 2  # sample texts kept per run in the JSON


@dataclass(frozen=True)
class Controls:
    constant: bool = True
    flipped: str | None = "derived"  # derived | a CRM trained on flipped labels | None: no run
    epsilon: float = 0.05  # the most a constant reward may move the mean length, share of max
    min_gap: float = 0.3  # the least gap between the shorter and the longer run, share of max


@dataclass(frozen=True)
class Guards:
    under: str | None = "detailed"  # the run the guards repeat (None: no guard runs)
    beta: float | None = 1.0
    overlong_cache: int | None = 16
    unbounded: bool = True


@dataclass(frozen=True)
class Plan:
    """Everything a crm-rl run does (configs/rl.yaml, whose schema extends it)."""

    checkpoint: str = MISSING
    prompts: str = MISSING
    runs: list[Run] = MISSING
    reward: RewardSettings = field(default_factory=RewardSettings)
    grpo: GRPOSettings = field(default_factory=GRPOSettings)
    policy: PolicySettings = field(default_factory=PolicySettings)
    measure: Measure = field(default_factory=Measure)
    controls: Controls = field(default_factory=Controls)
    guards: Guards = field(default_factory=Guards)
    seed: int = 0
    device: str | None = None  # the CRM's: None, cuda when visible, else cpu

    def __post_init__(self):
        if self.runs == MISSING:
            return  # a schema still being composed
        names = [r.name for r in self.runs]
        if not names:
            raise ValueError("runs: no runs; e.g. 'runs=[{name: mine, criteria: [\"I like short "
                             "answers.\"]}]'")
        if len(set(names)) != len(names):
            raise ValueError(f"runs: two runs share a name ({', '.join(names)})")
        if self.guards.under is not None and self.guards.under not in names:
            raise ValueError(f"guards.under={self.guards.under}: not a run ({', '.join(names)}); "
                             "null: no guard runs")
