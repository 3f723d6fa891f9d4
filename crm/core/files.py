"""Files written whole or not at all."""
from __future__ import annotations

import json
from pathlib import Path


def write_json(path: str | Path, obj) -> Path:
    """`obj` as indented UTF-8 JSON at `path`, via a temporary file: a reader (another rank, a
    resumed job, a user) never sees half a document."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path
