"""The OpenRLHF reward server under OpenRLHF's load (docs/RL.md, "OpenRLHF").

Prints one JSON document. OpenRLHF 0.11.2 posts one sample per request, a whole rollout batch at
once, each request on a new aiohttp session (openrlhf/utils/agent.py `_fetch_rewards_via_http`,
180 s timeout). This benchmark does the same: for each concurrency level it opens that many
requests at the same moment, each one distinct sample (a demo query in ChatML, an answer cut after
1-5 sentences, the data's answer as the label's reference), and measures every request's latency
from the moment all were launched; errors and timeouts are counted, not retried.

The server is `python -m crm.rl.openrlhf` in its own process (one torch thread), serving the
demo's tiny CRM architecture (random init: a forward costs the same whatever the weights) with a
BPE trained on the demo data, `reference` strategy. Next to each level: the scorer's own time for
the same samples in one reward call (a fresh CRMReward in this process, one thread), the floor
any server pays; the goal is p95 latency within 2x of it. The server's CPU seconds per level
(all its threads, from /proc) compare servers where wall time is shared with other jobs.

    python benchmarks/openrlhf_load.py [--levels 64 512 2048] [--batch-wait 0.01]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

import aiohttp
import torch
from serving import (CHATML, CRITERIA, cpu_seconds, export, machine, samples,
                     start_reward_server)

from crm.data.demo import write_demo
from crm.inference.reward import CRMReward


def payload(row) -> dict:
    query, response, reference = row
    prompt = CHATML.format(query)
    return {"query": [prompt + response + "<|im_end|>"], "prompts": [prompt],
            "labels": [{"criteria": CRITERIA, "reference": reference}]}


async def load(url: str, rows, timeout: float) -> dict:
    """All requests at once, as OpenRLHF sends them: latency per request, errors counted."""
    t0 = time.perf_counter()

    async def one(row):
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
                async with session.post(url, json=payload(row)) as response:
                    response.raise_for_status()
                    await response.json()
            return time.perf_counter() - t0, None
        except Exception as exc:
            return time.perf_counter() - t0, type(exc).__name__

    results = await asyncio.gather(*(one(row) for row in rows))
    wall = time.perf_counter() - t0
    latencies = sorted(r[0] for r in results if r[1] is None)
    errors: dict[str, int] = {}
    for _, error in results:
        if error:
            errors[error] = errors.get(error, 0) + 1

    def pct(p):
        return round(latencies[min(len(latencies) - 1, int(p * len(latencies)))], 3) if latencies else None

    return {"requests": len(rows), "answered": len(latencies), "errors": errors, "wall_s": round(wall, 3),
            "requests_per_s": round(len(latencies) / wall, 1), "p50_s": pct(0.50), "p95_s": pct(0.95),
            "max_s": round(latencies[-1], 3) if latencies else None}


def scorer_time(crm_dir: Path, rows) -> float:
    """One reward call over the same samples, fresh cache: what the server cannot go below."""
    reward = CRMReward(crm_dir, "reference", batch_size=32)
    t0 = time.perf_counter()
    reward([r[0] for r in rows], [r[1] for r in rows], criteria=[CRITERIA] * len(rows),
           reference=[r[2] for r in rows])
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--levels", type=int, nargs="+", default=[64, 512, 2048])
    p.add_argument("--batch-wait", type=float, default=0.01)
    p.add_argument("--module", default="crm.rl.openrlhf",
                   help="the server module (python -m MODULE CHECKPOINT --port 0 ...): compare another")
    p.add_argument("--timeout", type=float, default=180.0, help="per request, as OpenRLHF's client")
    args = p.parse_args()
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        write_demo(tmp, n_train=1500, n_test=2, n_bench=1)
        rows = samples(Path(tmp) / "train.jsonl", sum(args.levels) + 1)
        crm_dir = export(Path(tmp), rows)
        server, url = start_reward_server(crm_dir, "--batch-wait", str(args.batch_wait),
                                          module=args.module)
        try:
            asyncio.run(load(url, rows[:1], args.timeout))  # warm-up: the first forward
            levels, start = [], 1
            for n in args.levels:
                part = rows[start:start + n]  # distinct samples per level: no cached verdict helps
                start += n
                cpu0 = cpu_seconds(server.pid)
                result = asyncio.run(load(url, part, args.timeout))
                result["concurrency"] = n
                result["server_cpu_s"] = round(cpu_seconds(server.pid) - cpu0, 2)
                result["scorer_batch_s"] = round(scorer_time(crm_dir, part), 3)
                if result["p95_s"] is not None:
                    result["p95_over_scorer"] = round(result["p95_s"] / result["scorer_batch_s"], 2)
                levels.append(result)
        finally:
            server.terminate()
            server.wait(timeout=30)
    print(json.dumps({"server": args.module,
                      "strategy": "reference", "batch_wait_s": args.batch_wait, "levels": levels,
                      "machine": machine(load_before, server_threads=1)}, indent=1))


if __name__ == "__main__":
    main()
