"""Why a flood of connections made the reward server's probes late (issue 45): the garbage
collector's full passes over the heap of a server that has imported torch and transformers, with
and without `gc.freeze()` (crm.core.heap.freeze_startup_heap, which the servers call before
serving).

A server in its own process with crm.core.http's guarded uvicorn (server_config, the reward
server's limits: 4,096 connections, 3,072 an address) and a trivial app, after importing what the
reward server imports; it records each collection's generation and duration (gc.callbacks). From
this process: one small POST every 50 ms from 127.0.0.1 while 4,200 connections from 127.0.0.2
are opened and held 3 s (as benchmarks/server_hold.py's `silent` attack). Prints one JSON line
per run: the probes' worst latencies, the full collections' durations, the tracked objects.

    python benchmarks/gc_pause.py [--runs 3]

Bounded: 4,200 sockets a run, each with a timeout; 127.0.0.1 only.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import threading
import time

SERVER = r'''
import gc, json, socket, sys, threading, time
import torch, transformers  # the reward server's heap
import crm.rl.openrlhf
import uvicorn
from crm.core.heap import freeze_startup_heap
from crm.core.http import send_json, server_config

async def app(scope, receive, send):
    if scope["type"] == "http":
        while (await receive()).get("more_body"):
            pass
        await send_json(send, 200, {"ok": 1})

passes = []
def timed(phase, info):
    global began
    if phase == "start":
        began = time.perf_counter()
    elif info["generation"] == 2:
        passes.append(round(time.perf_counter() - began, 3))
if sys.argv[1] == "frozen":
    freeze_startup_heap()
gc.callbacks.append(timed)
sock = socket.create_server(("127.0.0.1", 0), backlog=4096)
print(sock.getsockname()[1], flush=True)
server = uvicorn.Server(server_config(app, read_timeout=30, keep_alive=5, connections=4096,
                                      per_address=3072, backlog=4096, lifespan="off",
                                      log_level="critical"))
threading.Thread(target=lambda: (sys.stdin.read(), setattr(server, "should_exit", True)),
                 daemon=True).start()
server.run(sockets=[sock])
print(json.dumps({"full_passes_s": passes, "tracked_objects": len(gc.get_objects())}), flush=True)
'''


def probe(port: int) -> float:
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
        while s.recv(4096):
            pass
    return time.perf_counter() - t0


def run(mode: str) -> dict:
    server = subprocess.Popen([sys.executable, "-c", SERVER, mode], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    port = int(server.stdout.readline())
    probe(port)
    latencies, stop = [], threading.Event()

    def prober():
        while not stop.is_set():
            latencies.append(probe(port))
            time.sleep(0.05)

    load = os.getloadavg()[0]
    thread = threading.Thread(target=prober)
    thread.start()
    held = [socket.create_connection(("127.0.0.1", port), timeout=10,
                                     source_address=("127.0.0.2", 0)) for _ in range(4200)]
    time.sleep(3)
    stop.set()
    thread.join()
    for s in held:
        s.close()
    out, _ = server.communicate("stop", timeout=60)
    return {"heap": mode, **json.loads(out.strip().splitlines()[-1]), "probes": len(latencies),
            "probe_worst_s": sorted(round(t, 3) for t in latencies)[-3:], "load_before": load}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    for _ in range(args.runs):
        for mode in ("as_started", "frozen"):
            print(json.dumps(run(mode)), flush=True)


if __name__ == "__main__":
    main()
