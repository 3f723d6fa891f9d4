"""Small builders shared by tests: hand-made training records, shard directories, a tiny tokenizer.

Import as `from helpers import ...` (pytest puts tests/ on sys.path: the directory has no __init__).
"""
from __future__ import annotations

import functools
import io
import json
import random
import socket
import sys
import tarfile
from pathlib import Path

from crm.core.prompts import PAIRWISE_TEMPLATE, POINTWISE_TEMPLATE
from crm.data.manifest import load_manifest, write_manifest

WINNERS = ("model_a", "model_b")
# A small demo data set (crm-train's data=demo with these overrides): seconds to generate.
# The demo's voted pairs only: tiny runs learn what the tests check from them in a few steps
# (tests/data/test_demo_data.py covers the pairs under a user's criteria).
TINY_DEMO = ["data.demo.n_train=200", "data.demo.n_user=0", "data.demo.n_test=20",
             "data.demo.n_bench=4"]
# The decoder layer every compile test builds (tests/models/test_compile.py,
# tests/training/test_compiled_training.py): one shape, so inductor compiles it once per session.
COMPILE_ARCH = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=16, intermediate_size=64, max_position_embeddings=512)

# Words the tiny tokenizer learns merges from; anything else still encodes (byte-level BPE).
CORPUS = [
    PAIRWISE_TEMPLATE, POINTWISE_TEMPLATE,
    "alpha reply beta reply follow up question criterion answer query the a of and to is",
    "User: Assistant: System: concise friendly detailed accurate [...]",
]


@functools.lru_cache(maxsize=None)
def tiny_tokenizer(vocab_size: int = 300):
    """A byte-level BPE tokenizer with the Qwen chat layout, trained in milliseconds (cached)."""
    from crm.models.tokenizer import train_bpe_tokenizer
    return train_bpe_tokenizer(CORPUS * 4, vocab_size=vocab_size)


def save_tiny_base(path: Path) -> Path:
    """A tiny Qwen3 base model (a causal LM: no classification head) with its tokenizer, as a
    user's model.path holds one; the same weights each call."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tok = tiny_tokenizer()
    torch.manual_seed(3)
    model = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, intermediate_size=64, max_position_embeddings=1024,
        pad_token_id=tok.pad_token_id))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def train_dict(key: str, winner: str = "model_a", *, words: int = 0, turns: int = 1,
               n_criteria: int = 2) -> dict:
    """A training-format record whose texts name its key.

    model_a answers "alpha reply KEY", model_b "beta reply KEY" (plus `words` filler words each, to
    vary lengths); `turns` > 1 adds follow-up turns to model_a. Criteria are "KEY a0.." / "KEY b0..".
    """
    query = f"question {key}"
    filler = " ".join(f"w{i}" for i in range(words))
    a = [{"role": "user", "content": query},
         {"role": "assistant", "content": f"alpha reply {key} {filler}".rstrip()}]
    for t in range(1, turns):
        a += [{"role": "user", "content": f"follow up {t} {key}"},
              {"role": "assistant", "content": f"alpha turn {t} {key}"}]
    b = [{"role": "user", "content": query},
         {"role": "assistant", "content": f"beta reply {key} {filler}".rstrip()}]
    return {
        "idx": key,
        "topic": "t",
        "human_winner": winner,
        "model_a": a,
        "model_b": b,
        "a_criteria": [f"{key} a{i}" for i in range(n_criteria)],
        "b_criteria": [f"{key} b{i}" for i in range(n_criteria)],
        "a_broad_criteria_topic": [10 + i for i in range(n_criteria)],
        "b_broad_criteria_topic": [20 + i for i in range(n_criteria)],
    }


def make_records(n: int, *, tie_every: int = 0, prefix: str = "k", vary_length: bool = True) -> list[
        tuple[str, dict]]:
    """`n` (key, record) pairs with unique keys; every `tie_every`-th record is a tie (0: none)."""
    out = []
    for i in range(n):
        key = f"{prefix}{i:04d}"
        if tie_every and i % tie_every == tie_every - 1:
            winner = "tie"
        else:
            winner = WINNERS[(i * 7 // 3) % 2]
        out.append((key, train_dict(key, winner, words=(i * 5) % 13 if vary_length else 0)))
    return out


def write_tar(path: str | Path, members: list[tuple[str, bytes]]) -> Path:
    """A tar of (member name, bytes), in order."""
    path = Path(path)
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tar.addfile(info, io.BytesIO(data))
    return path


def write_shard_dir(out_dir: str | Path, shards: list[list[tuple[str, dict]]], split: str = "train",
                    records_override: dict[int, int] | None = None):
    """Shard tars (one per list, sizes as given) + manifest.json; returns the loaded Manifest.

    `records_override` {shard index: records} makes the manifest claim a different count.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    infos = []
    for n, items in enumerate(shards):
        name = f"{split}-{n:06d}.tar"
        write_tar(out / name, [(f"{k}.json", json.dumps(r).encode()) for k, r in items])
        records = (records_override or {}).get(n, len(items))
        infos.append({"url": name, "records": records,
                      "ties": sum(r["human_winner"] == "tie" for _, r in items)})
    write_manifest(out, {"splits": {split: {"shards": infos}}})
    return load_manifest(out)


def split_sizes(items: list, sizes: list[int]) -> list[list]:
    assert sum(sizes) == len(items), (sizes, len(items))
    out, i = [], 0
    for s in sizes:
        out.append(items[i:i + s])
        i += s
    return out


def run_as_job(cfg, function):
    """`function(cfg)` as a Hydra entry point runs it: the composed hydra node's run dir becomes
    the job's output dir (HydraConfig), then the node is removed from cfg."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = cfg.hydra.run.dir
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    try:
        return function(cfg)
    finally:
        HydraConfig.instance().cfg = None


# Below Linux's ephemeral range (32768-60999): a port the kernel hands out for bind(0) or as an
# outgoing connection's source may be taken again between this check and the server's own bind
# (EADDRINUSE in a rank's TCPStore, seen while another test held thousands of connections).
PORTS = range(20000, 32768)


def free_port() -> int:
    """A TCP port free on loopback now, drawn at random outside the ephemeral range."""
    for port in random.Random().sample(PORTS, 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {PORTS}")


def run_ranks(cmd: list[str], env: dict, log_dir: Path, ranks: int = 2, timeout: float = 240,
              cwd: Path | None = None) -> list[tuple[int, str]]:
    """`cmd` as `ranks` processes started at once on loopback, each told its RANK and LOCAL_RANK,
    WORLD_SIZE and a free MASTER_PORT, as torchrun tells its workers (torch.distributed's env://
    reads them; Lightning, seeing LOCAL_RANK, starts no process itself), without torchrun's own
    process starting first. Waits for every rank; [(exit status, output)] by rank. Output goes to
    files (log_dir/rank<N>.log): a rank blocked on a full pipe would stall the other in a
    collective. A rank still running at the timeout is killed, with its session."""
    import os
    import signal
    import subprocess
    import time

    env = {k: v for k, v in env.items()
           if not k.startswith(("SLURM_", "MASTER_", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK"))}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), NODE_RANK="0",
               WORLD_SIZE=str(ranks))
    log_dir.mkdir(parents=True, exist_ok=True)
    logs = [log_dir / f"rank{rank}.log" for rank in range(ranks)]
    procs = []
    try:
        for rank, log in enumerate(logs):
            with open(log, "wb") as out:
                procs.append(subprocess.Popen(
                    cmd, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}, cwd=cwd,
                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    start_new_session=True))
        deadline = time.monotonic() + timeout
        for proc in procs:
            try:
                proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                break
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return [(proc.returncode, log.read_text(errors="replace")) for proc, log in zip(procs, logs)]


def assert_ranks_ok(results: list[tuple[int, str]]) -> None:
    for rank, (code, output) in enumerate(results):
        assert code == 0, f"rank {rank} exited {code}:\n{output[-4000:]}"


def raw_request(url: str, data: bytes, timeout: float = 10, source: str = "127.0.0.1") -> bytes:
    """`data` on a fresh connection from `source`; everything the server sends until it closes
    it (a server test's request bytes exactly as written, no client to fix them)."""
    from urllib.parse import urlsplit

    address = urlsplit(url)
    with socket.create_connection((address.hostname, address.port), timeout=timeout,
                                  source_address=(source, 0)) as s:
        s.sendall(data)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    return answer


def refused(capsys, monkeypatch, main, *argv: str) -> str:
    """`main()` as the console script `argv[0]` runs it: exit 2, one stderr line naming the
    command, no traceback; returns that line."""
    import pytest

    monkeypatch.setattr(sys, "argv", list(argv))
    with pytest.raises(SystemExit) as exit_info:
        main()
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert exit_info.value.code == 2, err
    assert len(lines) == 1 and lines[0].startswith(f"{argv[0]}: ") and "Traceback" not in err, err
    return lines[0]


def glyphs_the_font_lacks(fig) -> list[tuple[str, str]]:
    """(text, character) for each character a drawn text holds that the font Matplotlib picks for
    that text has no glyph for: what it draws as an empty box."""
    from matplotlib import font_manager
    from matplotlib.text import Text

    lacking = []
    for text in fig.findobj(Text):
        if text.get_visible() and text.get_text():
            font = font_manager.get_font(font_manager.findfont(text.get_fontproperties()))
            lacking += [(text.get_text(), c) for c in text.get_text()
                        if c != "\n" and not font.get_char_index(ord(c))]
    return lacking
