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
from crm.cli.record import save_run_record
from crm.cli.schema import PathsConfig, register_schema, settings
from crm.core.errors import ConfigError
from crm.core.files import write_json
from crm.data.transforms import TransformSettings, tie_policy
from crm.models.config import LoraConfig, LossConfig, ModelConfig
from crm.perf.scoring import ScoreSettings
from crm.training.config import BatchSettings, DeviceSettings, ParallelConfig, StartSettings


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


def planned_run(run: PlanConfig) -> StartSettings:
    """The settings crm-train's `resolve` (crm.training.resolve) decides from, as this plan states
    them: crm-plan asks `resolve` the question crm-train asks at start, for the GPU node it plans,
    and prints its answer (`resolved`), the record crm-train keeps. A plan without a global batch
    runs one micro batch per optimizer step; ties as crm-train's `transform.ties=auto` decides them
    (a pairwise head of three labels)."""
    world = run.trainer.num_nodes * run.trainer.devices
    return StartSettings(
        devices=DeviceSettings(accelerator="gpu", devices=run.trainer.devices,
                               num_nodes=run.trainer.num_nodes, strategy=run.strategy),
        batch=BatchSettings(run.global_batch_size or run.micro_batch_size * world,
                            run.micro_batch_size, run.max_micro_batch_size),
        model=run.model, loss=LossConfig(kind=run.kind), lora=run.lora,
        parallel=ParallelConfig(activation_checkpointing=run.activation_checkpointing,
                                sharding=run.sharding, grad_sync=run.grad_sync),
        compile=run.compile, packing=run.packing, max_tokens=run.seq_len,
        transform=TransformSettings(ties=tie_policy("auto", run.kind)))


def planned_resolution(run: PlanConfig) -> dict:
    """crm.training.resolve.resolve's record for the planned run on a GPU of `gpu_memory_gib`."""
    from crm.training.resolve import Environment, resolve

    node = Environment(device="cuda", gpu_memory_gib=run.gpu_memory_gib, this_machine=False)
    return resolve(planned_run(run), environment=node).record()


def share_note(t: dict) -> str:
    if t["prompt_share"] is None:
        return ""
    return f" (criteria + query, {t['prompt_share']:g} of a row, once)"


def describe_tokens(t: dict) -> str:
    """`pointwise rows of 4096 tokens, packed, 7,373 tokens a record (...)`, for the headers."""
    return (f"{t['kind']} rows of {t['seq_len']} tokens{', packed' if t['packing'] else ''}, "
            f"{t['tokens_per_record']:,.0f} tokens a record{share_note(t)}")


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
    if "resolved" in p:  # what crm-train records as `resolved` for this run on such a node
        r = p["resolved"]
        lines += ["", "resolved (crm.training.resolve, what crm-train records for this run): "
                  + ", ".join(f"{key} {value}" for key, value in r.items() if key != "lora")
                  + (f", lora {r['lora']['trainable_parameters']:,} trained" if r["lora"] else "")]
    return "\n".join(lines)


@hydra.main(version_base="1.3", config_path="pkg://crm_configs", config_name="plan")
@one_line_config_errors
def main(cfg: DictConfig) -> None:
    # The arithmetic (torch for a model's shape): after --help and the checks (benchmarks/cli_start.py).
    from crm.perf import plan as planning
    from crm.perf.flops import model_shape, peak_flops
    from crm.perf.scoring import describe_score, score_plan

    path = Path(HydraConfig.get().runtime.output_dir) / "plan.json"
    run = settings(cfg)

    def keep(result: dict) -> None:  # a plan made: its record and plan.json
        save_run_record(cfg)
        write_json(path, result)
    if cfg.task == "score":
        peak = peak_flops(run.gpu, None if run.peak_tflops is None else run.peak_tflops * 1e12)
        if peak is None:
            raise ConfigError(f"gpu={run.gpu}: no peak FLOP/s known; set peak_tflops=")
        result = {"model": run.model.name, **score_plan(model_shape(run.model, run.kind), run.score,
                                                        peak=peak, mfu=run.mfu)}
        keep(result)
        print(describe_score(result, run.model.name))
        print(f"plan: {path}")
        return
    planning.check_settings(run)
    if run.table:
        result = planning.table(run)
        keep(result)
        print(format_table(result))
    elif run.one_gpu:
        result = planning.one_gpu(run)
        keep(result)
        print(format_one_gpu(result))
    elif run.recommend:
        result = planning.recommend(run)
        keep(result)
        best = result["best"]
        print(f"crm-plan: {result['model']} on {result['num_nodes']} node(s) x {result['devices']} GPUs, "
              f"{describe_tokens(result)}: {len(result['candidates'])} setting(s) fit; fastest: "
              f"predicted MFU {best['mfu']:.3f}, step {best['step_seconds']:.3f} s, "
              f"{best['records_per_s']:,.1f} records/s, {best['memory_gib']:.1f} GiB")
        print("recommend: " + " ".join(result["overrides"]))  # launch/train.sbatch reads this line
        return
    else:
        result = {**planning.train_plan(run), "resolved": planned_resolution(run)}
        keep(result)
        print(format_plan(result))
    print(f"plan: {path}")


if __name__ == "__main__":
    sys.exit(main())
