"""crm-usl under clients that hold it (issue 45): benchmarks/server_hold.py's measure, for the app.

Prints one JSON document. The server is `crm-usl` in its own process on 127.0.0.1 with its
default `serve` limits, serving the demo's tiny CRM architecture (random init, max_tokens 512) on
a 12-query demo benchmark. For each attack a probe asks every 0.5 s, from 127.0.0.1, for a board
already scored (POST /gradio_api/call/rank and read its result: the goal, 200 within 2 s) while
the attacker runs from 127.0.0.2; the server's RSS is sampled every 0.1 s. Each attack reports the
probes' latencies, RSS before / peak / after, what the attacker received, and whether the server's
log gained a traceback. At the end: files left in the server's temp directories after it exits.

Bounded: each attack opens at most 300 connections or sends at most 3,800 requests, holds at most
--hold seconds, every socket has a timeout; it targets 127.0.0.1 only.

    python benchmarks/usl_hold.py [--only no_read silent streams bombs upload unread sessions]
                                  [--hold 15]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import torch
from serving import (ATTACKER, concurrently, export, machine, raise_open_files, received,
                     run_attacks, samples, send, start_usl, state_of)


def raw(port: int, data: bytes, source: str = ATTACKER, timeout: float = 30) -> bytes:
    return send(port, data, source, timeout)


def rank_probe(url: str):
    """A board the server has scored (the default criteria, every topic): its status line."""
    def probe() -> str:
        with httpx.Client(timeout=60) as http:
            posted = http.post(f"{url}/gradio_api/call/rank",
                               json={"data": ["General user preference", []]})
            if posted.status_code != 200:
                return f"HTTP/1.1 {posted.status_code}"
            result = http.get(f"{url}/gradio_api/call/rank/{posted.json()['event_id']}")
            ok = result.status_code == 200 and "event: complete" in result.text
            return f"HTTP/1.1 {result.status_code}" + ("" if ok else " (no result)")
    return probe


def hold(port: int, args, data: bytes, count: int, small_buffer: bool = False) -> dict:
    """`count` connections from the attacker, each sending `data` and reading nothing, held
    --hold seconds; then what each shows: open, refused (its 429 read), or dropped."""
    held, answers = [], []
    for _ in range(count):
        try:
            s = socket.socket()
            if small_buffer:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.bind((ATTACKER, 0))
            s.settimeout(10)
            s.connect(("127.0.0.1", port))
            s.setblocking(False)
            try:
                s.send(data)
            except (BlockingIOError, OSError):
                pass
            held.append(s)
        except OSError as exc:
            answers.append(type(exc).__name__.encode())
    time.sleep(args.hold)
    answers += [state_of(s) for s in held]
    return {**received(answers), "opened": len(held)}


def attack_no_read(port, url, args) -> dict:
    """300 connections, each 60 pipelined GETs of the page's main script (135 KB in gradio
    6.31), never read: the issue's shape."""
    import gradio

    index = Path(gradio.__file__).parent / "templates" / "frontend" / "index.html"
    script = re.search(r'assets/[^"]+\.js', index.read_text())[0]
    gets = f"GET /{script} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode() * 60
    return {**hold(port, args, gets, 300, small_buffer=True), "asset": script}


def attack_silent(port, url, args) -> dict:
    return hold(port, args, b"", 300)


def attack_streams(port, url, args) -> dict:
    """254 session heartbeat streams (the issue's count)."""
    head = "GET /gradio_api/heartbeat/h{} HTTP/1.1\r\nHost: 127.0.0.1:{}\r\n\r\n"
    held, answers = [], []
    for i in range(254):
        s = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(ATTACKER, 0))
        s.sendall(head.format(i, port).encode())
        held.append(s)
    for s in held:
        try:
            answers.append(s.recv(300))
        except OSError as exc:
            answers.append(type(exc).__name__.encode())
    time.sleep(args.hold)
    for s in held:
        s.close()
    return received(answers)


def attack_bombs(port, url, args) -> dict:
    """1 MiB JSON bodies through /rank, 8 at a time, 5 rounds: `[],[],...` and nests 40 deep."""
    shapes = [b'{"data": [' + b"[]," * (2**20 // 3 - 10) + b"[]]}",
              b'{"data": [' + (b"[" * 40 + b"]" * 40 + b",") * (2**20 // 81 - 1) + b"[]]}"]
    head = ("POST /gradio_api/call/rank HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nContent-Type: "
            "application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n")
    answers = []
    for body in shapes:
        for _ in range(5):
            data = head.format(port, len(body)).encode() + body
            answers += concurrently([lambda d=data: raw(port, d)] * 8)
    return received(answers)


def attack_upload(port, url, args) -> dict:
    """24 requests of 900 distinct 1 KB files each to Gradio's upload route (the issue's shape),
    then 1,000 requests of one distinct 16 KiB file each (the most the route takes: the votes
    file), 8 at a time; what lies in Gradio's upload folder after."""
    def upload(files: list) -> bytes:
        with httpx.Client(transport=httpx.HTTPTransport(local_address=ATTACKER)) as http:
            response = http.post(f"{url}/gradio_api/upload", files=files, timeout=60)
        return f"HTTP/1.1 {response.status_code}\r\n\r\n{response.text}".encode()

    def text(name: str, size: int) -> tuple:
        return ("files", (name, os.urandom(size // 2).hex().encode(), "text/plain"))

    many = received(concurrently([
        lambda k=k: upload([text(f"{k}-{i}.txt", 1024) for i in range(900)]) for k in range(24)]))
    ones = []
    for k in range(0, 1000, 8):
        ones += concurrently([lambda i=i: upload([text(f"votes-{i}.jsonl", 16384)])
                              for i in range(k, k + 8)])
    files = [p for p in args.upload_dir.rglob("*") if p.is_file()]
    return {"900_files_a_request": many, "one_file_a_request": received(ones),
            "upload_folder_after": {"files": len(files),
                                    "with_content": sum(p.stat().st_size > 0 for p in files),
                                    "mb": round(sum(p.stat().st_size for p in files) / 2**20, 2)}}


def attack_unread(port, url, args) -> dict:
    """2,000 /rank calls whose results are never read (a fifth of the issue's 9,000)."""
    statuses: Counter = Counter()
    with httpx.Client(timeout=60, transport=httpx.HTTPTransport(local_address=ATTACKER)) as http:
        for _ in range(2000):
            try:
                statuses[http.post(f"{url}/gradio_api/call/rank",
                                   json={"data": ["General user preference", []]}).status_code] += 1
            except httpx.HTTPError as exc:
                statuses[type(exc).__name__] += 1
    return {"status_lines": {f"HTTP/1.1 {k}": v for k, v in statuses.items()}}


def attack_sessions(port, url, args) -> dict:
    """3,000 sessions (the issue's count), each a page's board asked for through Gradio's queue
    (`/queue/join` with a new session id, the default criteria on every topic: a board already
    scored), whose answers are never read; from the attacker's address, then 100 more from each
    of 8 more addresses (127.0.1.1-8) against the bound in all."""
    config = httpx.get(f"{url}/config", timeout=30).json()
    generate = next(d["id"] for d in config["dependencies"] if d.get("api_name") == "generate")
    statuses: Counter = Counter()
    example = ""
    for address, count in [(ATTACKER, 3000)] + [(f"127.0.1.{k}", 100) for k in range(1, 9)]:
        with httpx.Client(timeout=60, transport=httpx.HTTPTransport(local_address=address)) as http:
            for i in range(count):
                try:
                    answer = http.post(f"{url}/gradio_api/queue/join", json={
                        "data": ["General user preference", "", args.topics, "", 5],
                        "fn_index": generate, "session_hash": f"attack-{address}-{i}"})
                    statuses[answer.status_code] += 1
                    if answer.status_code != 200:
                        example = answer.text
                except httpx.HTTPError as exc:
                    statuses[type(exc).__name__] += 1
    return {"status_lines": {f"HTTP/1.1 {k}": v for k, v in statuses.items()},
            "example_body": example[:300]}


ATTACKS = {"no_read": attack_no_read, "silent": attack_silent, "streams": attack_streams,
           "bombs": attack_bombs, "upload": attack_upload, "unread": attack_unread,
           "sessions": attack_sessions}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="+", choices=list(ATTACKS), default=list(ATTACKS))
    p.add_argument("--hold", type=float, default=15.0, help="seconds the holding attacks hold")
    args = p.parse_args()
    raise_open_files()
    torch.set_num_threads(1)
    started, load_before = time.perf_counter(), os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        from crm.data.demo import write_demo

        work = Path(tmp)
        write_demo(work / "demo", n_train=200, n_test=2, n_bench=12)
        crm_dir = export(work, samples(work / "demo" / "train.jsonl", 64))
        temp = {"TMPDIR": work / "tmp", "GRADIO_TEMP_DIR": work / "gradio"}
        for path in temp.values():
            path.mkdir()
        args.upload_dir = temp["GRADIO_TEMP_DIR"]
        args.topics = sorted({json.loads(line)["topic"]
                              for line in (work / "demo" / "bench.jsonl").read_text().splitlines()})
        server, url, log_path = start_usl(
            work, f"checkpoint={crm_dir}", f"bench={work / 'demo' / 'bench.jsonl'}",
            "baseline=baseline", env={"OMP_NUM_THREADS": "1", **{k: str(v) for k, v in temp.items()}})
        port = int(url.rsplit(":", 1)[1])
        try:
            probe = rank_probe(url)
            assert probe().endswith("200"), log_path.read_text()[-2000:]
            results = run_attacks(server, log_path, probe, ATTACKS, args.only,
                                  lambda attack: attack(port, url, args))
        finally:
            server.send_signal(signal.SIGINT)
            server.wait(timeout=60)
        left = [str(p.relative_to(work)) for d in temp.values() for p in d.rglob("*")]
    print(json.dumps({"server": "crm-usl", "attacks": results, "left_in_temp_after_exit": left[:20],
                      "left_count": len(left), "machine": machine(load_before),
                      "wall_s": round(time.perf_counter() - started, 1)}, indent=1))


if __name__ == "__main__":
    main()
