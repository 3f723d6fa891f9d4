"""The OpenRLHF reward server under requests that are legal in size but hostile in cost (issue 45).

Prints one JSON document. The server is `python -m crm.rl.openrlhf` in its own process (one
torch thread) serving the demo's tiny CRM architecture with max_tokens 512 (so texts up to 8,192
characters), as benchmarks/openrlhf_load.py builds it, on 127.0.0.1 with its default limits.
For each attack a probe posts one small well-formed request every 0.5 s (each on its own
connection from 127.0.0.1; the goal: answered 200 within 2 s throughout) while the attacker,
from 127.0.0.2 (another address on the same loopback), runs; the server's RSS is sampled every
0.1 s. Each attack reports the probes' latencies and statuses, RSS before / peak / after (3 s
after the attack), what the attacker received (status lines counted, one body line), and whether
the server's log gained a traceback.

Bounded: every attack stops after at most --hold seconds of holding plus its sends, each
socket has a timeout, and the whole run stops after --deadline seconds; it targets 127.0.0.1
only.

    python benchmarks/server_hold.py [--only split legal bombs ...] [--hold 12]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import time
from pathlib import Path

import torch
from serving import (ATTACKER, CHATML, CRITERIA, concurrently, export, machine,
                     raise_open_files, received, run_attacks, samples, send, start_reward_server,
                     state_of, status_line)


def http_post(port: int, body: bytes, source: str = "127.0.0.1", timeout: float = 60,
              extra: str = "") -> bytes:
    """One POST on a fresh connection; everything the server sent until it closed."""
    head = (f"POST /get_reward HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{extra}Content-Type: "
            f"application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    return send(port, head.encode() + body, source, timeout)


def sample_body(n: int, query: str, response: str, reference: str, system: str = "",
                distinct: str = "") -> bytes:
    """n samples; with `distinct`, each response and reference starts with its own number (no
    verdict is cached: every sample costs its forwards)."""
    prompt = (f"<|im_start|>system\n{system}<|im_end|>\n" if system else "") + CHATML.format(query)
    responses = [f"{distinct}{i} {response}"[:len(response)] if distinct else response
                 for i in range(n)]
    references = [f"{distinct}{i} {reference}"[:len(reference)] if distinct else reference
                  for i in range(n)]
    return json.dumps({"query": [prompt + r + "<|im_end|>" for r in responses],
                       "prompts": [prompt] * n,
                       "labels": [{"criteria": CRITERIA, "reference": r} for r in references]
                       }).encode()


# -- the attacks: each returns what the attacker received -------------------------------------------

def attack_split(port: int, args) -> dict:
    """Prompts of 8,192 characters of ChatML user openings with no closing (the largest legal),
    64 samples a request, 4 requests at once, twice."""
    openings = "<|im_start|>user\n" * (8192 // 17)
    body = json.dumps({"query": [openings + "a reply"] * 64, "prompts": [openings] * 64,
                       "labels": [{"criteria": CRITERIA, "reference": "b"}] * 64}).encode()
    answers = []
    for _ in range(2):
        answers += concurrently([lambda: http_post(port, body, ATTACKER)] * 4)
    return received(answers)


def attack_legal(port: int, args) -> dict:
    """The largest legal request, two at once: 64 samples, each a prompt of 8,000 characters (a
    system turn the CRM does not read, then a query of 400 that leaves room for the answers), a
    response of 8,180 and a reference of 8,000 (each shortened to fit 512 tokens: two full
    forwards a sample); then one of the issue's shape (1,800-character answers)."""
    text = ("Run three short easy runs a week and rest between them. " * 200)[:8192]
    bigs = [sample_body(64, text[:400], text[:8180], text[:8000], system=text[:7500],
                        distinct=f"big {k} sample ") for k in range(2)]
    issue = sample_body(64, "How do I start running?", text[:1800], text[:1800],
                        distinct="issue sample ")
    t0 = time.perf_counter()
    answers = concurrently([lambda b=b: http_post(port, b, ATTACKER, timeout=300) for b in bigs])
    two_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    answers += [http_post(port, issue, ATTACKER, timeout=300)]
    one_s = time.perf_counter() - t0
    return {**received(answers), "two_largest_s": round(two_s, 2),
            "issue_shape_s": round(one_s, 2), "largest_body_bytes": len(bigs[0])}


def attack_bombs(port: int, args) -> dict:
    """16 MiB JSON bodies: `[],[],...`, 8-deep nests, numbers; two of each at once."""
    size = 16 * 2**20 - 64
    shapes = [b"[" + b"[]," * (size // 3 - 1) + b"[]]",
              b"[" + b"[[[[[[[]]]]]]]," * (size // 15 - 1) + b"[]]",
              b"[" + b"1," * (size // 2 - 1) + b"1]"]
    answers = []
    for body in shapes:
        answers += concurrently([lambda b=body: http_post(port, b, ATTACKER)] * 2)
    return received(answers)


def attack_surrogate(port: int, args) -> dict:
    prompt = CHATML.format("hi")
    bodies = [json.dumps({"query": [prompt + "a"], "prompts": [prompt],
                          "labels": [label]}).encode()
              for label in ({"criteria": ["be kind\ud800"], "reference": "b"},
                            {"criteria": ["c"], "query": "q\udfff", "reference": "b"})]
    return received([http_post(port, b, ATTACKER) for b in bodies * 10])


def attack_silent(port: int, args) -> dict:
    """4,200 connections from one address that send nothing, held --hold seconds."""
    held, answers, t0 = [], [], time.perf_counter()
    for _ in range(4200):
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=10,
                                         source_address=(ATTACKER, 0))
            held.append(s)
        except OSError as exc:
            answers.append(type(exc).__name__.encode())
    opening_s = time.perf_counter() - t0
    time.sleep(args.hold)
    answers += [state_of(s) for s in held]
    return {**received(answers), "opened": len(held), "opening_s": round(opening_s, 2)}


def attack_heads(port: int, args) -> dict:
    """Request heads of 120 KB and of 3,000 fields, 100 each."""
    big = "X-Big: " + "a" * 120_000 + "\r\n"
    many = "".join(f"X-{i}: v\r\n" for i in range(3000))
    answers = []
    for extra in (big, many):
        answers += concurrently([lambda e=extra: http_post(port, b"{}", ATTACKER, extra=e)] * 100)
    return received(answers)


def attack_no_read(port: int, args) -> dict:
    """300 connections that pipeline GETs (each answered 405) and never read, --hold seconds."""
    request = f"GET /get_reward HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode() * 2000
    held, answers = [], []
    for _ in range(300):
        try:
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.bind((ATTACKER, 0))
            s.connect(("127.0.0.1", port))
            s.setblocking(False)
            try:
                s.send(request)
            except BlockingIOError:
                pass
            held.append(s)
        except OSError as exc:
            answers.append(type(exc).__name__.encode())
    time.sleep(args.hold)
    answers += [state_of(s) for s in held]
    return {**received(answers), "opened": len(held)}


ATTACKS = {"split": attack_split, "legal": attack_legal, "bombs": attack_bombs,
           "surrogate": attack_surrogate, "silent": attack_silent, "heads": attack_heads,
           "no_read": attack_no_read}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="+", choices=list(ATTACKS), default=list(ATTACKS))
    p.add_argument("--hold", type=float, default=12.0, help="seconds the holding attacks hold")
    p.add_argument("--deadline", type=float, default=900.0, help="seconds for the whole run")
    args = p.parse_args()
    raise_open_files()  # 4,200 sockets here and there
    torch.set_num_threads(1)
    started = time.perf_counter()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        from crm.data.demo import write_demo

        write_demo(tmp, n_train=200, n_test=2, n_bench=1)
        rows = samples(Path(tmp) / "train.jsonl", 64)
        crm_dir = export(Path(tmp), rows)
        log_path = Path(tmp) / "server.log"
        with open(log_path, "w") as log:
            server, url = start_reward_server(crm_dir, stderr=log)
        try:
            port = int(url.rsplit(":", 1)[1].split("/")[0])
            query, response, reference = rows[0]
            probe = sample_body(1, query, response, reference)
            assert status_line(http_post(port, probe)).endswith("200 OK")  # warm-up
            results = run_attacks(server, log_path, lambda: status_line(http_post(port, probe)),
                                  ATTACKS, args.only, lambda attack: attack(port, args),
                                  deadline=started + args.deadline)
        finally:
            server.terminate()
            server.wait(timeout=30)
        log_lines = log_path.read_text(errors="replace").splitlines()
    print(json.dumps({"server": "crm.rl.openrlhf", "attacks": results,
                      "server_log_lines": len(log_lines),
                      "machine": machine(load_before, server_threads=1),
                      "wall_s": round(time.perf_counter() - started, 1)}, indent=1))


if __name__ == "__main__":
    main()
