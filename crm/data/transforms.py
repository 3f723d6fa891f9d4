"""Direction, tie policy, A/B swap and criteria noise (docs/DESIGN.md section 4).

Pure functions of (record, rng). The rng of a record comes from `record_rng(seed, epoch, key)`, so a
record gets the same draw on any rank, worker or process, and a fresh one each epoch.
"""
from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, replace

from crm.core.errors import ConfigError
from crm.core.examples import LABEL_TIE, LABELS, PairExample, after_query, swap
from crm.core.records import TrainRecord

DIRECTIONS = ("original", "reverse", "random")
NOISES = ("none", "add", "remove", "replace", "random")
TIE_POLICIES = ("auto", "drop", "keep")
ARITHMETICS = ("fixed", "reference")


@dataclass(frozen=True)
class TransformSettings:
    """What a user sets: crm-train's `transform` section (configs/train.yaml) is this dataclass."""

    swap_prob: float = 0.5  # probability of swapping A and B; the label follows
    ties: str = "drop"  # "keep" trains a 3-way head; "auto" is decided by `tie_policy`
    arithmetic: str = "fixed"  # "reference" reproduces the reference's noise counts (without its crash)
    redraw_each_epoch: bool = True  # False: one draw per record for the whole run, as the reference

    def __post_init__(self):
        for name, allowed in (("ties", TIE_POLICIES), ("arithmetic", ARITHMETICS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"transform {name}={getattr(self, name)!r}: expected one of {allowed}")
        if (isinstance(self.swap_prob, bool) or not isinstance(self.swap_prob, (int, float))
                or not 0.0 <= self.swap_prob <= 1.0):
            raise ValueError(f"transform swap_prob={self.swap_prob}: expected a probability in [0, 1]")

    @property
    def num_labels(self) -> int:
        if self.ties == "auto":
            raise ValueError("transform ties=auto is decided by the loss (tie_policy) before use")
        return 3 if self.ties == "keep" else 2


def tie_policy(ties: str, loss_kind: str, tie_model: str = "none") -> str:
    """`auto`: a CRM that can say tie keeps ties (a pairwise one's 3-way head, a pointwise one
    with `loss.ties=davidson`); a Bradley-Terry pointwise one drops them (its pair needs a winner)."""
    if ties != "auto":
        return ties
    return "keep" if loss_kind == "pairwise" or tie_model != "none" else "drop"


@dataclass(frozen=True)
class TransformConfig(TransformSettings):
    """The settings and the run's direction and noise (crm-train's direction and noise groups)."""

    direction: str = "original"  # whose criteria: the winner's, the loser's, or either (50/50)
    noise: str = "none"  # criteria noise applied to the chosen criteria
    warmup_direction: str = "original"  # the direction of a run's first `warmup_batches` batches
    warmup_batches: int = 0  # per rank; 0 = no direction curriculum

    def __post_init__(self):
        super().__post_init__()
        for name, allowed in (("direction", DIRECTIONS), ("warmup_direction", DIRECTIONS),
                              ("noise", NOISES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"transform {name}={getattr(self, name)!r}: expected one of {allowed}")
        if isinstance(self.warmup_batches, bool) or not isinstance(self.warmup_batches, int) \
                or self.warmup_batches < 0:
            raise ValueError(f"transform warmup_batches={self.warmup_batches}: expected an int >= 0")

    def at_batch(self, index: int) -> "TransformConfig":
        """The transform of a rank's `index`-th batch of the run (counted over epochs)."""
        if index < self.warmup_batches:
            return replace(self, direction=self.warmup_direction, warmup_batches=0)
        return self


@dataclass(frozen=True)
class CriteriaPool:
    """Every training criterion with its topic id: where `add` noise draws from."""

    criteria: tuple[str, ...]
    topics: tuple[int, ...]

    @classmethod
    def from_records(cls, records) -> "CriteriaPool":
        seen: dict[tuple[str, int], None] = {}  # ordered: the pool must not depend on hash seeds
        for r in records:
            # per side: a side whose topic list is shorter must not shift the other side's topics
            for crits, tops in ((r.a_criteria, r.a_topics), (r.b_criteria, r.b_topics)):
                for crit, top in zip(crits, tops):
                    seen.setdefault((crit, top), None)
        return cls(tuple(c for c, _ in seen), tuple(t for _, t in seen))

    def as_dict(self) -> dict:
        return {"criteria": list(self.criteria), "topics": list(self.topics)}

    @classmethod
    def from_dict(cls, d: dict) -> "CriteriaPool":
        return cls(tuple(d["criteria"]), tuple(d["topics"]))

    def outside(self, topics, exclude=()) -> list[str]:
        banned, taken, out = set(topics), set(exclude), []
        for c, t in zip(self.criteria, self.topics):
            if t not in banned and c not in taken:  # the same text may be pooled under two topics
                taken.add(c)
                out.append(c)
        return out


def check_one_sided(cfg: TransformConfig) -> None:
    """Refuse a transform that README-format records cannot follow, before training starts.

    Such a record knows only the preferred side's criteria: a direction that shows the other
    side's has nothing to show. Noise uses what there is: `add` and `replace` draw from the
    criteria pool (see `apply_noise`).
    """
    directions = [("direction", cfg.direction)]
    if cfg.warmup_batches:
        directions.append(("warmup_direction", cfg.warmup_direction))
    for name, direction in directions:
        if direction != "original":
            raise ConfigError(
                f"transform {name}={direction!r} shows the losing side's criteria, but the data "
                "holds README-format records (criteria + preference), which carry only the "
                "preferred side's: train them with direction=original")


def draws_from_pool(noise: str, one_sided: bool) -> bool:
    """Whether `noise` needs the criteria pool: `add` (and `random`, which may draw it) always,
    `replace` where README-format records have no losing side to replace from."""
    return noise in ("add", "random") or (one_sided and noise == "replace")


def record_rng(seed: int, epoch: int, key: str) -> random.Random:
    # blake2b, not hash(): Python's string hash differs per process unless PYTHONHASHSEED is fixed.
    digest = hashlib.blake2b(f"{seed}\x1f{epoch}\x1f{key}".encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "little"))


def apply_noise(criteria: list[str], rejected: list[str] | None, rejected_topics, noise: str,
                pool: CriteriaPool | None, rng: random.Random, arithmetic: str = "fixed") -> list[str]:
    """Criteria noise. `rejected` are the criteria of the side that loses under `criteria`; None
    when they are unknown (README-format records), and then `replace` draws from the pool."""
    n = len(criteria)
    if noise == "random":
        noise = rng.choice(("none", "add", "remove", "replace"))
    if noise == "none":
        return list(criteria)
    if noise == "remove":
        keep = n // 2 if arithmetic == "reference" else max(1, n // 2)
        return rng.sample(criteria, keep)
    if noise == "add":
        if pool is None:
            raise ValueError("noise 'add' needs a criteria pool (the manifest's, or the training data's)")
        candidates = pool.outside(rejected_topics, exclude=criteria)
        added = rng.sample(candidates, min(n // 2, len(candidates)))
        out = list(criteria) + added
        rng.shuffle(out)
        return out
    if noise == "replace":
        # k = floor((n-1)/2) keeps the preferred side's criteria a strict majority; the reference's
        # floor(n/2)-1 does nothing for n = 2, 3 and is negative (a crash) for n = 1.
        k = (n - 1) // 2 if arithmetic == "fixed" else max(0, n // 2 - 1)
        if rejected is None:
            if pool is None:
                raise ValueError("noise 'replace' of a README-format record draws from a criteria pool")
            rejected = pool.outside((), exclude=criteria)
        k = min(k, len(rejected))
        out = list(criteria)
        for slot, replacement in zip(rng.sample(range(n), k), rng.sample(list(rejected), k)):
            out[slot] = replacement
        return out
    raise ValueError(f"unknown noise {noise!r}")


def train_example(record: TrainRecord, key: str, cfg: TransformConfig, rng: random.Random,
                  pool: CriteriaPool | None = None) -> PairExample:
    """Direction, noise and swap for one training record; every draw comes from `rng`."""
    if record.human_winner == "tie":
        if cfg.ties != "keep":
            raise ValueError(f"record {key}: a tie reached the transforms with ties={cfg.ties!r}")
        # Under a tie neither side's criteria decide; show one side's, drawn fairly.
        side = rng.choice(("model_a", "model_b"))
        label = LABEL_TIE
    else:
        direction = cfg.direction if cfg.direction != "random" else rng.choice(("original", "reverse"))
        loser = "model_b" if record.human_winner == "model_a" else "model_a"
        side = record.human_winner if direction == "original" else loser
        label = LABELS[side]
        if record.one_sided and side == loser:
            raise ValueError(f"record {key}: direction {direction!r} needs the losing side's "
                             "criteria; a README-format record has only the preferred side's")
    if side == "model_a":
        chosen, rejected, rejected_topics = record.a_criteria, record.b_criteria, record.b_topics
    else:
        chosen, rejected, rejected_topics = record.b_criteria, record.a_criteria, record.a_topics
    # One-sided: the loser's criteria are unknown, so noise bans no topic and replaces from the pool.
    rejected, rejected_topics = (None, ()) if record.one_sided else (list(rejected), rejected_topics)
    # Noise keeps the label only of criteria that decide the pair (the preferred side keeps a
    # strict majority); a `tie` or `user` record's criteria are already what a user writes, and
    # an added or swapped criterion could change what the rule says of them.
    noise = cfg.noise if record.shape == "decides" else "none"
    criteria = apply_noise(list(chosen), rejected, rejected_topics, noise, pool, rng, cfg.arithmetic)
    example = PairExample(key, tuple(criteria), record.query, after_query(record.model_a),
                          after_query(record.model_b), label, record.topic)
    return swap(example) if rng.random() < cfg.swap_prob else example
