"""The demo's controls: rewards that must NOT move the policy the way the CRM does.

- `constant_reward`: the same value for every completion. GRPO's advantages are then zero, so the
  policy's length may move only by what the training loop does on its own.
- `flipped_scorer`: a CRM that prefers the opposite of what the criteria say, DERIVED from a
  trained one, not trained: a pairwise CRM with its two label rows of the head swapped (P(A) and
  P(B) trade places), a pointwise one with its reward negated. If the length moved because of a
  rule in the wrapper rather than the CRM's judgement, it would move the same way under this CRM.
  The strongest form, a CRM trained on flipped labels, can be given to crm-rl instead
  (`controls.flipped=PATH`).
"""
from __future__ import annotations

import torch

from crm.inference.scorer import CRMScorer


def constant_reward(value: float = 0.5):
    def constant(prompts, completions, completion_ids=None, **columns) -> list[float]:
        return [value] * len(completions)
    return constant


def flip(scorer: CRMScorer) -> CRMScorer:
    """`scorer`, its model made to prefer what it dispreferred (see the module doc), in place:
    give it a scorer loaded for the purpose."""
    head = scorer.model.score.weight  # Qwen3ForSequenceClassification's head: (labels, hidden), no bias
    with torch.no_grad():
        if scorer.kind == "pointwise":
            head.neg_()
        else:
            head[[0, 1]] = head[[1, 0]].clone()  # model_a <-> model_b; a tie row stays
    return scorer
