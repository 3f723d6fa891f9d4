"""The one place that shards a model: FSDP2 `fully_shard` per Qwen3 decoder layer and at the root,
activation checkpointing and compilation per decoder layer, in that order (torchtitan's), pretrained
weights loaded into the shards, and checkpoints that are never half written.

The same code runs on CPU with gloo (tests) and on GPUs with NCCL: Lightning's
`ModelParallelStrategy` owns the process group and the device mesh; `build_sharded` is called from
the LightningModule's `configure_model` with the mesh's data-parallel dimension.
"""
from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

from crm.models.backbone import DTYPES, decoder_layers
from crm.models.compile import compile_layers

log = logging.getLogger(__name__)


SHARDINGS = ("auto", "fsdp", "hsdp")
GRAD_SYNCS = ("step", "micro_batch")


@dataclass(frozen=True)
class ParallelConfig:
    activation_checkpointing: bool = False  # recompute each decoder layer in backward (any strategy)
    param_dtype: str = "bfloat16"  # FSDP: dtype of the all-gathered parameters for compute
    reduce_dtype: str = "float32"  # FSDP: dtype of the gradient reduce-scatter
    reshard_after_forward: bool = True  # FSDP: free gathered layers after forward (ZeRO-3)
    sharding: str = "auto"  # FSDP over all ranks (fsdp) or within each node, replicated across (hsdp)
    grad_sync: str = "step"  # under accumulation: reduce gradients once per step, or every micro batch

    def __post_init__(self):
        for key, value, allowed in (("sharding", self.sharding, SHARDINGS),
                                    ("grad_sync", self.grad_sync, GRAD_SYNCS)):
            if value not in allowed:
                raise ValueError(f"parallel.{key}={value}: expected one of {', '.join(allowed)}")


def enable_activation_checkpointing(crm: nn.Module) -> None:
    # The decoder layer is the checkpoint unit (as it is the FSDP unit): transformers' own
    # non-reentrant checkpointing keeps parameter names unchanged for checkpoints and export.
    crm.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})


def apply_fsdp(crm: nn.Module, mesh, cfg: ParallelConfig) -> nn.Module:
    """Shards each decoder layer, then the CRM itself (embeddings, final norm, head) as the root.

    The root is the CRM module, not the HF model: the CRM's forward is what runs, so the root's
    pre-forward all-gather must hang on it. Parameters stay fp32 shards (the optimizer's master
    weights); compute gathers them in `param_dtype` and gradients reduce in `reduce_dtype`.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=DTYPES[cfg.param_dtype],
                                  reduce_dtype=DTYPES[cfg.reduce_dtype])
    for layer in decoder_layers(crm.model):
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=cfg.reshard_after_forward)
    fully_shard(crm, mesh=mesh, mp_policy=policy, reshard_after_forward=cfg.reshard_after_forward)
    log.info("FSDP2: %d decoder layers + root sharded over %d ranks (compute %s, reduce %s)",
             len(decoder_layers(crm.model)), mesh.size(), cfg.param_dtype, cfg.reduce_dtype)
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

    crm = build_crm(device="meta")
    pretrained = crm.model.name_or_path  # set by a build from a checkpoint, empty for an arch
    if not pretrained:
        crm = build_crm()
    prepare_layers(crm, cfg, compile)
    apply_fsdp(crm, mesh, cfg)
    if pretrained:
        crm.to_empty(device=mesh.device_type)  # this rank's shards, on its current device
        load_pretrained(crm.model, pretrained)
    return crm


class FSDPStrategy(ModelParallelStrategy):
    """ModelParallelStrategy for data-parallel FSDP2 whose sharded checkpoints replace the previous
    one only once complete.

    Lightning writes a sharded checkpoint into its final path, deleting the old one first; a job
    killed mid-save would lose both. Here the shards go to `<path>.partial` and are swapped in after
    every rank has finished.
    """

    def __init__(self, data_parallel_size: int, save_distributed_checkpoint: bool = True, **kwargs):
        # Explicit sizes: "auto" picks tensor parallelism over the ranks (nothing sharded).
        super().__init__(data_parallel_size=data_parallel_size, tensor_parallel_size=1,
                         save_distributed_checkpoint=save_distributed_checkpoint, **kwargs)
        self.sharded_checkpoints = save_distributed_checkpoint  # Lightning keeps its copy private

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


def swap_into_place(new: Path, final: Path) -> None:
    old = final.with_name(final.name + ".old")
    if final.exists():
        if old.exists():
            shutil.rmtree(old) if old.is_dir() else old.unlink()
        final.rename(old)
    new.rename(final)
    if old.exists():
        shutil.rmtree(old) if old.is_dir() else old.unlink()


def fsdp_strategy(world: int, **kwargs) -> FSDPStrategy:
    return FSDPStrategy(data_parallel_size=world, **kwargs)
