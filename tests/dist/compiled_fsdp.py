"""FSDP2 at world 2 with activation checkpointing: for each KIND (comma-separated), one CRM eager
and one with compiled decoder layers, the same initial weights and batches, each trained on the
batches right padded and then packed (crm.data.packing); rank 0 writes OUT (safetensors) with every
run's losses and full gradients, keyed KIND_COMPILED_LAYOUT.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/dist/compiled_fsdp.py KINDS ARCH_JSON OUT

The layers are built, checkpointed, compiled and sharded as crm-train builds them
(crm.training.parallel.build_sharded). Each rank trains on its own rows.
"""
from __future__ import annotations

import json
import sys
from functools import partial

import torch
import torch.distributed as dist
from ranks import leave
from safetensors.torch import save_file
from torch.distributed.device_mesh import init_device_mesh

from crm.data.packing import pack, split_shared
from crm.data.padding import pad_rows
from crm.models.compile import compile_stats
from crm.models.factory import LossConfig, ModelConfig, build_crm
from crm.training.parallel import ParallelConfig, build_sharded


def batches(kind: str, arch: dict, rank: int, layout: str) -> list[dict]:
    """Two micro batches of this rank's rows; a pointwise pair's rows share their first 5 tokens."""
    g = torch.Generator().manual_seed(rank)
    out = []
    for lengths in ([9, 14, 6, 11], [21, 4, 17, 8]):
        rows = [torch.randint(3, arch["vocab_size"], (n,), generator=g).tolist() for n in lengths]
        n = len(rows) if kind == "pairwise" else len(rows) // 2
        if kind == "pointwise":
            rows = [rows[i % n][:5] + row for i, row in enumerate(rows)]
        if layout == "padded":
            batch = pad_rows(rows, 0)
        elif kind == "pairwise":
            batch = {**pack([(row,) for row in rows]), "branched": False}
        else:
            batch = {**pack([split_shared(c, r) for c, r in zip(rows[:n], rows[n:])]), "branched": True}
        batch["labels"] = torch.arange(n) % 2
        out.append(batch)
    return out


def main(kinds: list[str], arch: dict, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("data_parallel",))
    config = ParallelConfig(activation_checkpointing=True, param_dtype="float32")
    results = {}
    for kind in kinds:
        for compile in (False, True):
            torch.manual_seed(0)
            make = partial(build_crm, ModelConfig(arch=arch, attention="sdpa"), LossConfig(kind),
                           num_labels=2, pad_token_id=0)
            crm = build_sharded(make, mesh["data_parallel"], config, compile=compile).train()
            for layout in ("padded", "packed"):
                crm.zero_grad(set_to_none=True)
                for step, batch in enumerate(batches(kind, arch, rank, layout)):
                    loss = crm.loss(batch)["loss"]
                    loss.backward()
                    results[f"loss_{kind}_{compile}_{layout}_{step}"] = loss.detach().reshape(1)
                for name, p in crm.named_parameters():  # full_tensor: a collective, every rank
                    results[f"grad_{kind}_{compile}_{layout}_{name}"] = p.grad.full_tensor()
    stats = compile_stats()
    results["graph_breaks"] = torch.tensor([stats["graph_breaks"]])
    results["graphs"] = torch.tensor([stats["graphs"]])
    if rank == 0:
        save_file({k: v.contiguous() for k, v in results.items()}, out)
    leave()


if __name__ == "__main__":
    main(sys.argv[1].split(","), json.loads(sys.argv[2]), sys.argv[3])
