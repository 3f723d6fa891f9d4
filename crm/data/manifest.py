"""manifest.json: what a shard directory holds, written by `crm-data shard`, read by the stream.

The stream plans an epoch from the manifest's per-shard counts (records and ties), so every rank
knows its share without reading the data first.
"""
from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass
from pathlib import Path

from crm.core.files import write_json
from crm.data.transforms import CriteriaPool

FORMAT = "crm-shards"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class ShardInfo:
    url: str
    records: int
    ties: int = 0
    one_sided: int = 0  # README-format records: only the preferred side's criteria (transforms)

    def eligible(self, keep_ties: bool) -> int:
        return self.records if keep_ties else self.records - self.ties


@dataclass(frozen=True)
class Manifest:
    root: str  # where shard urls are relative to
    splits: dict  # split name -> list[ShardInfo]
    criteria_pool: CriteriaPool | None
    raw: dict

    @property
    def path(self) -> str:
        return posixpath.join(self.root, MANIFEST)

    @property
    def one_sided(self) -> bool:
        """Whether any shard holds README-format records (only the preferred side's criteria)."""
        return any(s.one_sided for shards in self.splits.values() for s in shards)

    def shards(self, split: str) -> list[ShardInfo]:
        if split not in self.splits:
            raise ValueError(f"{self.path}: no split {split!r}; "
                             f"it has {sorted(self.splits)}")
        return self.splits[split]


def load_manifest(path: str | Path) -> Manifest:
    """Read a manifest from a shard directory or from the manifest file's own path."""
    path = Path(path)
    if path.is_dir():
        path = path / MANIFEST
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no manifest (make shards with `crm-data shard`)") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: manifest is not JSON: {exc}") from None
    if raw.get("format") != FORMAT or raw.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: format {raw.get('format')!r} version {raw.get('format_version')!r}; "
                         f"this crm reads {FORMAT!r} version {FORMAT_VERSION}")
    root = str(path.parent)
    splits = {
        name: [ShardInfo(_resolve(root, s["url"]), s["records"], s.get("ties", 0), s.get("one_sided", 0))
               for s in split["shards"]]
        for name, split in raw["splits"].items()
    }
    pool = raw.get("criteria_pool")
    return Manifest(root, splits, CriteriaPool.from_dict(pool) if pool else None, raw)


def _resolve(root: str, url: str) -> str:
    """Shard urls are relative to the manifest unless absolute (a path, `pipe:`, or a URL)."""
    if url.startswith(("/", "pipe:")) or "://" in url:
        return url
    return posixpath.join(root, url)


def write_manifest(out_dir: str | Path, manifest: dict) -> Path:
    return write_json(Path(out_dir) / MANIFEST,
                      {"format": FORMAT, "format_version": FORMAT_VERSION, **manifest})
