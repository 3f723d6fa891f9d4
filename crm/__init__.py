"""crm: Customizable Reward Models and user-centric subjective leaderboards (README "Python API").

The names a user calls from Python, each imported from its module on first use (PEP 562): `import
crm` costs nothing, and `import crm.core.records` still loads no torch.
"""
from __future__ import annotations

import importlib

_EXPORTS = {  # name -> the module that defines it
    "CRMScorer": "crm.inference.scorer",  # load an export or any checkpoint; compare, score
    "PairExample": "crm.core.examples",  # what CRMScorer.pair_probabilities judges
    "PromptTemplate": "crm.core.prompts",  # a CRM's prompt wording
    "load_crm": "crm.models.checkpoint",  # any crm-train checkpoint -> HF model, tokenizer, card
    "export_checkpoint": "crm.models.checkpoint",  # crm-export: a checkpoint -> a HF directory
    "evaluate_files": "crm.evaluation.accuracy",  # crm-eval: accuracy of test files
    "select": "crm.evaluation.leaderboard",  # crm-leaderboard: a benchmark's examples to rank
    "leaderboard": "crm.evaluation.leaderboard",  # crm-leaderboard: leaderboard.json's document
    "Bootstrap": "crm.evaluation.leaderboard",  # the win rates' intervals
    "read_votes": "crm.evaluation.user_votes",  # a user's votes: leaderboard(..., votes=) -> PPI intervals
    "CRMReward": "crm.inference.reward",  # a CRM and a user's criteria as TRL's reward function
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'crm' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # the next access is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
