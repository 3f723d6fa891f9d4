"""Criteria extraction throughput against an endpoint of fixed latency: how close `crm-data criteria`
comes to the bound concurrency / latency.

The endpoint is tests/openai_stub.py in a process of its own (its own interpreter: the client is
measured, not the GIL it would share with the server), answering every request after `--latency`
seconds. For each concurrency, a fresh output directory and enough 55k-format votes for about
`--seconds` at the bound; the time is the whole `extract()` call behind `crm-data criteria` (reading
the CSV, asking, writing train.jsonl), so the rate is, if anything, pessimistic. The goal: at
concurrency 32, at least 80% of the bound.

    python benchmarks/criteria_throughput.py [--latency 0.1] [--seconds 3]

Prints one JSON document: per concurrency the votes, seconds, votes/s, the bound and its fraction,
and the client's CPU time per vote (the bound at 32 needs 320 x that per second: a machine whose
cores are taken by other jobs cannot give it, and the fraction then measures the machine).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from data_tools.criteria import AskConfig, extract

STUB = Path(__file__).resolve().parent.parent / "tests" / "openai_stub.py"
CONCURRENCIES = (1, 8, 32)
GOAL = 0.8  # of the bound, at concurrency 32


def write_votes(path: Path, n: int) -> None:
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["id", "model_a", "model_b", "prompt", "response_a", "response_b",
                         "winner_model_a", "winner_model_b", "winner_tie"])
        for i in range(n):
            writer.writerow([i, "m1", "m2", json.dumps([f"Question {i}: how do I boil an egg?"]),
                             json.dumps([f"Boil it for {i % 12} minutes, then cool it in water."]),
                             json.dumps(["Put it in water and wait."]), i % 2, 1 - i % 2, 0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--latency", type=float, default=0.1, help="seconds the endpoint takes per answer")
    p.add_argument("--seconds", type=float, default=5.0, help="run length at the bound, per concurrency")
    args = p.parse_args()
    server = subprocess.Popen([sys.executable, str(STUB), "--latency", str(args.latency)],
                              stdout=subprocess.PIPE, text=True)
    try:
        base_url = server.stdout.readline().strip()
        results = {}
        with tempfile.TemporaryDirectory() as tmp:
            for concurrency in CONCURRENCIES:
                bound = concurrency / args.latency
                n = max(concurrency, round(bound * args.seconds))
                votes = Path(tmp) / f"votes-{concurrency}.csv"
                write_votes(votes, n)
                cfg = AskConfig(base_url=base_url, model="stub", concurrency=concurrency, timeout=30)
                start, cpu = time.perf_counter(), time.process_time()
                summary = extract(votes, Path(tmp) / f"out-{concurrency}", cfg, progress=False)
                seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
                assert summary["written"] == summary["asked"] == n, summary
                rate = n / summary["ask_seconds"]
                results[str(concurrency)] = {"votes": n, "seconds": summary["ask_seconds"],
                                             "votes_per_s": round(rate, 1), "bound": round(bound, 1),
                                             "of_bound": round(rate / bound, 3),
                                             "command_votes_per_s": round(n / seconds, 1),
                                             "client_cpu_ms_per_vote": round(1000 * cpu / n, 2)}
    finally:
        server.kill()
        server.wait()
    print(json.dumps({"latency_s": args.latency, "load_average_1min": os.getloadavg()[0],
                      "cpus": os.cpu_count(), "concurrency": results,
                      "goal": f">= {GOAL:.0%} of the bound at concurrency 32",
                      "goal_met": results["32"]["of_bound"] >= GOAL}, indent=1))


if __name__ == "__main__":
    main()
