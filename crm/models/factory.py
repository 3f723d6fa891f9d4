"""Builds a PairwiseCRM or PointwiseCRM around a Qwen3 sequence classifier."""
from __future__ import annotations

import torch

from crm.models.backbone import build_classifier
from crm.models.heads import PairwiseCRM, PointwiseCRM


def build_crm(kind: str, *, num_labels: int, pad_token_id: int | None, path: str | None = None,
              arch: str | dict | None = None, attention: str = "auto",
              dtype: torch.dtype = torch.float32, margin: float = 0.0, center_coef: float = 0.0,
              device=None):
    """kind "pairwise" (num_labels 2, or 3 with ties) or "pointwise" (one reward).

    device="meta" builds shapes only: from a `path`, no weight is read (see build_classifier).
    """
    if kind == "pairwise":
        model = build_classifier(num_labels=num_labels, pad_token_id=pad_token_id, path=path,
                                 arch=arch, attention=attention, dtype=dtype, device=device)
        return PairwiseCRM(model)
    if kind == "pointwise":
        model = build_classifier(num_labels=1, pad_token_id=pad_token_id, path=path, arch=arch,
                                 attention=attention, dtype=dtype, device=device)
        return PointwiseCRM(model, margin=margin, center_coef=center_coef)
    raise ValueError(f"CRM kind {kind!r}: expected pairwise or pointwise")
