"""Throughput of the data stream on the demo data: shards -> transforms -> prompts -> token ids.

Prints one JSON document: samples/s with 0 and 2 DataLoader workers (one full epoch each, one rank)
and the real-token fraction of the batches (non-pad tokens / computed tokens), with length grouping
and, for comparison, without it (window of one batch = arrival order).

    python benchmarks/data_stream.py [--n-train 6000] [--batch-size 32] [--max-tokens 512]
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import replace

from crm.data.manifest import load_manifest
from crm.data.config import StreamConfig
from crm.data.stream import PairStream, StreamLoader
from crm.models.tokenizer import train_bpe_tokenizer
from crm.core.records import read_lines
from crm.data.transforms import TransformConfig
from crm.data.demo import write_demo
from crm.data.shard import shard


def training_texts(path: str):
    for line in read_lines(path, "train"):
        if line.record:
            r = line.record
            yield " ".join(r.a_criteria + r.b_criteria + tuple(m.content for m in r.model_a + r.model_b))


def one_epoch(manifest, tokenizer, cfg: StreamConfig, transform: TransformConfig, workers: int) -> dict:
    dataset = PairStream(manifest.shards("train"), tokenizer, cfg, transform, manifest.criteria_pool)
    loader = StreamLoader(dataset, num_workers=workers)
    start = time.perf_counter()
    samples = real = computed = 0
    for batch in loader:
        samples += len(batch["keys"])
        real += int(batch["attention_mask"].sum())
        computed += batch["input_ids"].numel()
    seconds = time.perf_counter() - start
    return {"samples": samples, "seconds": round(seconds, 2), "samples_per_s": round(samples / seconds, 1),
            "real_token_fraction": round(real / computed, 4)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-train", type=int, default=6000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--vocab-size", type=int, default=2048)
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        write_demo(f"{tmp}/raw", seed=0, n_train=args.n_train)
        shard([f"{tmp}/raw/train.jsonl"], f"{tmp}/shards", shard_size=1000)
        manifest = load_manifest(f"{tmp}/shards")
        tokenizer = train_bpe_tokenizer(training_texts(f"{tmp}/raw/train.jsonl"), args.vocab_size)
        # The demo recipe's transforms: both directions, swaps and random noise exercise every path.
        transform = TransformConfig(direction="random", noise="random", swap_prob=0.5)
        cfg = StreamConfig(batch_size=args.batch_size, max_tokens=args.max_tokens, packing=False)
        result = {
            "data": {"train_records": sum(s.records for s in manifest.shards("train")),
                     "batch_size": args.batch_size, "max_tokens": args.max_tokens,
                     "cpu_cores": os.cpu_count()},
            "pairwise_workers_0": one_epoch(manifest, tokenizer, cfg, transform, 0),
            "pairwise_workers_2": one_epoch(manifest, tokenizer, cfg, transform, 2),
            "pointwise_workers_2": one_epoch(manifest, tokenizer, replace(cfg, mode="pointwise"),
                                             transform, 2),
            "pairwise_no_length_grouping_workers_2": one_epoch(
                manifest, tokenizer, replace(cfg, window_batches=1), transform, 2),
        }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
