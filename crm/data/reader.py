"""Reading shard members as JSON, and nothing else (and the text of a split, for a tokenizer).

webdataset's default decoders unpickle `.pyd`/`.pickle` members: a shard from anywhere could run
code. Here a member is read as bytes and parsed as JSON; a sample with any other member is refused
with an error naming the shard and the member, before its bytes are read.
"""
from __future__ import annotations

import json
import tarfile
from collections.abc import Iterator

import webdataset as wds

from crm.core.errors import ShardError
from crm.core.records import parse_train

JSON_EXT = "json"


def split_member(name: str) -> tuple[str, str]:
    # webdataset's convention: the key is the path up to the first dot of the basename.
    directory, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{directory}/{stem}" if directory else stem), ext


def iter_shard_raw(url: str) -> Iterator[tuple[str, bytes]]:
    """(key, the JSON member's bytes) for every sample of a tar shard, in file order."""
    stream = wds.gopen(url)
    try:
        with tarfile.open(fileobj=stream, mode="r|*") as tar:
            for info in tar:
                if not info.isreg():
                    continue
                key, ext = split_member(info.name)
                if ext != JSON_EXT:
                    raise ShardError(f"{url}: member {info.name!r}: only .{JSON_EXT} members are "
                                     f"read; refusing .{ext} (never unpickled)")
                yield key, tar.extractfile(info).read()
    except tarfile.TarError as exc:
        raise ShardError(f"{url}: not a readable tar shard: {exc}") from None
    finally:
        stream.close()


def load_member(url: str, key: str, data: bytes):
    try:
        return json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise ShardError(f"{url}: member {key}.{JSON_EXT}: bad JSON: {exc}") from None


def iter_shard(url: str) -> Iterator[tuple[str, dict]]:
    """(key, JSON object) for every sample of a tar shard, in file order."""
    for key, data in iter_shard_raw(url):
        yield key, load_member(url, key, data)


def training_texts(shards, template) -> Iterator[str]:
    """What a tokenizer for this data should know: the prompt template's text, then every record's
    criteria and messages (`shards`: the manifest's training shards)."""
    yield template.pairwise + template.pointwise
    for shard in shards:
        for _, obj in iter_shard(shard.url):
            r = parse_train(obj)
            yield "\n".join(r.a_criteria + r.b_criteria + tuple(m.content for m in r.model_a + r.model_b))
