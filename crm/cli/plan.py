"""crm-plan: per-GPU memory and FLOPs plan of a model size on a cluster shape (plan.json).

    crm-plan model=qwen3-8b [trainer.num_nodes=2 trainer.devices=8 seq_len=8192 ...]

The model is built on the meta device (shapes, no weights): nothing needs a GPU. The formulas and
their assumptions are in crm/perf/flops.py and crm/perf/memory.py.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import MISSING, DictConfig

from crm.cli.common import PathsConfig, one_line_config_errors, register_schema, settings
from crm.core.files import write_json
from crm.models.factory import ModelConfig
from crm.perf.flops import ModelShape, flops_per_token, peak_flops, tokens_per_s_at
from crm.perf.memory import PRECISIONS, ROWS_PER_RECORD, host_startup_plan, memory_plan


@dataclass
class ClusterShape:
    num_nodes: int = MISSING
    devices: int = MISSING


@dataclass
class PlanConfig:
    """configs/plan.yaml's keys and their types."""

    model: ModelConfig = field(default_factory=ModelConfig)
    paths: PathsConfig = MISSING
    name: str = MISSING
    trainer: ClusterShape = MISSING
    seq_len: int = MISSING
    micro_batch_size: int = MISSING
    global_batch_size: int | None = MISSING
    precision: str = MISSING
    activation_checkpointing: bool = MISSING
    compile: bool = MISSING
    strategy: str = MISSING
    gpu_memory_gib: float = MISSING
    headroom_fraction: float = MISSING
    reserved_gib: float = MISSING
    gpu: str = MISSING
    peak_tflops: float | None = MISSING
    mfu: float = MISSING
    kind: str = MISSING


register_schema("plan", PlanConfig)


def model_shape(model: ModelConfig, kind: str) -> ModelShape:
    """The shape of the model group's classifier: from model.path's config.json, else model.arch."""
    num_labels = 1 if kind == "pointwise" else 2
    if model.path:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model.path, num_labels=num_labels, local_files_only=True)
        return ModelShape.from_config(config)
    return ModelShape.from_arch(model.architecture(model.vocab_size), num_labels=num_labels)


def checkpoint_bytes(model: ModelConfig) -> int:
    """Bytes per parameter of the weights at model.path (its config's dtype); without a path, of a
    Qwen3 release (bfloat16)."""
    if not model.path:
        return 2
    from transformers import AutoConfig

    dtype = AutoConfig.from_pretrained(model.path, local_files_only=True).dtype
    return 2 if dtype is None else dtype.itemsize


def plan(cfg: DictConfig) -> dict:
    cfg = settings(cfg)
    if cfg.kind not in ROWS_PER_RECORD:
        raise ValueError(f"kind={cfg.kind!r}: expected one of {', '.join(ROWS_PER_RECORD)}")
    shape = model_shape(cfg.model, cfg.kind)
    world = int(cfg.trainer.num_nodes) * int(cfg.trainer.devices)
    accumulating = True
    if cfg.global_batch_size is not None:
        per_step = cfg.micro_batch_size * world
        if cfg.global_batch_size % per_step:
            raise ValueError(f"global_batch_size={cfg.global_batch_size} is not a multiple of "
                             f"micro_batch_size={cfg.micro_batch_size} x {world} GPUs")
        accumulating = cfg.global_batch_size > per_step
    memory = memory_plan(shape, world=world, seq_len=cfg.seq_len,
                         micro_batch_size=cfg.micro_batch_size, kind=cfg.kind,
                         precision=cfg.precision, strategy=cfg.strategy,
                         activation_checkpointing=cfg.activation_checkpointing,
                         compiled=cfg.compile,
                         attention="eager" if cfg.model.attention == "eager" else "sdpa",
                         accumulating=accumulating,
                         gpu_memory_gib=cfg.gpu_memory_gib,
                         headroom_fraction=cfg.headroom_fraction, reserved_gib=cfg.reserved_gib)
    host = host_startup_plan(shape, world=world, devices=int(cfg.trainer.devices),
                             checkpoint_bytes=checkpoint_bytes(cfg.model),
                             param_bytes=PRECISIONS[cfg.precision].param)
    train, forward = (flops_per_token(shape, cfg.seq_len, training=t) for t in (True, False))
    peak = peak_flops(cfg.gpu, None if cfg.peak_tflops is None else cfg.peak_tflops * 1e12)
    per_gpu = tokens_per_s_at(cfg.mfu, train, peak)
    tokens_per_record = cfg.seq_len * ROWS_PER_RECORD[cfg.kind]
    return {
        "model": {"name": cfg.model.name, **vars(shape)},
        "kind": cfg.kind,
        "num_nodes": int(cfg.trainer.num_nodes),
        "devices": int(cfg.trainer.devices),
        "memory": memory,
        "host_startup": {**host, "pretrained": bool(cfg.model.path)},
        "flops": {
            "formula": "6 N + 12 L H d S (forward: a third); N non-embedding, S = seq_len",
            "train_per_token": train,
            "forward_per_token": forward,
            "gpu": cfg.gpu,
            "peak_flops_per_gpu": peak,
            "mfu": cfg.mfu,
            "tokens_per_s_per_gpu": per_gpu,
            "tokens_per_s": None if per_gpu is None else per_gpu * world,
            "records_per_s": None if per_gpu is None else per_gpu * world / tokens_per_record,
        },
    }


def format_plan(p: dict) -> str:
    m, mem, fl = p["model"], p["memory"], p["flops"]
    b, world = mem["bytes_per_param"], mem["world"]
    dtype = {2: "bf16", 4: "fp32"}
    yes = {True: "yes", False: "NO"}
    ckpt = mem["activation_checkpointing"]
    pd, gd, od = dtype[b["param"]], dtype[b["grad"]], dtype[b["optimizer"] // 2]
    fsdp = mem["strategy"] == "fsdp"
    sharded = f", sharded / {world}" if fsdp else ", whole on each GPU"
    in_flight = ("unsharded in flight (root + 2 layers, 1 grad)" if fsdp
                 else "bf16 weight copies (autocast)")
    rows = [
        (f"parameters ({pd}{sharded})", mem["params_gib"], ""),
        (f"gradients ({gd}{sharded})", mem["grads_gib"], ""),
        (f"optimizer (AdamW 2 x {od}{sharded})", mem["optimizer_gib"], ""),
        (in_flight, mem["unsharded_gib"], ""),
        ("activations, checkpointing on", mem["activations_checkpointed_gib"], ""),
        ("activations, checkpointing off", mem["activations_full_gib"], ""),
        ("total, checkpointing on", mem["total_checkpointed_gib"],
         f"   fits: {yes[mem['fits_checkpointed']]}" + ("  <- configured" if ckpt else "")),
        ("total, checkpointing off", mem["total_full_gib"],
         f"   fits: {yes[mem['fits_full']]}" + ("" if ckpt else "  <- configured")),
    ]
    host = p["host_startup"]
    host_rows = [
        ("from model.path, each rank reading its slices", host["pretrained_gib"],
         "  <- configured" if host["pretrained"] else ""),
        ("random init, every rank the whole model", host["random_init_gib"],
         "" if host["pretrained"] else "  <- configured"),
    ]
    lines = [
        f"crm-plan: {m['name']} {p['kind']}, {p['num_nodes']} node(s) x {p['devices']} GPUs, "
        f"seq {mem['seq_len']}, micro batch {mem['micro_batch_size']} "
        f"({mem['rows_per_micro_batch']} row(s)), {mem['precision']} {mem['strategy']}, "
        f"checkpointing {'on' if ckpt else 'off'}, layers {'compiled' if mem['compiled'] else 'eager'}",
        f"model: {m['total_params'] / 1e9:.3f} B parameters, {m['non_embedding_params'] / 1e9:.3f} B "
        f"non-embedding; {m['layers']} layers, hidden {m['hidden']}, {m['heads']} heads x "
        f"{m['head_dim']} ({m['kv_heads']} kv), intermediate {m['intermediate']}",
        f"activations: {mem['layer_bytes_per_token']:,} bytes per token per decoder layer "
        f"({mem['compute']}, {'compiled' if mem['compiled'] else 'eager'}; crm/perf/memory.py)",
        "",
        f"{'per GPU':<46}{'GiB':>8}",
        *(f"{label:<46}{gib:>8.2f}{note}" for label, gib, note in rows),
        f"usable: {mem['usable_gib']:.1f} of {mem['gpu_memory_gib']:g} GiB "
        f"({mem['headroom_fraction']:.0%} headroom, {mem['reserved_gib']:g} GiB reserved); "
        f"states on all GPUs {mem['states_all_gpus_gib']:.1f} GiB",
        "",
        f"{'host memory per node at start-up':<46}{'GiB':>8}",
        *(f"{label:<46}{gib:>8.2f}{note}" for label, gib, note in host_rows),
        f"from model.path: the node's share of the {dtype[host['checkpoint_bytes_per_param']]} "
        f"checkpoint ({host['pretrained_page_cache_gib']:.2f} GiB, page cache) + {p['devices']} "
        f"x {host['pretrained_in_flight_per_rank_gib']:.2f} GiB in flight; not counted: each "
        "process's imports and CUDA context",
        "",
        f"FLOPs per token (6N + 12 L H d S, S = {mem['seq_len']}): train "
        f"{fl['train_per_token'] / 1e9:.2f} G, forward {fl['forward_per_token'] / 1e9:.2f} G",
    ]
    if fl["tokens_per_s_per_gpu"] is None:
        lines.append(f"tokens/s: no peak known for gpu={fl['gpu']} (set peak_tflops=...)")
    else:
        lines.append(
            f"at {fl['mfu']:.0%} MFU on {fl['gpu']} ({fl['peak_flops_per_gpu'] / 1e12:g} TFLOP/s): "
            f"{fl['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, {fl['tokens_per_s']:,.0f} tokens/s "
            f"on {world} GPUs ({fl['records_per_s']:,.1f} full-length records/s)")
    return "\n".join(lines)


@hydra.main(version_base="1.3", config_path="pkg://crm_configs", config_name="plan")
@one_line_config_errors
def main(cfg: DictConfig) -> None:
    result = plan(cfg)
    path = Path(HydraConfig.get().runtime.output_dir) / "plan.json"
    write_json(path, result)
    print(format_plan(result))
    print(f"plan: {path}")


if __name__ == "__main__":
    sys.exit(main())
