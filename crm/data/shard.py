"""Validated JSONL -> tar shards of raw JSON records + manifest.json + rejects.jsonl (`crm-data shard`).

Nothing is lost silently: every non-blank line read is either written to a shard or written to
rejects.jsonl with its file, line, field and reason, and the manifest counts both, per split.
Inputs are training-format or README-format files (`criteria` + `preference`, the test format),
one format per file; a shard member is its input line as it was.
"""
from __future__ import annotations

import hashlib
import io
import json
import math
import random
import tarfile
from pathlib import Path

from crm.core.records import BenchRecord, TestRecord, as_training, read_lines
from crm.data.epoch_plan import even_split
from crm.core.files import refuse_file_as_dir, refuse_foreign, refuse_replacing
from crm.data.manifest import MANIFEST, write_manifest
from crm.data.transforms import CriteriaPool

TRAINING_FORMATS = ("train", "test")  # the test format is the README's training/test format

SPLITS = ("train", "val")
REJECTS = "rejects.jsonl"


def assign_split(seed: int, key: str, val_fraction: float) -> str:
    # Hashing the key (not a running draw) keeps each line's split when lines are added elsewhere.
    digest = hashlib.blake2b(f"split\x1f{seed}\x1f{key}".encode(), digest_size=8).digest()
    return "val" if int.from_bytes(digest, "little") / 2**64 < val_fraction else "train"


def sample_key(file_index: int, n_files: int, line: int) -> str:
    # No dots: webdataset cuts a member's key at the first dot of its name.
    return f"f{file_index}-{line:09d}" if n_files > 1 else f"l{line:09d}"


def balanced_sizes(n: int, max_size: int) -> list[int]:
    return even_split(n, math.ceil(n / max_size)) if n else []


def check_out_dir(out: Path, inputs: list[str]) -> None:
    """Shards of other inputs in `out` (104 records would silently become 30), or another
    command's rejects.jsonl there (`crm-data criteria`'s output dir), are not replaced: a
    ConfigError naming --overwrite. The same inputs re-shard in place."""
    allow = "shard into another OUT_DIR, or --overwrite to replace them"
    refuse_foreign(out / REJECTS, out / MANIFEST, "crm-data shard",
                   f"shard into another OUT_DIR (`crm-data criteria` writes a {REJECTS} beside its "
                   "train.jsonl), or --overwrite to replace it")
    refuse_replacing(out / MANIFEST, {"inputs": [str(p) for p in inputs]},
                     lambda before: {"inputs": before.get("inputs")}, allow)


def write_tar(path: Path, members: list[tuple[str, bytes]]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tarfile.open(tmp, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 0, 0o644  # byte-identical reruns
            tar.addfile(info, io.BytesIO(data))
    tmp.replace(path)


def shard(inputs: list[str], out_dir: str | Path, *, val_fraction: float = 0.05,
          shard_size: int = 5000, seed: int = 0, fmt: str | None = None,
          overwrite: bool = False) -> dict:
    """Write shards for `inputs`; returns the manifest. OSError if unreadable.

    `fmt` ("train" or "test") names the inputs' format; None detects it per file. `overwrite`
    replaces shards of other inputs, or another command's rejects.jsonl, in `out_dir`
    (`check_out_dir`).
    """
    if fmt not in (None, *TRAINING_FORMATS):
        raise ValueError(f"format {fmt!r}: shards hold one of {TRAINING_FORMATS}")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction}: expected a fraction in [0, 1)")
    if shard_size < 1:
        raise ValueError(f"shard_size={shard_size}: expected at least 1")
    out = Path(out_dir)
    refuse_file_as_dir(out, "OUT_DIR is the folder the shards, manifest.json and rejects.jsonl go in")
    if not overwrite:
        check_out_dir(out, inputs)
    out.mkdir(parents=True, exist_ok=True)
    kept = {s: [] for s in SPLITS}
    counts = {s: {"read": 0, "written": 0, "rejected": 0} for s in SPLITS}
    # Written aside and moved in with the manifest: a failed run (e.g. a missing input) must not
    # leave an earlier run's manifest next to this run's partial rejects.
    rejects_tmp = out / (REJECTS + ".tmp")
    try:
        with open(rejects_tmp, "w", encoding="utf-8") as rejects:
            for fi, path in enumerate(inputs):
                for line in read_lines(path, fmt):
                    if isinstance(line.record, BenchRecord):
                        raise ValueError(f"{path}:{line.number}: a bench-format record (prompt + "
                                         "responses) is not training data")
                    key = sample_key(fi, len(inputs), line.number)
                    split = assign_split(seed, key, val_fraction)
                    counts[split]["read"] += 1
                    if line.error:
                        counts[split]["rejected"] += 1
                        rejects.write(json.dumps({**line.error.as_dict(), "split": split,
                                                  "raw": line.text}, ensure_ascii=False) + "\n")
                    else:
                        record = line.record
                        if isinstance(record, TestRecord):
                            record = as_training(record)
                        kept[split].append((key, line.text, record))
    except BaseException:
        rejects_tmp.unlink(missing_ok=True)
        raise

    for stale in list(out.glob("train-*.tar")) + list(out.glob("val-*.tar")):
        stale.unlink()  # shards of an earlier run would otherwise look like part of this one
    splits = {}
    for split, items in kept.items():
        random.Random(f"shard:{seed}:{split}").shuffle(items)  # mix sources within each shard
        shards, i = [], 0
        for n, size in enumerate(balanced_sizes(len(items), shard_size)):
            chunk = items[i:i + size]
            i += size
            name = f"{split}-{n:06d}.tar"
            write_tar(out / name, [(f"{k}.json", text.encode("utf-8")) for k, text, _ in chunk])
            ties = sum(r.human_winner == "tie" for _, _, r in chunk)
            one_sided = sum(r.one_sided for _, _, r in chunk)
            shards.append({"url": name, "records": len(chunk), "ties": ties, "one_sided": one_sided})
        counts[split]["written"] = len(items)
        splits[split] = {"counts": counts[split], "shards": shards}

    total = {k: sum(c[k] for c in counts.values()) for k in ("read", "written", "rejected")}
    assert total["read"] == total["written"] + total["rejected"]
    manifest = {
        "inputs": [str(p) for p in inputs],
        "seed": seed,
        "val_fraction": val_fraction,
        "counts": total,
        "splits": splits,
        "rejects": REJECTS,
        "criteria_pool": CriteriaPool.from_records(r for _, _, r in kept["train"]).as_dict(),
    }
    rejects_tmp.replace(out / REJECTS)
    write_manifest(out, manifest)
    return manifest

