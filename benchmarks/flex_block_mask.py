"""Host memory and time of a packed row's FlexAttention block mask on CPU, built as crm builds it
(crm.models.packing.block_mask: from per-tile bounds) and as it was built before (torch's
create_block_mask without compile, which evaluates the mask at all T x T pairs). Prints one JSON
document.

    python benchmarks/flex_block_mask.py [--tokens 6400 12800 29500] [--methods tiles dense]

A row of 4 pointwise records (micro batch 4), each a shared prefix of 20% of a row and two
branches (crm-plan's prompt_share 0.2), T tokens in all: 29,500 is crm-plan's recommended 1.7B
pointwise run (micro batch 4 at 7,373 tokens a record). Each (method, T) runs in a fresh process:
the peak resident set (ru_maxrss) after building the mask less before, and the seconds it took.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

RECORDS, SHARE = 4, 0.2


def row_ids(tokens: int):
    import torch

    from crm.data.packing import pack

    per_record = tokens // RECORDS
    row = round(per_record / (2 - SHARE))
    shared = round(row * SHARE)
    branch = (per_record - shared) // 2
    segments = [([1] * shared, [2] * branch, [3] * (per_record - shared - branch))
                for _ in range(RECORDS)]
    batch = pack(segments, views=False)
    return batch["segment_ids"], batch["branch_ids"], torch


def dense_block_mask(segment_ids, branch_ids):
    """The mask as crm built it before: create_block_mask, eager, over the same rule."""
    from torch.nn.attention.flex_attention import create_block_mask

    def keep(batch, head, q, kv):
        same_branch = (branch_ids[kv] == 0) | (branch_ids[kv] == branch_ids[q])
        return (segment_ids[q] == segment_ids[kv]) & (kv <= q) & same_branch

    n = segment_ids.shape[0]
    return create_block_mask(keep, None, None, n, n, device=segment_ids.device)


def one(method: str, tokens: int) -> dict:
    from crm.models.packing import block_mask

    segment_ids, branch_ids, torch = row_ids(tokens)
    torch.set_num_threads(1)
    build = block_mask if method == "tiles" else dense_block_mask
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    mask = build(segment_ids, branch_ids)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"method": method, "tokens": int(segment_ids.numel()),
            "peak_rss_growth_mib": round((peak - before) / 1024, 1), "seconds": round(seconds, 3),
            "kept_tiles": int(mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[6400, 12800, 29500])
    p.add_argument("--methods", nargs="+", default=["tiles", "dense"], choices=["tiles", "dense"])
    p.add_argument("--one", nargs=2, metavar=("METHOD", "TOKENS"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        print(json.dumps(one(a.one[0], int(a.one[1]))))
        return
    from pack_speed import cpu_model

    import torch

    results = []
    for tokens in a.tokens:
        for method in a.methods:
            out = subprocess.run([sys.executable, __file__, "--one", method, str(tokens)],
                                 capture_output=True, text=True, check=True)
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(json.dumps({"benchmark": "flex_block_mask", "records": RECORDS, "prompt_share": SHARE,
                      "cpu": cpu_model(), "torch": torch.__version__, "torch_threads": 1,
                      "results": results}, indent=2))


if __name__ == "__main__":
    main()
