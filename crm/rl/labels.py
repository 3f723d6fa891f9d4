"""The per-sample label the OpenRLHF and verl adapters read the criteria from.

Neither trainer has a place for criteria, but both carry a free per-sample value to the reward:
OpenRLHF its `labels` (the dataset column `--data.label_key` names), verl its
`reward_model.ground_truth`. crm reads that value as:

- a list of strings: the criteria;
- a string: one criterion, or a JSON object (text) of the form below;
- an object `{"criteria": [...] or "...", "query": "...", "reference": "..."}`: `query` is the
  user's query as the CRM should read it (optional, see each adapter), `reference` a reference
  answer (needed by strategy `reference`).
"""
from __future__ import annotations

import json
from typing import NamedTuple

from crm.core.errors import excerpt
from crm.inference.reward import CRMRewardError


class Label(NamedTuple):
    criteria: list[str]
    query: str | None = None
    reference: str | None = None


def parse_label(value, row: int) -> Label:
    if isinstance(value, str) and value.lstrip().startswith("{"):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise CRMRewardError(f"row {row}: the label looks like JSON but is not ({exc.msg})") from None
        except (RecursionError, ValueError):  # nested past the parser's depth; a huge number
            raise CRMRewardError(f"row {row}: the label's JSON is nested too deeply or holds a "
                                 "number too long to read") from None
    if isinstance(value, dict):
        unknown = set(value) - {"criteria", "query", "reference"}
        if unknown:
            raise CRMRewardError(f"row {row}: unknown label keys {excerpt(sorted(unknown))}; a label "
                                 "holds criteria, query and reference")
        criteria = value.get("criteria")
        query, reference = value.get("query"), value.get("reference")
        for name, text in (("query", query), ("reference", reference)):
            if text is not None and not isinstance(text, str):
                raise CRMRewardError(f"row {row}: label {name} must be a string")
    else:
        criteria, query, reference = value, None, None
    if isinstance(criteria, str):
        criteria = [criteria] if criteria.strip() else []  # "" holds no criterion
    if not isinstance(criteria, list) or not criteria:
        raise CRMRewardError(f"row {row}: no criteria in the label {excerpt(value)}: a list of "
                             "strings, one string, or {\"criteria\": [...]}")
    return Label(criteria, query, reference)
