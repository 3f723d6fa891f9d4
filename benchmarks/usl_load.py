"""crm-usl under load: latency of uncached and cached boards, alone and with concurrent clients.

Starts `crm-usl` on 127.0.0.1 (a free port, a fresh verdict cache) on the demo's CRM and benchmark
(or --checkpoint/--bench/--baseline), then calls its /rank endpoint through Gradio's REST protocol
(POST /gradio_api/call/rank, then read the event stream), with thin httpx clients so that the
figures are the server's:

1. uncached: boards under new criteria, one at a time (each judges every benchmark pair);
   pairs scored per second = pairs per board / latency.
2. cached: boards already scored, one at a time: the same board again, and topic changes (the
   same criteria, other topics: the verdicts are reused, the win rates and intervals recomputed).
3. while scoring: one client scores --scoring boards back to back while --watchers users ask
   for cached boards and topic changes, each every --think seconds: a cached board must not
   wait behind a scoring.
4. concurrent: --clients clients x --requests requests, each a new criteria set every
   --new-every requests and otherwise a repeat of the pool's criteria on random topics (cached
   requests sent while another client's uncached one was in flight reported apart). Requests the
   server refuses (the model's waiting line full, or Gradio's queue full) are counted, not errors.

Bounded: phases 3 and 4 send at most --scoring + watchers x 200 and clients x requests requests,
and everything stops after --deadline seconds. Prints one JSON document; latencies are wall time
on this machine, with its load average before and after.

    python benchmarks/usl_load.py [--clients 8] [--requests 6] [--uncached 5] [--cached 20]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
from serving import machine, start_usl

ROOT = Path(os.environ.get("CRM_ROOT", "."))
TARGETS = {"uncached_p50_s": 2.0, "cached_p95_ms": 100.0}


class Refused(Exception):
    """The server said busy (the model's line) or queue full: expected under load."""


def rank(http: httpx.Client, url: str, criteria: str, topics: list[str]) -> dict:
    posted = http.post(f"{url}/gradio_api/call/rank", json={"data": [criteria, topics]})
    if posted.status_code == 503:
        raise Refused("queue full")
    posted.raise_for_status()
    event_id = posted.json()["event_id"]
    event, data = None, None
    with http.stream("GET", f"{url}/gradio_api/call/rank/{event_id}") as stream:
        for line in stream.iter_lines():
            if line.startswith("event:"):
                event = line.split(":", 1)[1].strip()
            elif line.startswith("data:") and event in ("complete", "error"):
                data = json.loads(line.split(":", 1)[1])
                break
    if event == "error":
        message = (data or {}).get("error") or ""
        if "busy" in message or "queue is full" in message.lower():
            raise Refused(message)
        raise RuntimeError(f"error event: {message}")
    if event != "complete" or not data:
        raise RuntimeError(f"no result (last event {event!r})")
    return data[0]


def timed(http, url, criteria, topics) -> float:
    start = time.perf_counter()
    rank(http, url, criteria, topics)
    return time.perf_counter() - start


def summary(seconds: list[float], unit: str = "s") -> dict:
    if not seconds:
        return {"n": 0}
    scale = 1000.0 if unit == "ms" else 1.0
    values = np.asarray(seconds) * scale
    return {"n": len(values), f"p50_{unit}": round(float(np.percentile(values, 50)), 3),
            f"p95_{unit}": round(float(np.percentile(values, 95)), 3),
            f"max_{unit}": round(float(values.max()), 3)}


def while_scoring_phase(args, url: str, topics: list[str], pool: list[str],
                        deadline: float) -> dict:
    scoring_done = threading.Event()
    lock = threading.Lock()
    cached, scored, errors = [], [], []

    def scorer() -> None:
        with httpx.Client(timeout=args.deadline) as http:
            for i in range(args.scoring):
                if time.time() > deadline:
                    break
                try:
                    scored.append(timed(http, url, f"While others read, I want style {i}.", []))
                except Exception as exc:
                    errors.append(f"{type(exc).__name__}: {exc}")
        scoring_done.set()

    def watcher(w: int) -> None:
        rng = random.Random(100 + w)
        with httpx.Client(timeout=args.deadline) as http:
            for _ in range(200):
                if scoring_done.is_set() or time.time() > deadline:
                    return
                chosen = rng.sample(topics, rng.randint(1, len(topics)))
                try:
                    seconds = timed(http, url, rng.choice(pool), chosen)
                    if not scoring_done.is_set():  # answered while the model was scoring
                        with lock:
                            cached.append(seconds)
                except Exception as exc:
                    with lock:
                        errors.append(f"{type(exc).__name__}: {exc}")
                time.sleep(args.think)

    threads = [threading.Thread(target=scorer)]
    threads += [threading.Thread(target=watcher, args=(w,)) for w in range(args.watchers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"watchers": args.watchers, "think_s": args.think, "scored": summary(scored),
            "cached": summary(cached, "ms"), "errors": len(errors),
            "error_samples": errors[:5]}


def concurrent_phase(args, url: str, topics: list[str], pool: list[str], deadline: float) -> dict:
    lock = threading.Lock()
    scoring = {"in_flight": 0}
    results = {"uncached": [], "cached": [], "cached_while_scoring": [], "refused": [],
               "errors": []}

    def client(c: int) -> None:
        rng = random.Random(c)
        with httpx.Client(timeout=args.deadline) as http:
            for r in range(args.requests):
                if time.time() > deadline:
                    return
                new = r % args.new_every == 0
                criteria = f"Client {c} wants answers in style {r}." if new else rng.choice(pool)
                chosen = rng.sample(topics, rng.randint(1, len(topics)))
                with lock:
                    scoring["in_flight"] += new
                    busy_at_start = scoring["in_flight"] - new > 0
                try:
                    seconds = timed(http, url, criteria, chosen)
                    kind = "uncached" if new else "cached"
                    with lock:
                        results[kind].append(seconds)
                        if not new and busy_at_start:
                            results["cached_while_scoring"].append(seconds)
                except Refused as exc:
                    with lock:
                        results["refused"].append(str(exc))
                except Exception as exc:  # every other failure is an error the JSON reports
                    with lock:
                        results["errors"].append(f"{type(exc).__name__}: {exc}")
                finally:
                    with lock:
                        scoring["in_flight"] -= new

    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    refused = results["refused"]
    return {"clients": args.clients, "requests_per_client": args.requests,
            "new_criteria_every": args.new_every,
            "wall_s": round(time.perf_counter() - started, 2),
            "uncached": summary(results["uncached"]),
            "cached": summary(results["cached"], "ms"),
            "cached_while_scoring": summary(results["cached_while_scoring"], "ms"),
            "refused_busy": sum("queue full" not in m.lower() for m in refused),
            "refused_queue_full": sum("queue full" in m.lower() for m in refused),
            "errors": len(results["errors"]), "error_samples": results["errors"][:5]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", default=str(ROOT / "outputs/demo/export"))
    parser.add_argument("--bench", default=str(ROOT / ".cache/demo/raw/bench.jsonl"))
    parser.add_argument("--baseline", default="baseline")
    parser.add_argument("--uncached", type=int, default=5, help="phase 1 boards")
    parser.add_argument("--cached", type=int, default=20, help="phase 2 boards of each kind")
    parser.add_argument("--scoring", type=int, default=4, help="phase 3 boards scored")
    parser.add_argument("--watchers", type=int, default=4, help="phase 3 cached-board users")
    parser.add_argument("--think", type=float, default=0.25,
                        help="phase 3: seconds between a watcher's requests")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=6, help="per client in phase 3")
    parser.add_argument("--new-every", type=int, default=3,
                        help="phase 3: a new criteria set every N requests of a client")
    parser.add_argument("--deadline", type=float, default=600, help="seconds for all phases")
    args = parser.parse_args()
    for path in (args.checkpoint, args.bench):
        if not Path(path).exists():
            sys.exit(f"{path}: missing. `make demo` makes the demo's CRM and benchmark, or pass "
                     "--checkpoint/--bench/--baseline (CRM_ROOT=DIR for another demo root)")
    records = [json.loads(line) for line in Path(args.bench).read_text().splitlines()
               if line.strip()]
    topics = list(dict.fromkeys(r["topic"] for r in records))
    models = {m for r in records for m in r["responses"]} - {args.baseline}
    load_before = os.getloadavg()
    deadline = time.time() + args.deadline
    with tempfile.TemporaryDirectory(prefix="usl-load-") as work:
        proc, url, _ = start_usl(Path(work), f"checkpoint={args.checkpoint}",
                                 f"bench={args.bench}", f"baseline={args.baseline}")
        try:
            with httpx.Client(timeout=args.deadline) as http:
                pool = [f"I prefer answers of kind {i}." for i in range(args.uncached)]
                uncached = [timed(http, url, c, []) for c in pool]
                rng = random.Random(0)
                same = [timed(http, url, pool[0], []) for _ in range(args.cached)]
                change = [timed(http, url, rng.choice(pool),
                                rng.sample(topics, rng.randint(1, len(topics))))
                          for _ in range(args.cached)]
                version = rank(http, url, pool[0], [])["version"]
            while_scoring = while_scoring_phase(args, url, topics, pool, deadline)
            concurrent = concurrent_phase(args, url, topics, pool, deadline)
        finally:
            proc.terminate()
            proc.wait(60)
    pairs = len(records) * len(models)
    cached_p95 = max(summary(same, "ms")["p95_ms"], summary(change, "ms")["p95_ms"])
    while_p95 = while_scoring["cached"].get("p95_ms")
    print(json.dumps({
        "checkpoint": args.checkpoint, "version": version, "bench": args.bench,
        "queries": len(records), "models": len(models), "pairs_per_board": pairs,
        "uncached": {**summary(uncached),
                     "pairs_per_s": round(pairs / float(np.median(uncached)), 1)},
        "cached_same_board": summary(same, "ms"),
        "cached_topic_change": summary(change, "ms"),
        "while_scoring": while_scoring,
        "concurrent": concurrent,
        "errors": while_scoring["errors"] + concurrent["errors"],
        "targets": {"uncached_p50_s<=2": summary(uncached)["p50_s"] <= TARGETS["uncached_p50_s"],
                    "cached_p95_ms<=100": cached_p95 <= TARGETS["cached_p95_ms"],
                    "cached_while_scoring_p95_ms<=100": (while_p95 is not None and
                                                         while_p95 <= TARGETS["cached_p95_ms"])},
        "machine": machine(load_before),
    }, indent=1))


if __name__ == "__main__":
    main()
