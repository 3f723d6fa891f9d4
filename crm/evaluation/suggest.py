"""Which pairs a user should vote on (`crm-leaderboard ... suggest_votes.pairs=N`).

The votes are a sample of each model's pairs that PPI (crm.evaluation.ppi) can correct the CRM
with: each model gets N / M of them (the first models in the benchmark's order one more when M
does not divide N), drawn from its pairs the CRM scored, and the lines go round the models in
turn, so that voting on the first k lines is still such a sample. Seeded: the same seed, board
and votes give the same pairs. Two strategies (`suggest_votes.strategy`):

- `uniform` (the default): each model's pairs uniformly at random, without replacement. Pairs
  the user already voted on are left out, so the next batch continues the same sample.
- `active`: each model's pairs with unequal, known inclusion probabilities (active inference,
  Zrnic and Candes 2024), larger where the CRM is less sure of the user's outcome: pi ∝ a mix
  of the outcome's standard deviation under the CRM's probabilities (P(win), P(tie)) and a
  uniform share, which bounds each vote's weight. Drawn by systematic sampling over a random
  order, so each pair's inclusion probability is exactly its pi; each line carries it as `p`
  and PPI weights the vote by 1 / p. The whole batch is drawn at once (a second batch would
  change every pair's probability): with votes already given, `uniform` continues instead.
"""
from __future__ import annotations

import random
from collections.abc import Collection, Sequence
from dataclasses import dataclass

STRATEGIES = ("uniform", "active")
# active's uniform share of each pair's inclusion probability: a vote weighs at most 1 / this
# times a uniform vote, so a pair the CRM was sure of and wrong on cannot swamp its model.
UNIFORM_SHARE = 0.3


@dataclass(frozen=True)
class Suggestion:
    idx: str
    model: str
    p: float | None = None  # inclusion probability (strategy=active); None: uniform


def suggest_pairs(judged: Sequence, models: Sequence[str], n: int, seed: int = 0,
                  exclude: Collection[tuple[str, str]] = (), strategy: str = "uniform",
                  tie_value: float = 0.0) -> list[Suggestion]:
    """Up to `n` pairs to vote on, by the module's rule, from `judged`: the board's Outcomes
    (crm.evaluation.leaderboard), the pairs the CRM scored."""
    if strategy not in STRATEGIES:
        raise ValueError(f"suggest_votes.strategy={strategy!r}: one of {', '.join(STRATEGIES)}")
    if strategy == "active" and exclude:
        raise ValueError("suggest_votes.strategy=active draws the whole batch at once: with votes "
                         "already given, continue with strategy=uniform")
    rng = random.Random(f"crm-suggest/{seed}")
    quota = {m: n // len(models) + (i < n % len(models)) for i, m in enumerate(models)}
    queues = {}
    for model in models:
        mine = [o for o in judged if o.model == model and (o.idx, o.model) not in exclude]
        if strategy == "uniform":
            rng.shuffle(mine)
            queues[model] = [Suggestion(o.idx, model) for o in mine]
        else:
            queues[model] = _systematic(mine, quota[model], tie_value, rng)
    out: list[Suggestion] = []
    while len(out) < n and any(queues.values()):
        for model in models:
            if queues[model] and len(out) < n:
                out.append(queues[model].pop(0))
    return out


def inclusion_probabilities(judged: Sequence, k: int, tie_value: float = 0.0) -> list[float]:
    """Each pair's probability to be among `k` drawn (they sum to k): proportional to
    UNIFORM_SHARE / N + (1 - UNIFORM_SHARE) sd / sum(sd), sd the user's outcome's standard
    deviation if the CRM's probabilities were the user's; a pair whose share passes 1 is taken
    for sure and the rest share what is left."""
    sds = []
    for o in judged:
        mean = o.p_win + tie_value * o.p_tie
        sds.append(max(o.p_win + tie_value ** 2 * o.p_tie - mean ** 2, 0.0) ** 0.5)
    total = sum(sds)
    weights = [UNIFORM_SHARE / len(sds) + (1 - UNIFORM_SHARE) * (s / total if total else
                                                                 1 / len(sds)) for s in sds]
    k = min(k, len(weights))
    pi = [0.0] * len(weights)
    sure: set[int] = set()
    while True:
        free = [i for i in range(len(weights)) if i not in sure]
        mass = sum(weights[i] for i in free)
        left = k - len(sure)
        over = {i for i in free if left * weights[i] / mass >= 1}
        if not over:
            for i in free:
                pi[i] = left * weights[i] / mass
            for i in sure:
                pi[i] = 1.0
            return pi
        sure |= over


def _systematic(judged: list, k: int, tie_value: float, rng: random.Random) -> list[Suggestion]:
    """`k` pairs by systematic sampling over a random order: pair i is drawn with exactly its
    inclusion probability pi_i; returned in random order, each carrying its pi."""
    if not judged or k <= 0:
        return []
    pi = inclusion_probabilities(judged, k, tie_value)
    order = list(range(len(judged)))
    rng.shuffle(order)
    start, cumulative, picked = rng.random(), 0.0, []
    for i in order:
        before, cumulative = cumulative, cumulative + pi[i]
        # drawn when a point start + j (j = 0, 1, ...) falls in [before, cumulative)
        if int(cumulative - start + 1) > int(before - start + 1):
            picked.append(i)
    rng.shuffle(picked)
    return [Suggestion(judged[i].idx, judged[i].model, pi[i]) for i in picked]


def suggestion_lines(selection, pairs: Sequence[Suggestion], criteria: Sequence[str]
                     ) -> list[dict]:
    """suggested_votes.jsonl's lines: what a user needs to give a verdict, and a votes line's
    fields (crm.evaluation.user_votes): a line with "verdict" added is a vote."""
    records = {r.idx: r for r in selection.records}
    lines = []
    for pair in pairs:
        record = records[pair.idx]
        line = {"idx": pair.idx, "model": pair.model, "topic": record.topic,
                "criteria": list(criteria), "bench": selection.fingerprint,
                "prompt": record.prompt,
                "baseline": record.responses[selection.baseline][-1].content,
                "response": record.responses[pair.model][-1].content}
        if pair.p is not None:
            line["p"] = round(pair.p, 6)
        lines.append(line)
    return lines
