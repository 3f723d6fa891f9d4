"""crm: Customizable Reward Models and user-centric subjective leaderboards.

The public names load their module on first use (PEP 562), so `import crm.core.records` still
imports no torch.
"""
from __future__ import annotations

import importlib

_PUBLIC = {  # name -> the module that defines it
    "CRMReward": "crm.inference.reward",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'crm' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
