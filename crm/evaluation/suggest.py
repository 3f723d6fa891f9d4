"""Which pairs a user should vote on (`crm-leaderboard ... suggest_votes=N`).

The rule: a random sample, spread evenly. The N pairs go round the ranked models in turn (each
model gets N / M, the first models in the benchmark's order one more when M does not divide N),
and each model's pairs come from its queries shuffled within each topic, topics taken in turn,
so a model's votes spread over the topics too. Seeded: the same seed, selection and votes give
the same pairs. Pairs the user already voted on are left out, so the next batch continues the
same sample.

Why not the pairs where the CRM is least sure, which would narrow the intervals fastest: the
PPI intervals (crm.evaluation.ppi) rest on the votes being a random sample of the ranked pairs.
Picked by the CRM's doubt, the votes would over-represent the pairs where the CRM errs and PPI
would over-correct, unless every vote carried its inverse selection probability (active
inference, Zrnic and Candes 2024), which this version does not do. Spreading the sample evenly
over models and topics is what keeps it random and still narrows every model's interval: a
model's interval shrinks with its own votes, which an unlucky draw could leave at none.
"""
from __future__ import annotations

import random
from collections.abc import Collection, Sequence


def suggest_pairs(selection, n: int, seed: int = 0,
                  exclude: Collection[tuple[str, str]] = ()) -> list[tuple[str, str]]:
    """Up to `n` (idx, model) pairs of `selection` (crm.evaluation.leaderboard.Selection) to vote
    on, by the module's rule."""
    rng = random.Random(f"crm-suggest/{seed}")
    queues = {}
    for model in selection.models:
        by_topic = {t: [r.idx for r in selection.records
                        if r.topic == t and (r.idx, model) not in exclude]
                    for t in selection.topics}
        order = list(selection.topics)
        rng.shuffle(order)
        for idx in by_topic.values():
            rng.shuffle(idx)
        queue = []
        while any(by_topic.values()):
            for topic in order:
                if by_topic[topic]:
                    queue.append(by_topic[topic].pop())
        queues[model] = queue
    out: list[tuple[str, str]] = []
    while len(out) < n and any(queues.values()):
        for model in selection.models:
            if queues[model] and len(out) < n:
                out.append((queues[model].pop(0), model))
    return out


def suggestion_lines(selection, pairs: Sequence[tuple[str, str]], criteria: Sequence[str]
                     ) -> list[dict]:
    """suggested_votes.jsonl's lines: what a user needs to give a verdict, and the fields of a
    votes line (idx, model; the user adds verdict)."""
    records = {r.idx: r for r in selection.records}
    lines = []
    for idx, model in pairs:
        record = records[idx]
        lines.append({"idx": idx, "model": model, "topic": record.topic,
                      "criteria": list(criteria), "prompt": record.prompt,
                      "baseline": record.responses[selection.baseline][-1].content,
                      "response": record.responses[model][-1].content})
    return lines
