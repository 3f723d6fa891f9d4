"""Token-id rows -> the right-padded batch a CRM reads (training stream and scorer alike)."""
from __future__ import annotations

import torch


def pad_rows(rows: list[list[int]], pad_id: int) -> dict:
    """Right-padded input_ids and attention_mask; the head reads each row's last real token."""
    width = max((len(r) for r in rows), default=1)
    input_ids = torch.tensor([r + [pad_id] * (width - len(r)) for r in rows], dtype=torch.long)
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    attention_mask = (torch.arange(width) < lengths[:, None]).long()
    return {"input_ids": input_ids.reshape(len(rows), width), "attention_mask": attention_mask}
