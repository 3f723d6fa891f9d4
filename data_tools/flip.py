"""`crm-data flip`: training records with the two sides' criteria (and criteria topics) swapped and
the vote kept, so that the label follows the *other* side's criteria. A CRM trained on them learns
the opposite of every preference: the control that shows an RL reward's signal is the CRM's
(docs/RL.md, crm-rl's `controls.flipped`)."""
from __future__ import annotations

import json
from pathlib import Path

from crm.core.files import refuse_foreign
from crm.core.records import read_lines

SWAPPED = (("a_criteria", "b_criteria"), ("a_broad_criteria_topic", "b_broad_criteria_topic"))


def flip(src: str | Path, out: str | Path, *, overwrite: bool = False) -> dict:
    """Writes `out` (JSONL) and, beside it, `<out>.rejects.jsonl` (file, line, field, reason of every
    line not flipped); both appear only when the whole input was read. Returns the counts:
    read = written + rejected. A README-format file (one side's criteria) is refused whole. An
    existing `out` is replaced only when it is an earlier flip's (its rejects beside it) or with
    `overwrite`: `flip A B` meant as two inputs must not erase B."""
    out = Path(out)
    if out.resolve() == Path(src).resolve():
        raise ValueError(f"{out}: the output would overwrite the input it reads")
    rejects_path = out.with_name(out.name + ".rejects.jsonl")
    if not overwrite:
        refuse_foreign(out, rejects_path, "crm-data flip", "give a new OUT.jsonl, or --overwrite to "
                       "replace it")
    partial = [p.with_name(p.name + ".partial") for p in (out, rejects_path)]
    written = rejected = 0
    try:
        with open(partial[0], "w", encoding="utf-8") as sink, \
                open(partial[1], "w", encoding="utf-8") as rejects:
            for line in read_lines(src, "train"):
                if line.error:
                    rejected += 1
                    rejects.write(json.dumps(line.error.as_dict()) + "\n")
                    continue
                obj = json.loads(line.text)
                for a, b in SWAPPED:
                    if a in obj or b in obj:
                        obj[a], obj[b] = obj.get(b), obj.get(a)
                sink.write(json.dumps(obj, ensure_ascii=False) + "\n")
                written += 1
        partial[0].replace(out)
        partial[1].replace(rejects_path)
    finally:
        for p in partial:
            p.unlink(missing_ok=True)
    return {"read": written + rejected, "written": written, "rejected": rejected,
            "rejects": str(rejects_path)}
