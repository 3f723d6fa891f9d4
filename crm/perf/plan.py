"""crm-plan's arithmetic over a plan's settings (configs/plan.yaml, crm.cli.plan.PlanConfig, read
by attribute: this layer does not import the command line): one setting's memory, network, host
and FLOPs plan (`train_plan`), the step-time table over model sizes and node counts (`table`), what
fits one GPU with and without LoRA (`one_gpu`), and the fastest setting that fits (`recommend`).
crm.cli.plan composes and checks the settings (`check_settings`), then prints what these return.
"""
from __future__ import annotations

from crm.core.errors import ConfigError
from crm.models.config import LoraConfig, ModelConfig
from crm.perf.flops import ModelShape, flops_per_token, model_shape, peak_flops, tokens_per_s_at
from crm.perf.memory import (PRECISIONS, ROWS_PER_RECORD, STRATEGIES, decoder_linears, host_startup_plan,
                             lora_parameters, memory_plan, process_group_timeout_minutes,
                             tokens_per_record)
from crm.perf.network import GRAD_SYNCS, Links, choose_sharding, network_plan, sharding_world


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


def train_plan(cfg) -> dict:
    """The memory, network, host and FLOPs plan of one training setting (crm-plan's default)."""
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


def table(cfg) -> dict:
    """Predicted step time and MFU of every size in `table_models` on `table_nodes` nodes of
    trainer.devices GPUs, under FSDP and HSDP, at the configured row length, micro batch and
    checkpointing; accumulation from global_batch_size (a node count it does not divide: no row)."""
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


def one_gpu(cfg) -> dict:
    """Which sizes of `table_models` fit ONE GPU of each of `one_gpu_sizes_gib`, full training vs
    LoRA (lora.rank, or 16; lora.target_modules), at seq_len and micro batch, checkpointing as
    configured, under `strategy` at world 1 (fsdp: bf16 compute, the meta-device load)."""
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


def usable_gib(cfg, gpu_gib: float) -> float:
    return gpu_gib * (1.0 - cfg.headroom_fraction) - cfg.reserved_gib  # as memory_plan's `usable`


def recommend(cfg) -> dict:
    """The crm-train overrides that fit and are predicted fastest on this cluster shape: sharding
    (fsdp, or hsdp on several nodes of several GPUs), micro batch (those that divide a GPU's share
    of global_batch_size, at most max_micro_batch_size) and activation checkpointing. Within 2% of
    the fastest, HSDP is preferred: it sends k times fewer bytes across nodes, so it loses least
    where the network is slower than planned."""
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
