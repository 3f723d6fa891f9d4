"""Host memory and time per rank to set up a pretrained model, one process vs FSDP at world 2.

    python benchmarks/load_memory.py [--layers 9] [--hidden 1024] [--intermediate 3072]

Writes a random Qwen3 sequence classifier (about 300M parameters with the defaults, bfloat16
safetensors as Qwen3 releases are) into a temporary directory, then sets it up in fresh processes
(CPU; world 2 is `torch.distributed.run` with gloo), each reporting its peak resident memory from
process start to the end of model set-up (VmHWM: weights loaded and sharded, before any step), its
resident memory before set-up (imports, process group), and the set-up time. Prints one JSON
document. Loadings:

- `crm` (world 1 and 2): CRMModule.configure_model, exactly as crm-train runs it; at world 2 with
  the FSDP device mesh (crm.training.parallel.build_sharded: meta build, shard, allocate the local shards,
  each rank reading its own slices of the safetensors).
- `rank0_broadcast` (world 2, the alternative): the same meta build and sharding, then rank 0 reads
  the whole checkpoint and set_model_state_dict(full_state_dict, broadcast_from_rank0) sends each
  rank its shards.
- `every_rank_whole` (world 2, the loading before): every rank loads the whole model with
  from_pretrained, then shards it.

The goal: per-rank peak of `crm` at world 2 <= 0.6 x world 1's. The checkpoint was just written, so
it is read from the page cache: times are compute and copies, not a shared file system.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from transformers import (AutoModelForSequenceClassification, Qwen3Config,
                          Qwen3ForSequenceClassification)

from crm.training.module import CRMModule, OptimConfig
from crm.models.backbone import init_non_persistent_buffers
from crm.models.heads import PairwiseCRM
from crm.models.factory import LossConfig, ModelConfig, build_crm
from crm.training.parallel import ParallelConfig, apply_fsdp

LOADINGS = {"crm": (1, 2), "rank0_broadcast": (2,), "every_rank_whole": (2,)}
NUM_LABELS = 2


def resident_kib(field: str) -> int:
    """VmRSS (now) or VmHWM (the peak since the process started) of this process, in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def set_up(loading: str, path: str, mesh):
    """The model set up as `loading` does, sharded over `mesh` (None: one process)."""
    build = partial(build_crm, ModelConfig(path=path, attention="sdpa"), LossConfig("pairwise"),
                    num_labels=NUM_LABELS, pad_token_id=None)
    parallel = ParallelConfig(param_dtype="float32")
    if loading == "crm":
        module = CRMModule(build, OptimConfig(), parallel)
        module._device_mesh = mesh  # what ModelParallelStrategy sets before configure_model
        module.configure_model()
        return module.crm
    if loading == "rank0_broadcast":
        crm = apply_fsdp(build(device="meta"), mesh, parallel)
        crm.to_empty(device="cpu")
        init_non_persistent_buffers(crm.model)
        state = load_file(Path(path) / "model.safetensors") if mesh.get_rank() == 0 else {}
        set_model_state_dict(crm.model, state, options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True))
        return crm
    if loading == "every_rank_whole":
        model = AutoModelForSequenceClassification.from_pretrained(
            path, num_labels=NUM_LABELS, dtype=torch.float32, attn_implementation="sdpa",
            local_files_only=True)
        return apply_fsdp(PairwiseCRM(model), mesh, parallel)
    raise ValueError(loading)


def worker(loading: str, path: str, out_dir: str) -> None:
    """One rank: set up, then write its figures to OUT_DIR/<loading>-<world>-<rank>.json."""
    torch.set_num_threads(1)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    mesh = None
    if world > 1:
        dist.init_process_group("gloo")
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("data_parallel",))
        dist.barrier()
    before = resident_kib("VmRSS")
    start = time.perf_counter()
    crm = set_up(loading, path, mesh)
    seconds = time.perf_counter() - start
    peak = resident_kib("VmHWM")
    params = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in crm.parameters())
    figures = {"rank": rank, "peak_rss_gib": peak / 2**20, "rss_before_setup_gib": before / 2**20,
               "setup_seconds": seconds, "local_params": params}
    (Path(out_dir) / f"{loading}-{world}-{rank}.json").write_text(json.dumps(figures))
    if world > 1:
        dist.destroy_process_group()


def write_checkpoint(path: Path, args) -> int:
    """A random Qwen3 sequence classifier saved in bfloat16; its parameter count."""
    config = Qwen3Config(vocab_size=151936, hidden_size=args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                         intermediate_size=args.intermediate, num_labels=NUM_LABELS, pad_token_id=0,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen3ForSequenceClassification(config).to(torch.bfloat16)
    model.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def run(loading: str, world: int, path: Path, out_dir: Path) -> list[dict]:
    script = [str(Path(__file__).resolve()), "--worker", loading, str(path), str(out_dir)]
    if world == 1:
        cmd = [sys.executable, *script]
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
               "--master-addr=127.0.0.1", f"--master-port={port}", *script]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return [json.loads((out_dir / f"{loading}-{world}-{rank}.json").read_text())
            for rank in range(world)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=9)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=3072)
    p.add_argument("--worker", nargs=3, metavar=("LOADING", "CHECKPOINT", "OUT_DIR"),
                   help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(*args.worker)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        params = write_checkpoint(tmp / "checkpoint", args)
        results = {f"{loading}_world{world}": run(loading, world, tmp / "checkpoint", tmp)
                   for loading, worlds in LOADINGS.items() for world in worlds}
    rounded = {name: [{k: round(v, 3) if isinstance(v, float) else v for k, v in rank.items()}
                      for rank in ranks] for name, ranks in results.items()}
    def growth(rank: dict) -> float:
        return rank["peak_rss_gib"] - rank["rss_before_setup_gib"]

    one = results["crm_world1"][0]
    worst = {name: max(r["peak_rss_gib"] for r in ranks) / one["peak_rss_gib"]
             for name, ranks in results.items()}
    worst_growth = {name: max(growth(r) for r in ranks) / growth(one)
                    for name, ranks in results.items()}
    print(json.dumps({
        "machine": {"cpus": os.cpu_count(), "note": "CPU, gloo; 2 cores shared with other jobs"},
        "checkpoint": {"parameters": params, "dtype": "bfloat16", "fp32_gib": params * 4 / 2**30},
        "per_rank": rounded,
        "max_rank_peak_over_world1_peak": {name: round(r, 3) for name, r in worst.items()},
        # The same without what every process holds before set-up (torch, transformers, Lightning
        # imported, the process group): the part that scales with the model.
        "max_rank_setup_growth_over_world1": {name: round(r, 3)
                                              for name, r in worst_growth.items()},
        "goal": "crm_world2 max rank peak <= 0.6 x crm_world1 peak",
        "goal_met": worst["crm_world2"] <= 0.6,
    }, indent=2))


if __name__ == "__main__":
    main()
