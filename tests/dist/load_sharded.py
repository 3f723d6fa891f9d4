"""Loads HF checkpoints as crm-train does under FSDP, then scores one batch with each.

    python -m torch.distributed.run --nproc-per-node 2 tests/dist/load_sharded.py BATCH OUT CKPT...

Per checkpoint: the meta build, FSDP2 sharding, local shards allocated, each rank reading its own
slices (crm.training.parallel.build_sharded, as CRMModule.configure_model calls it), with the generator
seeded 0 before the build. Rank 0 writes OUT/<checkpoint dir name>.safetensors: the logits of
BATCH (a safetensors file of input_ids and attention_mask), the whole head and RoPE's inv_freq.
"""
from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from ranks import leave
from safetensors.torch import load_file, save_file
from torch.distributed.device_mesh import init_device_mesh

from crm.models.factory import LossConfig, ModelConfig, build_crm
from crm.training.parallel import ParallelConfig, build_sharded


def main(batch_file: str, out_dir: str, checkpoints: list[str]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("data_parallel",))
    batch = load_file(batch_file)
    for path in checkpoints:
        torch.manual_seed(0)
        make = partial(build_crm, ModelConfig(path=path, attention="sdpa"), LossConfig("pairwise"),
                       num_labels=2, pad_token_id=None)
        crm = build_sharded(make, mesh["data_parallel"], ParallelConfig(param_dtype="float32"))
        with torch.no_grad():
            logits = crm.eval()(batch["input_ids"], batch["attention_mask"])
        crm.reshard()  # FSDP2 keeps the root (the head with it) gathered after a forward
        head = crm.model.score.weight.full_tensor()  # a collective: every rank takes part
        if dist.get_rank() == 0:
            save_file({"logits": logits, "head": head,
                       "inv_freq": crm.model.model.rotary_emb.inv_freq.contiguous()},
                      str(Path(out_dir) / f"{Path(path).name}.safetensors"))
    leave()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
