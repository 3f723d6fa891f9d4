"""Files written whole or not at all."""
from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path

from crm.core.errors import ConfigError


def file_digest(path: str | Path) -> str:
    """The SHA-256 of a file's bytes, hex."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_json(path: str | Path, obj) -> Path:
    """`obj` as indented UTF-8 JSON at `path`, via a temporary file: a reader (another rank, a
    resumed job, a user) never sees half a document."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(finite(obj), indent=1, ensure_ascii=False, allow_nan=False) + "\n",
                   encoding="utf-8")
    tmp.replace(path)
    return path


def write_jsonl(path: str | Path, rows) -> Path:
    """`rows` as JSON Lines at `path`, via a temporary file as `write_json`. An OSError leaves
    an earlier file at `path` as it was, and no temporary file behind."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as out:
            for row in rows:
                out.write(json.dumps(finite(row), ensure_ascii=False, allow_nan=False) + "\n")
        tmp.replace(path)
    except OSError:
        if tmp.is_file():
            tmp.unlink()
        raise
    return path


def finite(obj):
    """`obj` with NaN and infinities as None: Python writes them as NaN and Infinity, which is not
    JSON and most parsers refuse. A figure that can be undefined says why beside its null."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def write_kept(content: str, directory: Path, name: str, keep: int) -> Path:
    """`content` as directory/<its hash>/name (a download's file keeps its plain name), and only
    the `keep` most recently written of directory/*/name kept (the oldest deleted first)."""
    path = directory / hashlib.sha256(content.encode()).hexdigest()[:16] / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content, encoding="utf-8")
    written = sorted(directory.glob(f"*/{name}"), key=_written)
    for old in written[:max(0, len(written) - keep)]:
        shutil.rmtree(old.parent, ignore_errors=True)
    return path


def _written(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except FileNotFoundError:  # deleted by a concurrent write
        return 0


def refuse_replacing(path: str | Path, inputs: dict, earlier_inputs, allow: str) -> None:
    """Results an earlier run wrote at `path` (a JSON document) are replaced only by a run of the
    same inputs. `inputs` names this run's (checkpoint, data files, ...); `earlier_inputs` reads
    the same keys from the earlier document. A key that differs is a ConfigError naming both
    values and `allow`, the flag that lets this run write elsewhere or replace them: a researcher
    re-running a command by habit must not lose another run's results without a word."""
    path = Path(path)
    if not path.is_file():
        return
    try:
        before = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        before = None
    earlier = earlier_inputs(before) if isinstance(before, dict) else {}
    differ = [key for key, value in inputs.items() if earlier.get(key) != value]
    if differ:
        theirs = ", ".join(f"{k}={_shown(earlier.get(k))}" for k in differ)
        ours = ", ".join(f"{k}={_shown(inputs[k])}" for k in differ)
        raise ConfigError(f"{path.parent} holds the results of {theirs} (this run: {ours}): {allow}")


def _shown(value) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(map(str, value)) + "]"
    return str(value)


def refuse_foreign(path: str | Path, mark: str | Path, whose: str, allow: str) -> None:
    """An existing `path` without `mark` (a file the command writes with every output of its own)
    is not the command's earlier output: the user's data file given as OUT by a slip, another
    command's files. A ConfigError naming `allow`, the flag that replaces it; a re-run replaces
    its own output without a word (`refuse_replacing` tells one input's output from another's)."""
    path = Path(path)
    if path.exists() and not Path(mark).exists():
        raise ConfigError(f"{path} exists and is not an output of {whose} (no {mark}): {allow}")


def refuse_file_as_dir(path: str | Path, what: str) -> None:
    """An output directory that is a file (or under one) is a ConfigError saying so and `what`
    goes in it, before mkdir's bare "File exists"."""
    path = Path(path)
    file = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    if file is not None:
        where = "is a file" if file == path else f"is under a file ({file})"
        raise ConfigError(f"{path} {where}, not a directory: {what}; give a new directory or an "
                          "existing one")
