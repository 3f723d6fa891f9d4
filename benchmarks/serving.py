"""What the server benchmarks share (openrlhf_load.py, server_hold.py, usl_load.py, usl_hold.py):
the tiny CRM they serve, starting a server and waiting until it answers, a connection from a
chosen loopback address, the probe that watches a server while an attack runs, and the record of
the machine a figure was measured on. Not a benchmark itself."""
from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

CRITERIA = ["I prefer detailed answers that cover everything."]
CHATML = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
ATTACKER = "127.0.0.2"  # another address on the same loopback: the server's per-address shares
PROBE_EVERY = 0.5


# -- the CRM the servers serve ---------------------------------------------------------------------

def samples(train_file: Path, n: int) -> list[tuple[str, str, str]]:
    """n distinct (query, response, reference): every demo query x answers cut after k sentences."""
    from crm.core.records import read_lines
    from crm.rl.policy import first_sentences

    answers: dict[str, list[str]] = {}
    for line in read_lines(train_file, "train"):
        r = line.record
        answers.setdefault(r.query, []).extend([r.model_a[1].content, r.model_b[1].content])
    out = []
    for query, texts in sorted(answers.items()):
        cuts = sorted({first_sentences(a, k) for a in texts[1:] for k in range(1, 6)})
        out += [(query, cut, texts[0]) for cut in cuts]
    if len(out) < n:
        raise SystemExit(f"only {len(out)} distinct samples; ask for fewer")
    return out[:n]


def export(tmp: Path, rows) -> Path:
    """The demo's tiny pairwise CRM architecture, randomly initialised (a forward costs the same
    whatever the weights), with a BPE trained on `rows`, exported to tmp/crm (max_tokens 512)."""
    import torch
    from omegaconf import OmegaConf

    import crm_configs
    from crm.core.prompts import PromptTemplate
    from crm.models.export import export_crm
    from crm.models.factory import LossConfig, ModelConfig, build_crm
    from crm.models.tokenizer import train_bpe_tokenizer

    texts = [PromptTemplate().pairwise, *CRITERIA, *(t for row in rows for t in row)]
    tokenizer = train_bpe_tokenizer(texts, vocab_size=2048)
    tiny = OmegaConf.load(Path(crm_configs.__file__).parent / "model" / "tiny.yaml")
    arch = OmegaConf.to_container(tiny.arch)
    torch.manual_seed(0)
    crm = build_crm(ModelConfig(arch=arch, attention="sdpa"), LossConfig("pairwise"), num_labels=2,
                    pad_token_id=tokenizer.pad_token_id, vocab_size=len(tokenizer))
    return export_crm(crm.model, tokenizer, tmp / "crm", kind="pairwise", template=PromptTemplate(),
                      max_tokens=512)


# -- starting a server -----------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def raise_open_files() -> None:
    """As many sockets as the hard limit allows: the attacks hold thousands."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def start_reward_server(crm_dir: Path, *options: str, module: str = "crm.rl.openrlhf",
                        stderr=subprocess.DEVNULL) -> tuple[subprocess.Popen, str]:
    """`python -m MODULE CRM_DIR --port 0 --device cpu OPTIONS` on one torch thread; its URL, from
    the line it prints once it serves."""
    server = subprocess.Popen(
        [sys.executable, "-m", module, str(crm_dir), "--port", "0", "--device", "cpu", *options],
        env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, stderr=stderr,
        text=True)
    return server, server.stdout.readline().split(" on ")[-1].strip()


def start_usl(work: Path, *overrides: str, env: dict | None = None,
              timeout: float = 300) -> tuple[subprocess.Popen, str, Path]:
    """`crm-usl OVERRIDES` on a free port of 127.0.0.1 with its own verdict cache and run dir in
    `work`, its output in work/server.log; returns once its API info route answers (Gradio's
    readiness, not the "Running on" line)."""
    import httpx

    port = free_port()
    url, log_path = f"http://127.0.0.1:{port}", work / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "crm-usl"), *overrides, f"port={port}",
             f"cache.dir={work / 'cache'}", f"hydra.run.dir={work / 'run'}"],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"crm-usl exited: {log_path.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/gradio_api/info", timeout=2).status_code == 200:
                return proc, url, log_path
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    sys.exit(f"crm-usl did not start within {timeout:.0f} s")


# -- the machine -----------------------------------------------------------------------------------

def machine(load_before, **extra) -> dict:
    """The record beside a figure: the CPU, its count and the load average before and after."""
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), "unknown")
    return {"cpu": cpu, "cpus": os.cpu_count(), **extra,
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()]}


def rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_seconds(pid: int) -> float:
    """A process's user + system CPU time (all its threads): robust where wall time is shared."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- connections and what they received ------------------------------------------------------------

def send(port: int, data: bytes, source: str = ATTACKER, timeout: float = 30) -> bytes:
    """`data` on a fresh connection from `source`; everything the server sent until it closed."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout,
                                  source_address=(source, 0)) as s:
        s.sendall(data)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    return answer


def status_line(answer: bytes) -> str:
    return answer.split(b"\r\n", 1)[0].decode(errors="replace") or "(closed, nothing sent)"


def body_line(answer: bytes) -> str:
    return answer.split(b"\r\n\r\n", 1)[-1][:300].decode(errors="replace")


def received(answers: list[bytes]) -> dict:
    lines = Counter(status_line(a) for a in answers)
    example = next((body_line(a) for a in answers if a), "")
    return {"status_lines": dict(lines), "example_body": example,
            "max_body_lines": max((body_line(a).count("\n") + 1 for a in answers if a), default=0)}


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


# -- a server under attack, probed -----------------------------------------------------------------

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


def run_attacks(server: subprocess.Popen, log_path: Path, probe, attacks: dict, names: list[str],
                run, deadline: float | None = None) -> dict:
    """Each named attack in turn, `run(attack)` returning what the attacker received, while
    `probe` is watched: the probes, the server's RSS before / peak / 3 s after, and the tracebacks
    its log gained. An attack that would start past `deadline` (perf_counter) is skipped."""
    results = {}
    for name in names:
        if deadline is not None and time.perf_counter() > deadline:
            results[name] = {"skipped": "past --deadline"}
            continue
        time.sleep(2)
        log_before = log_path.read_text(errors="replace").count("Traceback")
        before = rss_mb(server.pid)
        with Watch(server.pid, probe) as watch:
            t0 = time.perf_counter()
            attacker = run(attacks[name])
            attack_s = time.perf_counter() - t0
            time.sleep(3)  # recovery, still probed
        results[name] = watch.report(attack_s, attacker, before, rss_mb(server.pid))
        results[name]["tracebacks_in_log"] = (
            log_path.read_text(errors="replace").count("Traceback") - log_before)
        print(name, json.dumps(results[name]), file=sys.stderr, flush=True)
    return results
