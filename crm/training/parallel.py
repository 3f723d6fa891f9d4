"""The one place that shards a model: FSDP2 `fully_shard` per Qwen3 decoder layer and at the root,
activation checkpointing and compilation per decoder layer, in that order (torchtitan's), pretrained
weights loaded into the shards, and checkpoints that are never half written.

The same code runs on CPU with gloo (tests) and on GPUs with NCCL: Lightning's
`ModelParallelStrategy` owns the process group and the device mesh; `build_sharded` is called from
the LightningModule's `configure_model` with the mesh's data-parallel dimension.
"""
from __future__ import annotations

import logging
import os
import shutil
import socket
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

from crm.core.errors import ConfigError
from crm.models.backbone import DTYPES, decoder_layers
from crm.models.compile import compile_layers
from crm.training.config import ParallelConfig

log = logging.getLogger(__name__)


def data_parallel_mesh(mesh, sharding: str, num_nodes: int):
    """The mesh FSDP2 shards over: Lightning's data-parallel dimension (fsdp), or a 2D mesh of
    (replicate across nodes, shard within a node) over the same ranks (hsdp, torchtitan's
    dp_replicate x dp_shard). Ranks are numbered node by node, so each row of the 2D mesh is one
    node's GPUs: all-gathers and reduce-scatters stay on the node's links, and only one
    all-reduce of sharded gradients per step crosses nodes."""
    if sharding != "hsdp":
        return mesh
    from torch.distributed.device_mesh import init_device_mesh

    world = mesh.size()
    if num_nodes < 2 or world % num_nodes or world == num_nodes:
        raise ValueError(f"parallel.sharding=hsdp needs several nodes of several ranks; this run has "
                         f"{world} ranks on {num_nodes} node(s): use parallel.sharding=fsdp")
    import torch.distributed as dist

    nodes = [None] * world  # where each global rank runs, gathered once
    dist.all_gather_object(nodes, node_of_this_rank())
    check_shard_groups_within_nodes(nodes, world // num_nodes)
    return init_device_mesh(mesh.device_type, (num_nodes, world // num_nodes),
                            mesh_dim_names=("replicate", "shard"))


def node_of_this_rank() -> str:
    """SLURM's node index of this task, else the host name."""
    return os.environ.get("SLURM_NODEID") or socket.gethostname()


def check_shard_groups_within_nodes(nodes: list, per_node: int) -> None:
    """HSDP's shard groups are global ranks [k x per_node, (k + 1) x per_node): each must be one
    node's, or every all-gather and reduce-scatter crosses the network, silently. SLURM numbers
    tasks node by node under `srun --distribution=block` (launch/train.sbatch); a site default or
    `cyclic` deals them out round robin. Every rank gets the same list: all refuse together."""
    for start in range(0, len(nodes), per_node):
        group = nodes[start:start + per_node]
        if len(set(group)) > 1:
            raise ConfigError(
                f"parallel.sharding=hsdp: ranks {start}-{start + per_node - 1} (one shard group) run "
                f"on nodes {', '.join(map(str, dict.fromkeys(group)))}, not one node: start the ranks "
                "node by node (srun --distribution=block, as launch/train.sbatch does)")


def all_ranks_sum(tensor):
    """`tensor` summed over every rank of the run (in place; itself in a one-process run).

    The all-reduce alone: Lightning's `strategy.reduce` calls `barrier()` first, and NCCL's
    barrier blocks the CPU thread until the GPU catches up, a host sync per reduction. The
    all-reduce itself is queued on the GPU's stream: nothing waits until a value is read."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def enable_activation_checkpointing(crm: nn.Module) -> None:
    # The decoder layer is the checkpoint unit (as it is the FSDP unit): transformers' own
    # non-reentrant checkpointing keeps parameter names unchanged for checkpoints and export.
    crm.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})


def apply_fsdp(crm: nn.Module, mesh, cfg: ParallelConfig) -> nn.Module:
    """Shards each decoder layer, then the CRM itself (embeddings, final norm, head) as the root.

    The root is the CRM module, not the HF model: the CRM's forward is what runs, so the root's
    pre-forward all-gather must hang on it. Parameters stay fp32 shards (the optimizer's master
    weights); compute gathers them in `param_dtype` and gradients reduce in `reduce_dtype`.

    What stays gathered between forward and backward (torchtitan's rules): the root (FSDP2's
    default for it: backward starts with the head and ends with the embeddings, so resharding
    them would cost an exposed all-gather at each end) and the last decoder layer (backward needs
    it first); the other layers reshard after forward when `reshard_after_forward` (ZeRO-3).
    A 2D `mesh` (data_parallel_mesh) makes this HSDP.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=DTYPES[cfg.param_dtype],
                                  reduce_dtype=DTYPES[cfg.reduce_dtype])
    layers = decoder_layers(crm.model)
    for i, layer in enumerate(layers):
        reshard = cfg.reshard_after_forward and i < len(layers) - 1
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(crm, mesh=mesh, mp_policy=policy)
    # What the packed-row kernels read to choose one (crm.models.packing.compute_dtype).
    crm.model.crm_compute_dtype = policy.param_dtype
    shape = " x ".join(f"{name} {size}" for name, size in zip(mesh.mesh_dim_names, mesh.shape))
    log.info("FSDP2: %d decoder layers + root sharded over %s (compute %s, reduce %s)",
             len(layers), shape, cfg.param_dtype, cfg.reduce_dtype)
    return crm


def prepare_layers(crm: nn.Module, cfg: ParallelConfig, compile: bool) -> None:
    """Activation checkpointing, then compilation, of each decoder layer (before any sharding)."""
    if cfg.activation_checkpointing:
        enable_activation_checkpointing(crm)
    if compile:
        compile_layers(crm.model)


def build_sharded(build_crm: Callable[..., nn.Module], mesh, cfg: ParallelConfig,
                  compile: bool = False) -> nn.Module:
    """The CRM from `build_crm`, checkpointed, compiled and sharded over `mesh`, with its weights.

    From a checkpoint (model.path): built on the meta device (shapes, no storage), sharded, only
    this rank's shards allocated, then filled from the safetensors, each rank reading its own
    slices: no rank ever holds the whole model. Random init (model.arch): every rank builds the
    whole model from the same seed, then shards it, so the initial weights are exactly one
    process's (a randomly initialised model is a small one).
    """
    from crm.models.backbone import load_pretrained
    from crm.models.lora import init_adapters, is_adapter

    crm = build_crm(device="meta")
    pretrained = crm.model.name_or_path  # set by a build from a checkpoint, empty for an arch
    if not pretrained:
        crm = build_crm()
    prepare_layers(crm, cfg, compile)
    apply_fsdp(crm, mesh, cfg)
    if pretrained:
        crm.to_empty(device=mesh.device_type)  # this rank's shards, on its current device
        load_pretrained(crm.model, pretrained)
        if any(is_adapter(name) for name, _ in crm.named_parameters()):
            init_adapters(crm.model)  # LoRA's adapters, allocated but not drawn on the meta device
    return crm


class FSDPStrategy(ModelParallelStrategy):
    """ModelParallelStrategy for data-parallel FSDP2 whose sharded checkpoints replace the previous
    one only once complete.

    Lightning writes a sharded checkpoint into its final path, deleting the old one first; a job
    killed mid-save would lose both. Here the shards go to `<path>.partial` and are swapped in after
    every rank has finished.
    """

    def __init__(self, data_parallel_size: int, save_distributed_checkpoint: bool = True,
                 parallel: ParallelConfig | None = None, **kwargs):
        # Explicit sizes: "auto" picks tensor parallelism over the ranks (nothing sharded).
        super().__init__(data_parallel_size=data_parallel_size, tensor_parallel_size=1,
                         save_distributed_checkpoint=save_distributed_checkpoint, **kwargs)
        self.sharded_checkpoints = save_distributed_checkpoint  # Lightning keeps its copy private
        self.parallel = parallel or ParallelConfig(sharding="fsdp")

    @contextmanager
    def block_backward_sync(self):
        """Lightning enters this around every micro batch of a step but the last (automatic
        optimization under accumulation); ModelParallelStrategy does nothing there, so each
        micro batch would pay the gradient reduction. With grad_sync=step, FSDP skips it until
        the last micro batch, keeping unsharded gradients in the reduce dtype meanwhile (crm-plan
        counts them); HSDP keeps reduce-scattering within the node, where links are fast and
        gradients stay sharded, and all-reduces across nodes once per step."""
        crm = getattr(self.lightning_module, "crm", None)
        if self.parallel.grad_sync != "step" or crm is None:
            yield
            return
        hsdp = self.parallel.sharding == "hsdp"
        switch = crm.set_requires_all_reduce if hsdp else crm.set_requires_gradient_sync
        switch(False)
        try:
            yield
        finally:
            switch(True)

    def save_checkpoint(self, checkpoint, filepath, storage_options=None) -> None:
        if not self.sharded_checkpoints:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        final = Path(self.broadcast(str(filepath)))
        partial = final.with_name(final.name + ".partial")
        if self.global_rank == 0 and partial.exists():
            shutil.rmtree(partial)  # left by a job killed mid-save
        self.barrier()
        super().save_checkpoint(checkpoint, partial, storage_options)
        self.barrier()
        if self.global_rank == 0:
            swap_into_place(partial, final)
        self.barrier()

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        """A LoRA run's sharded checkpoint leaves the frozen base out (CRMModule.on_save_checkpoint):
        its weights are read for the trained parameters only. Lightning's own reader asks the
        checkpoint for every parameter and fails on the first base weight."""
        module = self.lightning_module
        path = Path(self.broadcast(str(checkpoint_path)))
        if getattr(module, "saves_frozen", True) or not path.is_dir():
            return super().load_checkpoint(path, weights_only)
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict,
                                                             set_model_state_dict,
                                                             set_optimizer_state_dict)

        from crm.models.checkpoint import SHARDED_META

        metadata = torch.load(path / SHARDED_META, weights_only=weights_only)
        module.check_resume(metadata)  # another base's adapters may not even have these shapes
        trained = StateDictOptions(ignore_frozen_params=True)
        state = {"state_dict": get_model_state_dict(self.model, options=trained)}
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(self.model, state["state_dict"],
                             options=StateDictOptions(ignore_frozen_params=True, strict=False))
        for i, optimizer in enumerate(self.optimizers):  # as Lightning's reader: one at a time
            key = f"optimizer_{i}"
            optim_state = {key: get_optimizer_state_dict(self.model, optimizer)}
            dcp.load(optim_state, checkpoint_id=path)
            set_optimizer_state_dict(self.model, optimizer, optim_state_dict=optim_state[key],
                                     options=StateDictOptions(cpu_offload=True))
        return metadata


def swap_into_place(new: Path, final: Path) -> None:
    old = final.with_name(final.name + ".old")
    if final.exists():
        if old.exists():
            shutil.rmtree(old) if old.is_dir() else old.unlink()
        final.rename(old)
    new.rename(final)
    if old.exists():
        shutil.rmtree(old) if old.is_dir() else old.unlink()


def fsdp_strategy(world: int, parallel: ParallelConfig | None = None, **kwargs) -> FSDPStrategy:
    if parallel is not None and parallel.timeout is not None:
        kwargs.setdefault("timeout", parallel.timeout)
    return FSDPStrategy(data_parallel_size=world, parallel=parallel, **kwargs)
