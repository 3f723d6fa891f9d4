"""crm-plan: per-GPU memory, FLOPs and network plan of a model size on a cluster shape (plan.json).

    crm-plan model=qwen3-8b [trainer.num_nodes=2 trainer.devices=8 seq_len=8192 ...]
    crm-plan table=true [global_batch_size=512 ...]     # step time and MFU, 1-64 nodes, every size
    crm-plan recommend=true model=qwen3-8b trainer.num_nodes=4 global_batch_size=256
                                                       # the crm-train overrides that fit, fastest
    crm-plan one_gpu=true [lora.rank=16 seq_len=4096]  # which sizes fit one 24/48/80 GiB GPU,
                                                       # full training vs LoRA
    crm-plan task=score model=qwen3-8b score.rows=100000 score.tokens_per_row=3200 mfu=0.3
                                                       # scoring: FLOPs, GPU-hours, GPUs for a target time

The model is built on the meta device (shapes, no weights): nothing needs a GPU. The formulas and
their assumptions are in crm/perf/flops.py, crm/perf/memory.py and crm/perf/network.py.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import MISSING, DictConfig

from crm.cli.errors import one_line_config_errors
from crm.cli.schema import PathsConfig, register_schema, settings
from crm.core.errors import ConfigError
from crm.core.files import write_json
from crm.models.config import LoraConfig, ModelConfig
from crm.perf.flops import ModelShape, flops_per_token, model_shape, peak_flops, tokens_per_s_at
from crm.perf.memory import (PRECISIONS, ROWS_PER_RECORD, STRATEGIES, decoder_linears, host_startup_plan,
                             lora_parameters, memory_plan, process_group_timeout_minutes,
                             tokens_per_record)
from crm.perf.network import GRAD_SYNCS, Links, choose_sharding, network_plan, sharding_world
from crm.perf.scoring import ScoreSettings, describe_score, score_plan


@dataclass
class ClusterShape:
    num_nodes: int = MISSING
    devices: int = MISSING


@dataclass
class NetworkConfig:
    intra_node_busbw_gbs: float = MISSING
    inter_node_busbw_gbs: float = MISSING
    intra_node_latency_us: float = MISSING
    inter_node_latency_us: float = MISSING
    compute_mfu: float = MISSING


TASKS = ("train", "score")


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
    packing: bool = MISSING
    prompt_share: float = MISSING
    sharding: str = MISSING
    grad_sync: str = MISSING
    network: NetworkConfig = field(default_factory=NetworkConfig)
    table: bool = MISSING
    table_nodes: list[int] = MISSING
    table_models: list[str] = MISSING
    recommend: bool = MISSING
    max_micro_batch_size: int = MISSING
    lora: LoraConfig = field(default_factory=LoraConfig)  # crm-train's section: rank and targets read
    one_gpu: bool = MISSING
    one_gpu_sizes_gib: list[float] = MISSING
    task: str = MISSING  # train | score
    score: ScoreSettings = field(default_factory=ScoreSettings)

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"task={self.task}: expected one of {', '.join(TASKS)}")


register_schema("plan", PlanConfig)


def checkpoint_bytes(model: ModelConfig) -> int:
    """Bytes per parameter of the weights at model.path (its config's dtype); without a path, of a
    Qwen3 release (bfloat16)."""
    if not model.path:
        return 2
    from transformers import AutoConfig

    dtype = AutoConfig.from_pretrained(model.path, local_files_only=True).dtype
    return 2 if dtype is None else dtype.itemsize


SHARDING_SETTINGS = ("auto", "fsdp", "hsdp")


def links(cfg) -> Links:
    n = cfg.network
    return Links(intra_node_busbw_gbs=n.intra_node_busbw_gbs, inter_node_busbw_gbs=n.inter_node_busbw_gbs,
                 intra_node_latency_s=n.intra_node_latency_us * 1e-6,
                 inter_node_latency_s=n.inter_node_latency_us * 1e-6)


def accumulation(global_batch_size: int | None, micro_batch_size: int, world: int) -> int | None:
    """Micro steps per optimizer step: global / (micro x world) when whole (None when not); one
    micro step per optimizer step when no global batch is given."""
    if global_batch_size is None:
        return 1
    per_step = micro_batch_size * world
    return global_batch_size // per_step if global_batch_size % per_step == 0 else None


def check_settings(cfg) -> None:
    for name, value, allowed in (("kind", cfg.kind, ROWS_PER_RECORD),
                                 ("precision", cfg.precision, PRECISIONS),
                                 ("strategy", cfg.strategy, STRATEGIES),
                                 ("sharding", cfg.sharding, SHARDING_SETTINGS),
                                 ("grad_sync", cfg.grad_sync, GRAD_SYNCS)):
        if value not in allowed:
            raise ConfigError(f"{name}={value!r}: expected one of {', '.join(allowed)}")
    if not 0 <= cfg.prompt_share < 1:
        raise ConfigError(f"prompt_share={cfg.prompt_share}: expected 0 <= prompt_share < 1 (the share of a "
                          "pointwise row that is criteria + query)")


def token_settings(cfg) -> dict:
    """The settings that say how many tokens a record computes (crm.perf.memory.tokens_per_record)."""
    return {"kind": cfg.kind, "packing": cfg.packing, "prompt_share": cfg.prompt_share}


def lora_trainable(shape, lora: LoraConfig) -> int | None:
    """Parameters a LoRA run trains (adapters + head); None for full training (lora.rank 0)."""
    if not lora.enabled:
        return None
    unknown = sorted(set(lora.target_modules) - set(decoder_linears(shape)))
    if unknown:
        raise ConfigError(f"lora.target_modules: {', '.join(unknown)} not a linear layer of a Qwen3 "
                          f"decoder layer ({', '.join(decoder_linears(shape))})")
    return lora_parameters(shape, lora.rank, lora.target_modules)


def evaluate(shape, cfg, *, num_nodes: int, devices: int, sharding: str, micro_batch_size: int,
             activation_checkpointing: bool, k: int, accumulating: bool, peak: float | None,
             lora: LoraConfig | None = None) -> dict:
    """The memory plan (states over `sharding`'s GPUs) and the network plan of one setting; the
    network plan counts full training's gradients (a LoRA run reduces far fewer)."""
    world = num_nodes * devices
    memory = memory_plan(shape, world=sharding_world(sharding, num_nodes, devices) if cfg.strategy == "fsdp"
                         else world, seq_len=cfg.seq_len, micro_batch_size=micro_batch_size,
                         **token_settings(cfg), precision=cfg.precision, strategy=cfg.strategy,
                         activation_checkpointing=activation_checkpointing, compiled=cfg.compile,
                         attention="eager" if cfg.model.attention == "eager" else "sdpa",
                         accumulating=accumulating,
                         unsharded_grads=(cfg.strategy == "fsdp" and sharding == "fsdp"
                                          and cfg.grad_sync == "step" and world > 1),
                         gpu_memory_gib=cfg.gpu_memory_gib, headroom_fraction=cfg.headroom_fraction,
                         reserved_gib=cfg.reserved_gib,
                         trainable=lora_trainable(shape, cfg.lora if lora is None else lora))
    network = None
    if cfg.strategy == "fsdp" and peak:
        network = network_plan(shape, num_nodes=num_nodes, devices=devices, seq_len=cfg.seq_len,
                               micro_batch_size=micro_batch_size, accumulation=k, **token_settings(cfg),
                               sharding=sharding, grad_sync=cfg.grad_sync,
                               activation_checkpointing=activation_checkpointing,
                               compute_mfu=cfg.network.compute_mfu, peak_flops=peak, links=links(cfg))
    return {"memory": memory, "network": network}


def resolve_sharding(shape, cfg, num_nodes: int, devices: int) -> str:
    """`sharding` as crm-train's parallel.sharding=auto decides it (crm.perf.network.choose_sharding)."""
    if cfg.sharding == "hsdp" and (num_nodes < 2 or devices < 2):
        raise ConfigError(f"sharding=hsdp needs several nodes of several GPUs; the plan has {num_nodes} "
                         f"node(s) x {devices} GPU(s): use sharding=fsdp")
    if cfg.sharding != "auto":
        return cfg.sharding
    return choose_sharding(shape, num_nodes=num_nodes, devices=devices, seq_len=cfg.seq_len,
                           micro_batch_size=cfg.micro_batch_size, **token_settings(cfg),
                           precision=cfg.precision,
                           activation_checkpointing=cfg.activation_checkpointing, compiled=cfg.compile,
                           gpu_memory_gib=cfg.gpu_memory_gib, headroom_fraction=cfg.headroom_fraction,
                           reserved_gib=cfg.reserved_gib)


def plan(cfg: DictConfig) -> dict:
    cfg = settings(cfg)
    check_settings(cfg)
    shape = model_shape(cfg.model, cfg.kind)
    nodes, devices = int(cfg.trainer.num_nodes), int(cfg.trainer.devices)
    world = nodes * devices
    k = accumulation(cfg.global_batch_size, cfg.micro_batch_size, world)
    if k is None:
        raise ConfigError(f"global_batch_size={cfg.global_batch_size} is not a multiple of "
                         f"micro_batch_size={cfg.micro_batch_size} x {world} GPUs")
    accumulating = cfg.global_batch_size is None or k > 1
    sharding = resolve_sharding(shape, cfg, nodes, devices) if cfg.strategy == "fsdp" else "fsdp"
    peak = peak_flops(cfg.gpu, None if cfg.peak_tflops is None else cfg.peak_tflops * 1e12)
    planned = evaluate(shape, cfg, num_nodes=nodes, devices=devices, sharding=sharding,
                       micro_batch_size=cfg.micro_batch_size,
                       activation_checkpointing=cfg.activation_checkpointing, k=k,
                       accumulating=accumulating, peak=peak)
    host = host_startup_plan(shape, world=world, devices=devices,
                             checkpoint_bytes=checkpoint_bytes(cfg.model),
                             param_bytes=PRECISIONS[cfg.precision].param)
    train, forward = (flops_per_token(shape, cfg.seq_len, training=t) for t in (True, False))
    per_gpu = tokens_per_s_at(cfg.mfu, train, peak)
    return {
        "model": {"name": cfg.model.name, **vars(shape)},
        **record_tokens(cfg),
        "tokens_per_micro_batch": planned["memory"]["tokens_per_micro_batch"],
        "num_nodes": nodes,
        "devices": devices,
        "sharding": sharding if cfg.strategy == "fsdp" else None,
        "memory": planned["memory"],
        "network": planned["network"],
        "host_startup": {**host, "pretrained": bool(cfg.model.path)},
        "flops": {
            "formula": "6 N + 12 L H d S (forward: a third); N non-embedding, S = seq_len (a record's "
                       "own sequence, packed or not)",
            "train_per_token": train,
            "forward_per_token": forward,
            "gpu": cfg.gpu,
            "peak_flops_per_gpu": peak,
            "mfu": cfg.mfu,
            "tokens_per_s_per_gpu": per_gpu,
            "tokens_per_s": None if per_gpu is None else per_gpu * world,
            "records_per_s": (None if per_gpu is None
                              else per_gpu * world / planned["memory"]["tokens_per_record"]),
        },
    }


def table(cfg: DictConfig) -> dict:
    """Predicted step time and MFU of every size in `table_models` on `table_nodes` nodes of
    trainer.devices GPUs, under FSDP and HSDP, at the configured row length, micro batch and
    checkpointing; accumulation from global_batch_size (a node count it does not divide: no row)."""
    cfg = settings(cfg)
    check_settings(cfg)
    if cfg.strategy != "fsdp":
        raise ConfigError(f"table=true plans FSDP and HSDP: strategy={cfg.strategy!r} has no network plan")
    peak = peak_flops(cfg.gpu, None if cfg.peak_tflops is None else cfg.peak_tflops * 1e12)
    if not peak:
        raise ConfigError(f"gpu={cfg.gpu!r} has no known peak: set peak_tflops=... for a table of MFU")
    devices, rows = int(cfg.trainer.devices), []
    for name in cfg.table_models:
        shape = ModelShape.from_arch(name, num_labels=1 if cfg.kind == "pointwise" else 2)
        for nodes in cfg.table_nodes:
            k = accumulation(cfg.global_batch_size, cfg.micro_batch_size, nodes * devices)
            row = {"model": name, "num_nodes": nodes, "accumulation": k}
            for sharding in ("fsdp", "hsdp"):
                if k is None or (sharding == "hsdp" and (nodes < 2 or devices < 2)):
                    row[sharding] = None
                    continue
                e = evaluate(shape, cfg, num_nodes=nodes, devices=devices, sharding=sharding,
                             micro_batch_size=cfg.micro_batch_size,
                             activation_checkpointing=cfg.activation_checkpointing, k=k,
                             accumulating=cfg.global_batch_size is None or k > 1, peak=peak)
                net = e["network"]
                row[sharding] = {"step_seconds": net["step_seconds"], "mfu": net["mfu"],
                                 "records_per_s": net["records_per_s_per_gpu"] * nodes * devices,
                                 "exposed_seconds": net["exposed_seconds_per_step"],
                                 "memory_gib": e["memory"]["total_gib"], "fits": e["memory"]["fits"]}
            rows.append(row)
    return {"devices": devices, "seq_len": cfg.seq_len, **record_tokens(cfg),
            "micro_batch_size": cfg.micro_batch_size,
            "global_batch_size": cfg.global_batch_size, "grad_sync": cfg.grad_sync,
            "activation_checkpointing": cfg.activation_checkpointing, "compiled": cfg.compile,
            "network": vars(cfg.network), "gpu": cfg.gpu, "peak_flops_per_gpu": peak, "rows": rows}


ONE_GPU_RANK = 16  # one_gpu=true's LoRA rank when lora.rank is 0


def one_gpu(cfg: DictConfig) -> dict:
    """Which sizes of `table_models` fit ONE GPU of each of `one_gpu_sizes_gib`, full training vs
    LoRA (lora.rank, or 16; lora.target_modules), at seq_len and micro batch, checkpointing as
    configured, under `strategy` at world 1 (fsdp: bf16 compute, the meta-device load)."""
    cfg = settings(cfg)
    check_settings(cfg)
    lora = cfg.lora if cfg.lora.enabled else LoraConfig(rank=ONE_GPU_RANK,
                                                          target_modules=cfg.lora.target_modules)
    rows = []
    for name in cfg.table_models:
        shape = ModelShape.from_arch(name, num_labels=1 if cfg.kind == "pointwise" else 2)
        row = {"model": name, "params": shape.total_params,
               "lora_trainable": lora_trainable(shape, lora)}
        for label, setting in (("full", LoraConfig()), ("lora", lora)):
            memory = evaluate(shape, cfg, num_nodes=1, devices=1, sharding="fsdp",
                              micro_batch_size=cfg.micro_batch_size,
                              activation_checkpointing=cfg.activation_checkpointing, k=1,
                              accumulating=cfg.global_batch_size is not None, peak=None,
                              lora=setting)["memory"]
            row[label] = {"total_gib": memory["total_gib"],
                          "fits": {f"{gib:g}": memory["total_gib"] <= usable_gib(cfg, gib)
                                   for gib in cfg.one_gpu_sizes_gib}}
        rows.append(row)
    return {"seq_len": cfg.seq_len, **record_tokens(cfg), "micro_batch_size": cfg.micro_batch_size,
            "precision": cfg.precision, "strategy": cfg.strategy, "compiled": cfg.compile,
            "activation_checkpointing": cfg.activation_checkpointing, "lora_rank": lora.rank,
            "lora_targets": list(lora.target_modules), "sizes_gib": list(cfg.one_gpu_sizes_gib),
            "rows": rows}


def record_tokens(cfg) -> dict:
    """kind, packing, the prompt_share that counts (None where it is ignored) and tokens a record."""
    share = cfg.prompt_share if cfg.packing and cfg.kind == "pointwise" else None
    return {"kind": cfg.kind, "packing": cfg.packing, "prompt_share": share,
            "tokens_per_record": tokens_per_record(cfg.kind, cfg.seq_len, packing=cfg.packing,
                                                   prompt_share=cfg.prompt_share)}


def share_note(t: dict) -> str:
    if t["prompt_share"] is None:
        return ""
    return f" (criteria + query, {t['prompt_share']:g} of a row, once)"


def describe_tokens(t: dict) -> str:
    """`pointwise rows of 4096 tokens, packed, 7,373 tokens a record (...)`, for the headers."""
    return (f"{t['kind']} rows of {t['seq_len']} tokens{', packed' if t['packing'] else ''}, "
            f"{t['tokens_per_record']:,.0f} tokens a record{share_note(t)}")


def usable_gib(cfg, gpu_gib: float) -> float:
    return gpu_gib * (1.0 - cfg.headroom_fraction) - cfg.reserved_gib  # as memory_plan's `usable`


def format_one_gpu(t: dict) -> str:
    sizes = t["sizes_gib"]
    head = "".join(f"{f'{g:g} GiB':>9}" for g in sizes)
    lines = [f"crm-plan one_gpu: one GPU, {describe_tokens(t)}, micro batch "
             f"{t['micro_batch_size']}, {t['precision']} {t['strategy']}, checkpointing "
             f"{'on' if t['activation_checkpointing'] else 'off'}, layers "
             f"{'compiled' if t['compiled'] else 'eager'}; LoRA rank {t['lora_rank']} on "
             f"{', '.join(t['lora_targets'])}, frozen base bf16",
             f"{'model':<12}{'training':<18}{'trained':>12}{'GiB':>8}{head}"]
    for r in t["rows"]:
        for label, trained in (("full", r["params"]), ("lora", r["lora_trainable"])):
            x = r[label]
            fits = "".join(f"{'fits' if x['fits'][f'{g:g}'] else 'NO':>9}" for g in sizes)
            lines.append(f"{r['model']:<12}{label:<18}{trained / 1e6:>11.1f}M{x['total_gib']:>8.1f}{fits}")
    return "\n".join(lines)


def format_table(t: dict) -> str:
    def cell(x):
        if x is None:
            return f"{'-':>22}"
        return f"{x['step_seconds']:>8.3f} s {x['mfu']:>5.3f}{'' if x['fits'] else ' NOFIT':>6}"

    n = t["network"]
    lines = [f"crm-plan table: {t['devices']} GPUs per node, {describe_tokens(t)}, "
             f"micro batch {t['micro_batch_size']}, global batch {t['global_batch_size']}, grad_sync "
             f"{t['grad_sync']}, checkpointing {'on' if t['activation_checkpointing'] else 'off'}; "
             f"NVLink {n['intra_node_busbw_gbs']:g} GB/s, network {n['inter_node_busbw_gbs']:g} GB/s per "
             f"GPU, compute at {n['compute_mfu']:g} MFU of {t['peak_flops_per_gpu'] / 1e12:g} TFLOP/s",
             f"{'model':<12}{'nodes':>6}{'accum':>6}{'FSDP step, MFU':>22}{'HSDP step, MFU':>22}"]
    for r in t["rows"]:
        k = "-" if r["accumulation"] is None else r["accumulation"]
        lines.append(f"{r['model']:<12}{r['num_nodes']:>6}{k:>6}{cell(r['fsdp'])}{cell(r['hsdp'])}")
    return "\n".join(lines)


def recommend(cfg: DictConfig) -> dict:
    """The crm-train overrides that fit and are predicted fastest on this cluster shape: sharding
    (fsdp, or hsdp on several nodes of several GPUs), micro batch (those that divide a GPU's share
    of global_batch_size, at most max_micro_batch_size) and activation checkpointing. Within 2% of
    the fastest, HSDP is preferred: it sends k times fewer bytes across nodes, so it loses least
    where the network is slower than planned."""
    cfg = settings(cfg)
    check_settings(cfg)
    if cfg.strategy != "fsdp":
        raise ConfigError(f"recommend=true plans FSDP and HSDP: strategy={cfg.strategy!r}")
    peak = peak_flops(cfg.gpu, None if cfg.peak_tflops is None else cfg.peak_tflops * 1e12)
    if not peak:
        raise ConfigError(f"gpu={cfg.gpu!r} has no known peak: set peak_tflops=...")
    shape = model_shape(cfg.model, cfg.kind)
    nodes, devices = int(cfg.trainer.num_nodes), int(cfg.trainer.devices)
    world = nodes * devices
    if cfg.sharding == "auto":
        shardings = ["fsdp", "hsdp"] if nodes > 1 and devices > 1 else ["fsdp"]
    else:
        resolve_sharding(shape, cfg, nodes, devices)  # refuses hsdp on one node
        shardings = [cfg.sharding]
    if cfg.global_batch_size is None:
        micros = [m for m in (1, 2, 4, 8, 16, 32, 64) if m <= cfg.max_micro_batch_size]
    else:
        if cfg.global_batch_size % world:
            raise ConfigError(f"global_batch_size={cfg.global_batch_size} cannot be split over {world} GPUs")
        share = cfg.global_batch_size // world
        micros = [m for m in range(1, min(share, cfg.max_micro_batch_size) + 1) if share % m == 0]
    candidates = []
    for sharding in shardings:
        for micro in micros:
            k = accumulation(cfg.global_batch_size, micro, world)
            for ckpt in (False, True):
                e = evaluate(shape, cfg, num_nodes=nodes, devices=devices, sharding=sharding,
                             micro_batch_size=micro, activation_checkpointing=ckpt, k=k,
                             accumulating=cfg.global_batch_size is None or k > 1, peak=peak)
                if e["memory"]["fits"]:
                    candidates.append({"sharding": sharding, "micro_batch_size": micro,
                                       "activation_checkpointing": ckpt, "accumulation": k,
                                       "mfu": e["network"]["mfu"],
                                       "step_seconds": e["network"]["step_seconds"],
                                       "records_per_s": e["network"]["records_per_s_per_gpu"] * world,
                                       "memory_gib": e["memory"]["total_gib"]})
    if not candidates:
        raise ConfigError(f"nothing fits {cfg.model.name} with {cfg.seq_len}-token rows on {nodes} node(s) x "
                         f"{devices} GPUs of {cfg.gpu_memory_gib:g} GiB, even at micro batch 1 with "
                         "checkpointing: shorten the rows (seq_len) or add GPUs")
    best_mfu = max(c["mfu"] for c in candidates)
    near = [c for c in candidates if c["mfu"] >= 0.98 * best_mfu]
    best = max(near, key=lambda c: (c["sharding"] == "hsdp", c["mfu"]))
    overrides = [f"parallel.sharding={best['sharding']}", f"micro_batch_size={best['micro_batch_size']}",
                 f"parallel.activation_checkpointing={str(best['activation_checkpointing']).lower()}",
                 f"stream.max_tokens={cfg.seq_len}", f"stream.packing={str(cfg.packing).lower()}"]
    # How long a rank may wait in a collective: a checkpoint save of what this run trains.
    timeout = process_group_timeout_minutes(shape, num_nodes=nodes,
                                            trained_params=lora_trainable(shape, cfg.lora))
    overrides.append(f"parallel.timeout_minutes={timeout}")
    return {"model": cfg.model.name, "num_nodes": nodes, "devices": devices, "seq_len": cfg.seq_len,
            **record_tokens(cfg), "global_batch_size": cfg.global_batch_size, "best": best,
            "lora_rank": cfg.lora.rank, "timeout_minutes": timeout, "overrides": overrides,
            "candidates": candidates}


def format_plan(p: dict) -> str:
    m, mem, fl = p["model"], p["memory"], p["flops"]
    b, world = mem["bytes_per_param"], mem["world"]
    dtype = {2: "bf16", 4: "fp32"}
    yes = {True: "yes", False: "NO"}
    ckpt = mem["activation_checkpointing"]
    pd, gd, od = dtype[b["param"]], dtype[b["grad"]], dtype[b["optimizer"] // 2]
    fsdp = mem["strategy"] == "fsdp"
    sharded = f", sharded / {world}" if fsdp else ", whole on each GPU"
    if p["sharding"] == "hsdp":
        sharded += " (HSDP: one node)"
    in_flight = ("unsharded in flight (root + 2 layers, 1 grad)" if fsdp
                 else "bf16 weight copies (autocast)")
    lora = mem["trainable_params"] < m["total_params"]
    if lora:  # a LoRA plan: the frozen base in bf16, the adapters and head in the states' dtype
        pd, gd, od = f"bf16 frozen + {pd} trained", f"{gd}, trained", f"{od}, trained"
    rows = [
        (f"parameters ({pd}{sharded})", mem["params_gib"], ""),
        (f"gradients ({gd}{sharded})", mem["grads_gib"], ""),
        (f"optimizer (AdamW 2 x {od}{sharded})", mem["optimizer_gib"], ""),
        (in_flight, mem["unsharded_gib"], ""),
        *([("gradients held unsharded (grad_sync=step)", mem["accumulated_grads_gib"], "")]
          if mem["accumulated_grads_gib"] else []),
        ("activations, checkpointing on", mem["activations_checkpointed_gib"], ""),
        ("activations, checkpointing off", mem["activations_full_gib"], ""),
        ("total, checkpointing on", mem["total_checkpointed_gib"],
         f"   fits: {yes[mem['fits_checkpointed']]}" + ("  <- configured" if ckpt else "")),
        ("total, checkpointing off", mem["total_full_gib"],
         f"   fits: {yes[mem['fits_full']]}" + ("" if ckpt else "  <- configured")),
    ]
    width = max(46, *(len(label) + 1 for label, _, _ in rows))
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
        f"({mem['rows_per_micro_batch']} row(s){', packed' if p['packing'] else ''}), "
        f"{mem['precision']} {p['sharding'] or mem['strategy']}, "
        f"checkpointing {'on' if ckpt else 'off'}, layers {'compiled' if mem['compiled'] else 'eager'}",
        f"tokens: {p['tokens_per_record']:,.0f} a record{share_note(p)}, "
        f"{p['tokens_per_micro_batch']:,.0f} a micro batch (what the activations and the step time count)",
        f"model: {m['total_params'] / 1e9:.3f} B parameters, {m['non_embedding_params'] / 1e9:.3f} B "
        f"non-embedding; {m['layers']} layers, hidden {m['hidden']}, {m['heads']} heads x "
        f"{m['head_dim']} ({m['kv_heads']} kv), intermediate {m['intermediate']}",
        *([f"LoRA: {mem['trainable_params'] / 1e6:.1f} M parameters trained "
           f"({100 * mem['trainable_params'] / m['total_params']:.2f}%); the network plan counts "
           "full training's gradients"] if lora else []),
        f"activations: {mem['layer_bytes_per_token']:,} bytes per token per decoder layer "
        f"({mem['compute']}, {'compiled' if mem['compiled'] else 'eager'}; crm/perf/memory.py)",
        "",
        f"{'per GPU':<{width}}{'GiB':>8}",
        *(f"{label:<{width}}{gib:>8.2f}{note}" for label, gib, note in rows),
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
            f"on {p['num_nodes'] * p['devices']} GPUs ({fl['records_per_s']:,.1f} full-length records/s)")
    net = p["network"]
    if net is not None:
        lk = net["links"]
        rep = net["replicate_group"]
        lines += [
            "",
            f"network ({net['sharding']}, grad_sync {net['grad_sync']}, {net['accumulation']} micro step(s) "
            f"per optimizer step; crm/perf/network.py): shard group {net['shard_group']['ranks']} GPUs at "
            f"{net['shard_group']['busbw_gbs']:g} GB/s"
            + (f", replicate group {rep['ranks']} nodes at {rep['busbw_gbs']:g} GB/s" if rep else "")
            + f" (NVLink {lk['intra_node_busbw_gbs']:g}, network {lk['inter_node_busbw_gbs']:g} GB/s "
            "per GPU)",
            f"{'collective, per GPU':<46}{'GB each':>8}{'x':>4}{'s each':>9}",
            *(f"{c['name']:<46}{c['per_gpu_bytes'] / 1e9:>8.2f}{c['count']:>4}{c['seconds']:>9.4f}"
              for c in net["collectives"]),
            f"compute per micro step {net['compute_seconds_per_micro_step']:.3f} s at "
            f"{net['compute_mfu']:g} MFU; exposed communication {net['exposed_seconds_per_step']:.4f} s "
            f"per step; predicted step {net['step_seconds']:.3f} s, MFU {net['mfu']:.3f}",
        ]
    return "\n".join(lines)


@hydra.main(version_base="1.3", config_path="pkg://crm_configs", config_name="plan")
@one_line_config_errors
def main(cfg: DictConfig) -> None:
    path = Path(HydraConfig.get().runtime.output_dir) / "plan.json"
    if cfg.task == "score":
        run = settings(cfg)
        peak = peak_flops(run.gpu, None if run.peak_tflops is None else run.peak_tflops * 1e12)
        if peak is None:
            raise ConfigError(f"gpu={run.gpu}: no peak FLOP/s known; set peak_tflops=")
        result = {"model": run.model.name, **score_plan(model_shape(run.model, run.kind), run.score,
                                                        peak=peak, mfu=run.mfu)}
        write_json(path, result)
        print(describe_score(result, run.model.name))
    elif cfg.table:
        result = table(cfg)
        write_json(path, result)
        print(format_table(result))
    elif cfg.one_gpu:
        result = one_gpu(cfg)
        write_json(path, result)
        print(format_one_gpu(result))
    elif cfg.recommend:
        result = recommend(cfg)
        write_json(path, result)
        best = result["best"]
        print(f"crm-plan: {result['model']} on {result['num_nodes']} node(s) x {result['devices']} GPUs, "
              f"{describe_tokens(result)}: {len(result['candidates'])} setting(s) fit; fastest: "
              f"predicted MFU {best['mfu']:.3f}, step {best['step_seconds']:.3f} s, "
              f"{best['records_per_s']:,.1f} records/s, {best['memory_gib']:.1f} GiB")
        print("recommend: " + " ".join(result["overrides"]))  # launch/train.sbatch reads this line
        return
    else:
        result = plan(cfg)
        write_json(path, result)
        print(format_plan(result))
    print(f"plan: {path}")


if __name__ == "__main__":
    sys.exit(main())
