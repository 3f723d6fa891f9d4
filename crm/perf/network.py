"""Network plan of an FSDP2 training step: bytes of each collective per GPU, their time on the
links, what the compute hides, and the predicted step time and MFU (docs/PERFORMANCE.md section 10).

Notation: P all parameters, Pl one decoder layer's, Pr the root's (embeddings, final norm, head),
L layers, N nodes, D GPUs per node, W = N x D, k micro steps per optimizer step.

Collectives of one micro step (FSDP2 as crm.training.parallel applies it: one unit per decoder
layer plus the root; parameters gathered in bf16, gradients reduced in fp32):
- all-gather, forward: every unit, P x 2 bytes;
- all-gather, backward: the layers resharded after forward, (L - 1) x Pl x 2 bytes (the root stays
  gathered between forward and backward and the last layer is not resharded: torchtitan's rule);
- reduce-scatter, fp32: P x 4 bytes, on every micro step under grad_sync=micro_batch, on the last
  one under grad_sync=step with flat FSDP (FSDP2's set_requires_gradient_sync(False) on the others);
  HSDP reduce-scatters within the node on every micro step (its gradients stay sharded);
- HSDP only, all-reduce across nodes of the sharded fp32 gradients, P x 4 / D bytes, once per
  optimizer step under grad_sync=step (set_requires_all_reduce(False) on the others), every micro
  step under micro_batch.

Sizes are the whole buffer S of the collective; a ring moves S x (n-1)/n per GPU for an
all-gather or a reduce-scatter over n ranks and 2 S x (n-1)/n for an all-reduce. Time = that
/ the bus bandwidth of the ring + (n - 1) ring steps x the step latency of its slowest link, the
latency paid once per unit (each decoder layer and the root is a collective of its own).

Links (settings; docs/PERFORMANCE.md section 10 says why these defaults):
- within a node (NVLink): `intra_node_busbw_gbs` per GPU;
- across nodes: `inter_node_busbw_gbs` per GPU (its NIC). A ring over all W ranks (flat FSDP across
  nodes) leaves each node through all D NICs at once (NCCL runs one ring channel per NIC), so its
  bus bandwidth is min(intra, D x inter); HSDP's all-reduce runs between the same local rank of
  each node, one NIC each: inter.

Overlap: FSDP2 prefetches, so a unit's all-gather and reduce-scatter run while a neighbouring unit
computes. Per micro step the exposed communication is max(0, comm - compute), plus what nothing can
hide: the first all-gather (the root's, at the start of forward) and the last reduce-scatter (the
root's, after layer 0's backward) and, for HSDP on a step that all-reduces, the root's all-reduce.
Collectives are added up as if serial (conservative: FSDP2 runs all-gathers and reductions on their
own streams, and NVLink and the NICs could move data at once).

Compute: training FLOPs of the micro step (crm.perf.flops, 6 N + 12 L H d S per token, S the row
length; its tokens crm.perf.memory.tokens_per_record's: a packed pointwise pair computes its
criteria + query once) at `compute_mfu` of the peak, x 4/3 with activation checkpointing (the
forward run again in backward).
The predicted MFU is the useful FLOPs over (step time x peak).
"""
from __future__ import annotations

from dataclasses import dataclass

from crm.perf.flops import ModelShape, flops_per_token
from crm.perf.memory import memory_plan, tokens_per_record

SHARDINGS = ("fsdp", "hsdp")
GRAD_SYNCS = ("step", "micro_batch")
PARAM_BYTES, REDUCE_BYTES = 2, 4  # bf16 all-gathers, fp32 reductions (parallel.param/reduce_dtype)


@dataclass(frozen=True)
class Links:
    """Effective bus bandwidths (GB/s = 1e9 bytes/s) and ring-step latencies (s) of one GPU."""

    intra_node_busbw_gbs: float = 360.0
    inter_node_busbw_gbs: float = 40.0
    intra_node_latency_s: float = 2e-6
    inter_node_latency_s: float = 6e-6


@dataclass(frozen=True)
class Ring:
    """A collective's group: its ranks, bus bandwidth (bytes/s) and per-step latency (s)."""

    ranks: int
    busbw: float
    latency: float

    def time(self, size: float, factor: float) -> float:
        """Seconds for a buffer of `size` bytes: size x factor / busbw + (ranks - 1) steps."""
        if self.ranks < 2:
            return 0.0
        return size * factor / self.busbw + (self.ranks - 1) * self.latency


def ring_factor(ranks: int, collective: str) -> float:
    """(n-1)/n for an all-gather or reduce-scatter, 2(n-1)/n for an all-reduce."""
    share = (ranks - 1) / ranks
    return 2 * share if collective == "all_reduce" else share


def rings(sharding: str, num_nodes: int, devices: int, links: Links) -> tuple[Ring, Ring | None]:
    """The shard group's ring and, under HSDP, the replicate group's (None under FSDP)."""
    intra = links.intra_node_busbw_gbs * 1e9
    inter = links.inter_node_busbw_gbs * 1e9
    if sharding == "hsdp":
        return (Ring(devices, intra, links.intra_node_latency_s),
                Ring(num_nodes, inter, links.inter_node_latency_s))
    if num_nodes == 1:
        return Ring(devices, intra, links.intra_node_latency_s), None
    return Ring(num_nodes * devices, min(intra, devices * inter), links.inter_node_latency_s), None


def network_plan(shape: ModelShape, *, num_nodes: int, devices: int, seq_len: int,
                 micro_batch_size: int = 1, accumulation: int = 1, kind: str = "pairwise",
                 packing: bool = False, prompt_share: float = 0.0, sharding: str = "fsdp",
                 grad_sync: str = "step", activation_checkpointing: bool = False,
                 compute_mfu: float = 0.45, peak_flops: float = 989e12,
                 links: Links = Links()) -> dict:
    """Bytes and seconds of each collective per optimizer step on one GPU, the compute time, the
    exposed communication, the step time and the MFU (the module docstring has the model)."""
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding={sharding!r}: expected one of {', '.join(SHARDINGS)}")
    if grad_sync not in GRAD_SYNCS:
        raise ValueError(f"grad_sync={grad_sync!r}: expected one of {', '.join(GRAD_SYNCS)}")
    if min(num_nodes, devices, seq_len, micro_batch_size, accumulation) < 1:
        raise ValueError(f"num_nodes={num_nodes}, devices={devices}, seq_len={seq_len}, micro_batch_size="
                         f"{micro_batch_size}, accumulation={accumulation}: each must be at least 1")
    if not 0 < compute_mfu <= 1:
        raise ValueError(f"compute_mfu={compute_mfu}: expected a fraction in (0, 1]")
    k, L = accumulation, shape.layers
    P, Pl, Pr = shape.total_params, shape.layer_params, shape.root_params
    shard, replicate = rings(sharding, num_nodes, devices, links)
    n = shard.ranks
    # Reduce-scatters and all-reduces per optimizer step: every micro step, or the last only.
    reduce_scatters = k if (sharding == "hsdp" or grad_sync == "micro_batch") else 1
    all_reduces = (k if grad_sync == "micro_batch" else 1) if replicate and replicate.ranks > 1 else 0

    def collective(name, ring, size, units, count, op):
        # Each unit (decoder layer or root) is its own collective: ring latency once per unit.
        factor = ring_factor(ring.ranks, op) if ring.ranks > 1 else 0.0
        seconds = size * factor / ring.busbw + units * (ring.ranks - 1) * ring.latency
        return {"name": name, "ranks": ring.ranks, "busbw_gbs": ring.busbw / 1e9, "buffer_bytes": size,
                "per_gpu_bytes": size * factor, "count": count, "seconds": seconds,
                "step_bytes": size * factor * count, "step_seconds": seconds * count}

    units = L + 1
    items = [
        collective("all-gather forward (bf16)", shard, P * PARAM_BYTES, units, k, "all_gather"),
        collective("all-gather backward (bf16, L-1 layers)", shard, (L - 1) * Pl * PARAM_BYTES, L - 1,
                   k, "all_gather"),
        collective("reduce-scatter (fp32)", shard, P * REDUCE_BYTES, units, reduce_scatters,
                   "reduce_scatter"),
    ]
    if replicate is not None:
        items.append(collective("all-reduce across nodes (fp32 shards)", replicate,
                                P * REDUCE_BYTES / devices, units, all_reduces, "all_reduce"))
    gather_fwd, gather_bwd, scatter = items[:3]

    tokens = micro_batch_size * tokens_per_record(kind, seq_len, packing=packing, prompt_share=prompt_share)
    useful = tokens * flops_per_token(shape, seq_len)
    recompute = 4 / 3 if activation_checkpointing else 1.0
    compute = useful * recompute / (compute_mfu * peak_flops)
    # The root's own collectives: nothing computes before its forward all-gather or after its
    # gradients' reduce-scatter (and all-reduce).
    root_gather = shard.time(Pr * PARAM_BYTES, ring_factor(n, "all_gather")) if n > 1 else 0.0
    root_scatter = shard.time(Pr * REDUCE_BYTES, ring_factor(n, "reduce_scatter")) if n > 1 else 0.0
    root_reduce = (replicate.time(Pr * REDUCE_BYTES / devices, ring_factor(replicate.ranks, "all_reduce"))
                   if all_reduces else 0.0)

    def micro_step(scatters: bool, reduces: bool) -> tuple[float, float]:
        comm = gather_fwd["seconds"] + gather_bwd["seconds"]
        comm += scatter["seconds"] if scatters else 0.0
        comm += items[3]["seconds"] if reduces else 0.0
        exposed = max(0.0, comm - compute) + root_gather
        exposed += root_scatter if scatters else 0.0
        exposed += root_reduce if reduces else 0.0
        return comm, exposed

    # The last micro step reduces; the k - 1 before it reduce only where every micro step does.
    last = micro_step(True, all_reduces > 0)
    other = micro_step(reduce_scatters == k, all_reduces == k)
    exposed = last[1] + (k - 1) * other[1]
    step = k * compute + exposed
    return {
        "sharding": sharding,
        "grad_sync": grad_sync,
        "num_nodes": num_nodes,
        "devices": devices,
        "accumulation": k,
        "micro_batch_size": micro_batch_size,
        "seq_len": seq_len,
        "tokens_per_micro_step": tokens,
        "records_per_s_per_gpu": k * micro_batch_size / step,
        "activation_checkpointing": activation_checkpointing,
        "links": vars(links),
        "shard_group": {"ranks": shard.ranks, "busbw_gbs": shard.busbw / 1e9},
        "replicate_group": (None if replicate is None
                            else {"ranks": replicate.ranks, "busbw_gbs": replicate.busbw / 1e9}),
        "collectives": items,
        "comm_bytes_per_step": sum(i["step_bytes"] for i in items),
        "comm_seconds_per_step": sum(i["step_seconds"] for i in items),
        "compute_mfu": compute_mfu,
        "peak_flops": peak_flops,
        "compute_seconds_per_micro_step": compute,
        "exposed_seconds_per_step": exposed,
        "step_seconds": step,
        "mfu": k * useful / (step * peak_flops),
    }


def sharding_world(sharding: str, num_nodes: int, devices: int) -> int:
    """GPUs the states are sharded over: every GPU under FSDP, one node's under HSDP."""
    return devices if sharding == "hsdp" else num_nodes * devices


def choose_sharding(shape: ModelShape, *, num_nodes: int, devices: int, seq_len: int,
                    micro_batch_size: int, kind: str = "pairwise", precision: str = "bf16-mixed",
                    activation_checkpointing: bool = False, compiled: bool = True,
                    gpu_memory_gib: float = 80.0, **memory_settings) -> str:
    """parallel.sharding=auto: "hsdp" when there are several nodes of several GPUs and the memory
    plan with the states sharded over one node's GPUs fits, else "fsdp" (over all ranks)."""
    if num_nodes < 2 or devices < 2:
        return "fsdp"
    plan = memory_plan(shape, world=devices, seq_len=seq_len, micro_batch_size=micro_batch_size,
                       kind=kind, precision=precision, strategy="fsdp",
                       activation_checkpointing=activation_checkpointing, compiled=compiled,
                       gpu_memory_gib=gpu_memory_gib, **memory_settings)
    return "hsdp" if plan["fits"] else "fsdp"
