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
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import torch
from openrlhf_load import CHATML, CRITERIA, export, samples

PROBE_EVERY = 0.5
ATTACKER = "127.0.0.2"


def rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def http_post(port: int, body: bytes, source: str = "127.0.0.1", timeout: float = 60,
              extra: str = "") -> bytes:
    """One POST on a fresh connection; everything the server sent until it closed."""
    head = (f"POST /get_reward HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{extra}Content-Type: "
            f"application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    with socket.create_connection(("127.0.0.1", port), timeout=timeout,
                                  source_address=(source, 0)) as s:
        s.sendall(head.encode() + body)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    return answer


def status_line(answer: bytes) -> str:
    return answer.split(b"\r\n", 1)[0].decode(errors="replace") or "(closed, nothing sent)"


def body_line(answer: bytes) -> str:
    return answer.split(b"\r\n\r\n", 1)[-1][:300].decode(errors="replace")


class Watch:
    """`probe()` (its status line) every PROBE_EVERY s, each on its own thread, and the server's
    RSS every 0.1 s, until the block ends."""

    def __init__(self, pid: int, probe):
        self.pid, self.probe = pid, probe
        self.latencies: list[float] = []
        self.slow: list[tuple[float, float]] = []  # (when it started, s into the watch; latency)
        self.statuses: Counter = Counter()
        self.rss: list[float] = []
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []

    def _probe(self) -> None:
        t0 = time.perf_counter()
        try:
            status = self.probe()
        except Exception as exc:
            status = type(exc).__name__
        self.latencies.append(time.perf_counter() - t0)
        if self.latencies[-1] > 1:
            self.slow.append((round(t0 - self.started, 2), round(self.latencies[-1], 3)))
        self.statuses[status] += 1

    def _run(self) -> None:
        next_probe = time.perf_counter()
        while not self.stop.is_set():
            self.rss.append(rss_mb(self.pid))
            if time.perf_counter() >= next_probe:
                thread = threading.Thread(target=self._probe, daemon=True)
                thread.start()
                self.threads.append(thread)
                next_probe += PROBE_EVERY
            time.sleep(0.1)

    def __enter__(self) -> Watch:
        self.started = time.perf_counter()
        self.runner = threading.Thread(target=self._run, daemon=True)
        self.runner.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.runner.join()
        for thread in self.threads:
            thread.join(timeout=70)

    def report(self, attack_s: float, attacker: dict, before: float, after: float) -> dict:
        late = sorted(self.latencies)
        return {"attack_s": round(attack_s, 2), "attacker": attacker,
                "probes": len(late), "probe_statuses": dict(self.statuses),
                "probe_p50_s": round(late[len(late) // 2], 3) if late else None,
                "probe_max_s": round(late[-1], 3) if late else None,
                "probes_over_2s": sum(t > 2 for t in late),
                "probes_over_1s_at": sorted(self.slow),  # [s into the attack, latency]
                "rss_mb": {"before": round(before), "peak": round(max(self.rss, default=0)),
                           "after": round(after)}}


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


def concurrently(jobs) -> list:
    out: list = [None] * len(jobs)

    def run(i, job):
        try:
            out[i] = job()
        except OSError as exc:
            out[i] = f"{type(exc).__name__}".encode()

    threads = [threading.Thread(target=run, args=(i, j)) for i, j in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return out


def received(answers: list[bytes]) -> dict:
    lines = Counter(status_line(a) for a in answers)
    example = next((body_line(a) for a in answers if a), "")
    return {"status_lines": dict(lines), "example_body": example,
            "max_body_lines": max((body_line(a).count("\n") + 1 for a in answers if a), default=0)}


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


def state_of(s: socket.socket) -> bytes:
    """What a held connection shows, read without blocking: what the server sent and whether it
    closed the connection (or dropped it), or that it is still open."""
    s.setblocking(False)
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
        state = b"closed by the server"
    except BlockingIOError:
        state = b"still open"
    except OSError as exc:
        state = f"dropped by the server ({type(exc).__name__})".encode()
    s.close()
    first = data.split(b"\r\n", 1)[0]
    return b"(" + state + (b" after: " + first if first else b"") + b")"


ATTACKS = {"split": attack_split, "legal": attack_legal, "bombs": attack_bombs,
           "surrogate": attack_surrogate, "silent": attack_silent, "heads": attack_heads,
           "no_read": attack_no_read}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="+", choices=list(ATTACKS), default=list(ATTACKS))
    p.add_argument("--hold", type=float, default=12.0, help="seconds the holding attacks hold")
    p.add_argument("--deadline", type=float, default=900.0, help="seconds for the whole run")
    args = p.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # 4,200 sockets here and there
    torch.set_num_threads(1)
    started = time.perf_counter()
    load_before = os.getloadavg()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        from crm.data.demo import write_demo

        write_demo(tmp, n_train=200, n_test=2, n_bench=1)
        rows = samples(Path(tmp) / "train.jsonl", 64)
        crm_dir = export(Path(tmp), rows)
        log_path = Path(tmp) / "server.log"
        with open(log_path, "w") as log:
            server = subprocess.Popen(
                [sys.executable, "-m", "crm.rl.openrlhf", str(crm_dir), "--port", "0",
                 "--device", "cpu"], env={**os.environ, "OMP_NUM_THREADS": "1"},
                stdout=subprocess.PIPE, stderr=log, text=True)
        try:
            url = server.stdout.readline().split(" on ")[-1].strip()
            port = int(url.rsplit(":", 1)[1].split("/")[0])
            query, response, reference = rows[0]
            probe = sample_body(1, query, response, reference)
            assert status_line(http_post(port, probe)).endswith("200 OK")  # warm-up
            for name in args.only:
                if time.perf_counter() - started > args.deadline:
                    results[name] = {"skipped": "past --deadline"}
                    continue
                time.sleep(2)
                log_before = log_path.read_text(errors="replace").count("Traceback")
                before = rss_mb(server.pid)
                with Watch(server.pid, lambda: status_line(http_post(port, probe))) as watch:
                    t0 = time.perf_counter()
                    attacker = ATTACKS[name](port, args)
                    attack_s = time.perf_counter() - t0
                    time.sleep(3)  # recovery, still probed
                results[name] = watch.report(attack_s, attacker, before, rss_mb(server.pid))
                results[name]["tracebacks_in_log"] = (
                    log_path.read_text(errors="replace").count("Traceback") - log_before)
                print(name, json.dumps(results[name]), file=sys.stderr, flush=True)
        finally:
            server.terminate()
            server.wait(timeout=30)
        log_lines = log_path.read_text(errors="replace").splitlines()
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                  if line.startswith("model name")), "unknown")
    print(json.dumps({"server": "crm.rl.openrlhf", "attacks": results,
                      "server_log_lines": len(log_lines),
                      "machine": {"cpu": model, "cpus": os.cpu_count(), "server_threads": 1,
                                  "loadavg_before": [round(x, 2) for x in load_before],
                                  "loadavg_after": [round(x, 2) for x in os.getloadavg()]},
                      "wall_s": round(time.perf_counter() - started, 1)}, indent=1))


if __name__ == "__main__":
    main()
