"""What a board's verdicts depend on, and where they are kept: fingerprints, keys, memory, disk.

A criteria set is judged once over every benchmark pair; its outcomes, with the slot-bias
measurement and the orders it was judged in, are kept under a key that hashes everything a
verdict depends on: the CRM's fingerprint (the contents of its files), the benchmark's (the file's
contents), the baseline, the normalised criteria, `both_orders`, the slot sample and its seed, and
the dtype. A changed checkpoint or benchmark changes every key, so its old verdicts are never found.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import NamedTuple

from crm.core.files import file_digest, write_json
from crm.core.lru import LRU
from crm.evaluation.leaderboard import Outcome

log = logging.getLogger("crm.app")
# Of the files on disk; part of every key, so files of an earlier format are never found (they
# are scored again) and age out. 2: each outcome keeps its P(tie); 3: with the slot-bias
# measurement and the orders judged; 4: both orders made one verdict by slot_bias.both_orders.
FORMAT = 4


class Verdicts(NamedTuple):
    """A criteria set's judgement: every pair's outcome, the slot-bias measurement (None when
    not measured) and whether the pairs were judged in both orders."""

    outcomes: list[Outcome]
    slot_bias: dict | None = None
    both_orders: bool = False


def crm_files(checkpoint: str | Path) -> list[Path]:
    """The files a CRM's scores depend on: an export directory's or a sharded checkpoint's, or a
    checkpoint file (crm-train's checkpoints carry their tokenizer and template)."""
    path = Path(checkpoint)
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file())
    return [path]


def crm_fingerprint(checkpoint: str | Path) -> str:
    """sha256 over the CRM's files (names and contents): the weights are read once at start-up."""
    root = Path(checkpoint)
    digest = hashlib.sha256()
    for path in crm_files(root):
        name = path.relative_to(root) if root.is_dir() else path.name
        digest.update(f"{name}\0{file_digest(path)}\0".encode())
    return digest.hexdigest()


def verdict_key(fields: dict) -> str:
    return hashlib.sha256(json.dumps({"format": FORMAT, **fields}, sort_keys=True,
                                     ensure_ascii=False).encode()).hexdigest()


class VerdictCache:
    """Outcomes per verdict key: an LRU in memory over JSON files on disk (`directory` None: memory
    only). A restart serves from disk what it has seen; a damaged file is a miss, never an error.
    The disk keeps the `disk_entries` most recently used files."""

    def __init__(self, directory: str | Path | None, memory_entries: int = 32,
                 disk_entries: int = 1000):
        self.directory = Path(directory) if directory else None
        self.disk_entries = disk_entries
        self.memory = LRU(memory_entries)
        if self.directory:
            self.directory.mkdir(parents=True, exist_ok=True)

    def get(self, fields: dict) -> Verdicts | None:
        key = verdict_key(fields)
        verdicts = self.memory.get(key)
        if verdicts is None and self.directory:
            verdicts = self._read(key, fields)
            if verdicts is not None:
                self.memory.put(key, verdicts)
        return verdicts

    def put(self, fields: dict, verdicts: Verdicts) -> None:
        key = verdict_key(fields)
        self.memory.put(key, verdicts)
        if self.directory:
            self._write(key, fields, verdicts)

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}.json"

    def _read(self, key: str, fields: dict) -> Verdicts | None:
        path = self._path(key)
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
            if saved["format"] != FORMAT or saved["fields"] != fields:
                raise ValueError("its fields differ from the key's")
            verdicts = Verdicts([Outcome(*o) for o in saved["outcomes"]], saved["slot_bias"],
                                bool(saved["both_orders"]))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring the cached verdicts %s: %s", path, exc)
            return None
        os.utime(path)  # recently used: the last to be evicted
        return verdicts

    def _write(self, key: str, fields: dict, verdicts: Verdicts) -> None:
        write_json(self._path(key), {
            "format": FORMAT, "fields": fields, "slot_bias": verdicts.slot_bias,
            "both_orders": verdicts.both_orders, "outcomes": [
                [o.model, o.topic, o.result, o.p_win, o.idx, o.p_tie] for o in verdicts.outcomes]})
        files = self._by_age()
        for old in files[:max(0, len(files) - self.disk_entries)]:
            old.unlink(missing_ok=True)

    def _by_age(self) -> list[Path]:
        ages = {}
        for path in self.directory.glob("*.json"):
            try:
                ages[path] = path.stat().st_mtime_ns
            except FileNotFoundError:  # evicted by a concurrent write
                pass
        return sorted(ages, key=ages.get)
