"""The host's cost of laying out one micro batch (crm.data.packing.pack and its neighbours), on the
training process's main thread: the time each layout takes on one CPU thread, so that a reader can
compare it with a GPU step. Prints one JSON document.

    python benchmarks/pack_speed.py [--pairs 8] [--shared 300] [--response 900] [--repeats 200]

A micro batch of `pairs` pointwise records whose chosen and rejected rows share `shared` tokens
(criteria + query) and continue with `response` tokens each (random ids, as the tokenizer's);
timed: split_shared + pack as the stream calls it (with the gather kernel's views: CPU; without:
CUDA), and pad_rows of the same rows (the padded path). Min and median of `repeats` calls.
"""
from __future__ import annotations

import argparse
import inspect
import json
import platform
import random
import statistics
import subprocess
import time

import torch

from crm.data.packing import pack, split_shared
from crm.data.padding import pad_rows


def rows(pairs: int, shared: int, response: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(seed)
    out = []
    for _ in range(pairs):
        prefix = [rng.randrange(3, 32000) for _ in range(shared)]
        chosen = prefix + [rng.randrange(3, 32000) for _ in range(response)]
        rejected = prefix + [rng.randrange(3, 32000) for _ in range(response)]
        out.append((chosen, rejected))
    return out


def timed(call, repeats: int) -> dict:
    call()  # warm: first-call allocations
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
    return {"min_ms": round(min(seconds) * 1e3, 3), "median_ms": round(statistics.median(seconds) * 1e3, 3)}


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor()
    return next((line.split(":", 1)[1].strip() for line in out.splitlines()
                 if line.startswith("Model name")), platform.processor())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=8)
    p.add_argument("--shared", type=int, default=300)
    p.add_argument("--response", type=int, default=900)
    p.add_argument("--repeats", type=int, default=200)
    a = p.parse_args()
    torch.set_num_threads(1)
    batch = rows(a.pairs, a.shared, a.response)
    segments = lambda: [split_shared(c, r) for c, r in batch]  # noqa: E731
    results = {
        "split_shared": timed(segments, a.repeats),
        "split_shared_and_pack_with_views": timed(lambda: pack(segments()), a.repeats),
        "pad_rows": timed(lambda: pad_rows([c for c, _ in batch] + [r for _, r in batch], 0), a.repeats),
    }
    if "views" in inspect.signature(pack).parameters:  # the layout without the CPU kernel's views
        results["split_shared_and_pack_without_views"] = timed(lambda: pack(segments(), views=False),
                                                               a.repeats)
    print(json.dumps({"benchmark": "pack_speed", "pairs": a.pairs, "shared_tokens": a.shared,
                      "response_tokens": a.response,
                      "row_tokens": a.pairs * (a.shared + 2 * a.response), "repeats": a.repeats,
                      "torch_threads": 1, "cpu": cpu_model(), "torch": torch.__version__,
                      "results": results}, indent=2))


if __name__ == "__main__":
    main()
