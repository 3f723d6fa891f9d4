"""Scoring spread over workers and nodes on Ray (`engine=ray`; docs/DESIGN.md section 8.5).

`RayScorer` stands where a CRMScorer stands for crm-eval, crm-leaderboard and crm-usl: it answers
`pair_probabilities` (test files, boards) and `score_groups` (benchmarks) by cutting the rows into
blocks and running the blocks on a pool of Ray actors, each holding one CRMScorer (one per GPU on a
cluster; on CPU one per `cpus_per_worker` cores, with that many torch threads).

- **Blocks of whole prompt groups.** Rows that share criteria and query (a benchmark query's
  candidates, a benchmark prompt's completions) stay in one block, so the scorer's prefix reuse and
  the round robin see what they see in one process; a block holds `block_prompts` groups.
- **Streamed to idle workers.** Each worker holds two blocks at a time (it starts the second while
  the driver stores the first's result); the next block goes to whichever worker frees up first, so
  long and short rows balance.
- **Keyed by row.** A block's result carries its rows' indices; the driver places them, checks that
  every row arrived exactly once, and returns them in the caller's order.
- **Resumable.** With a run dir, each finished block is written atomically (a temporary file, then
  a rename: a half-written block never counts) to `blocks/<task>/<block>.npz` (numpy arrays and a
  JSON string: no pickle). The same command rerun finds them, says how many it skipped and runs the
  rest. `blocks/<task>/plan.json` holds the block plan and a fingerprint of its inputs: blocks of
  other inputs are refused, never mixed in. `engine.json` records the engine, its workers and each
  task's plan, skips and retries.
- **Faults.** A worker process that dies (SIGKILL, out of memory) is restarted by Ray and its
  unanswered blocks are redone, each alone on a worker, where a death is known to be that block's;
  a block whose worker dies `block_attempts` times while it is the worker's one unanswered block
  stops the job with one line naming the block's rows. An error the scorer raises (a pair that
  cannot fit) is raised as it is.

Plain Ray actors rather than Ray Data: the work is a few thousand blocks whose results must land
exactly once, be written by the driver as they finish and be skipped on a rerun; a block is a
prompt group set, not a fixed number of rows; and a block that keeps killing its worker must be
named and stop the job. Ray Data's streaming executor owns batching, retries and output order, and
gives none of these hooks (and needs ray[data]'s pandas/pyarrow stack in every worker).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from crm.core.errors import ConfigError
from crm.core.files import write_json
from crm.core.prompts import PromptEncoder, PromptTemplate
from crm.inference.config import EngineConfig

log = logging.getLogger("crm.inference.engine")

INSTALL_HINT = "pip install 'crm[ray]'"
# Blocks per worker at a time: two, so that a worker starts its next block while the driver is
# still storing the last one's result (one at a time left each worker idle about 22 ms a block on
# CPU: 1.67x of one process's rows/s on two cores against 1.74-1.80x with two, docs/PERFORMANCE.md
# section 12).
# A death with two of a worker's blocks unanswered does not say which one it was running: neither
# is counted, and each is redone alone (_BlockRun), where a death is that block's.
BLOCKS_IN_FLIGHT = 2
NAMED_ROWS = 5  # rows an error names before "..."


@dataclass(frozen=True)
class ScorerLoader:
    """How each worker loads its CRMScorer (what `crm.cli.scorer.load_scorer` would load)."""

    checkpoint: str
    batch_size: int = 16
    dtype: str = "auto"
    compile: Any = "auto"
    prefix_reuse: bool = True

    def __call__(self, device: str):
        from crm.inference.scorer import CRMScorer
        from crm.models.backbone import DTYPES

        return CRMScorer.load(self.checkpoint, batch_size=self.batch_size, device=torch.device(device),
                              dtype=None if self.dtype == "auto" else DTYPES[self.dtype],
                              prefix_reuse=self.prefix_reuse, progress=False, compile=self.compile)


def checkpoint_identity(path: str | Path) -> str:
    """The checkpoint's path and each of its files' size and modification time: a retrained
    checkpoint at the same path changes it (cheap: no file is read)."""
    path = Path(path).resolve()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    stats = [(str(p.relative_to(path.parent)), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    return _digest(str(path), stats)


def _digest(*parts) -> str:
    """A hash of `parts`; a list is hashed item by item (a job's rows are never one string)."""
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        for item in part if isinstance(part, list) else [part]:
            h.update(repr(item).encode("utf-8", "surrogatepass"))
            h.update(b"\x00")
        h.update(b"\x01")
    return h.hexdigest()


# How plan_blocks cuts (in every fingerprint): a run dir's blocks cut another way are refused.
PLAN = "groups-by-length"


def plan_blocks(group_keys: Sequence, block_prompts: int,
                row_lengths: Sequence[int] | None = None) -> list[list[int]]:
    """Row indices per block: rows of one key (a prompt group) in one block, `block_prompts` groups
    per block, groups in order of first appearance; with `row_lengths`, groups of longer rows
    first (ties in order of appearance).

    A worker's scorer sorts its block's rows by length into batches, as one process sorts all of
    them: blocks of like-length groups keep its batches' padding near one process's (blocks of
    groups as they come padded 13% more tokens than one process on the demo board, in blocks of 8
    groups), and the longest blocks going out first leave short ones for the end."""
    groups: dict = {}
    for i, key in enumerate(group_keys):
        groups.setdefault(key, []).append(i)
    members = list(groups.values())
    if row_lengths is not None:
        members.sort(key=lambda rows: -sum(row_lengths[i] for i in rows) / len(rows))
    return [[i for group in members[start:start + block_prompts] for i in group]
            for start in range(0, len(members), block_prompts)]


def pair_blocks(examples: Sequence, block_prompts: int) -> list[list[int]]:
    """The block plan of pairs (test files, boards): a prompt group is a criteria and query."""
    return plan_blocks([(e.criteria, e.query) for e in examples], block_prompts,
                       [_chars(e.query, e.conv_a, e.conv_b) for e in examples])


def _chars(*parts) -> int:
    """Characters of texts, conversations (messages with .content) and lists of either: a row's
    length as the block plan compares them."""
    total = 0
    for part in parts:
        if isinstance(part, str):
            total += len(part)
        elif hasattr(part, "content"):
            total += len(part.content)
        elif isinstance(part, (list, tuple)):
            total += _chars(*part)
    return total


class BlockFailed(ConfigError):
    """A block whose worker died every time it ran it: the job stops, naming the block's rows."""


# -- the worker ------------------------------------------------------------------------------------

class ScoringWorker:
    """One CRMScorer in a Ray actor (made remote by RayScorer, with the worker's resources)."""

    def __init__(self, load: Callable[[str], Any], device: str, threads: int):
        if device == "cpu":
            torch.set_num_threads(threads)
        self.scorer = load(device)

    def describe(self) -> dict:
        import ray

        s = self.scorer
        return {"pid": os.getpid(), "node": ray.util.get_node_ip_address(),
                "node_id": ray.get_runtime_context().get_node_id(), "device": str(s.device),
                "dtype": str(next(s.model.parameters()).dtype).removeprefix("torch."),
                "threads": torch.get_num_threads(), "kind": s.kind,
                "template": asdict(s.template), "max_tokens": s.encoder.max_tokens,
                "min_turn_tokens": s.encoder.min_turn_tokens, "tokenizer": s.tokenizer}

    def pairs(self, examples: list, unfit: str, both_orders: bool) -> dict:
        started = time.process_time()
        self.scorer.counts.clear()
        probs = self.scorer.pair_probabilities(examples, unfit=unfit, both_orders=both_orders)
        return {"values": probs.float().numpy(), "counts": dict(self.scorer.counts),
                "cpu_seconds": np.float64(time.process_time() - started)}

    def groups(self, groups: list, sequences_per_call: int) -> dict:
        from crm.inference.reward import CRMReward, split_calls

        started = time.process_time()
        reward = CRMReward(self.scorer, unfit="nan")  # as engine=local: an unfit group is NaN
        self.scorer.counts.clear()
        fits = reward.fits([(criteria, query) for criteria, query, _ in groups])
        values = [[float("nan")] * len(completions) for _, _, completions in groups]
        fitting = [i for i, ok in enumerate(fits) if ok]
        for chunk in split_calls([len(groups[i][2]) for i in fitting], fitting, sequences_per_call,
                            pairwise=reward.strategy == "round_robin"):
            for i, scores in zip(chunk, reward.score_groups([groups[i] for i in chunk])):
                values[i] = scores
        return {"values": np.asarray([v for vs in values for v in vs], dtype=np.float64),
                "lengths": np.asarray([len(vs) for vs in values], dtype=np.int64),
                "fits": np.asarray(fits, dtype=bool),
                "counts": {**self.scorer.counts, "forwards": reward.counts["forwards"]},
                "cpu_seconds": np.float64(time.process_time() - started)}


# -- blocks on disk --------------------------------------------------------------------------------

class BlockStore:
    """`dir/plan.json` and one `dir/<block>.npz` per finished block, each written whole or not at
    all; None for a run without a run dir (crm-usl: its verdict cache keeps what was scored)."""

    def __init__(self, directory: Path | None, plan: dict):
        self.dir = directory
        if directory is None:
            return
        plan_file = directory / "plan.json"
        if plan_file.is_file():
            before = json.loads(plan_file.read_text(encoding="utf-8"))
            if before.get("fingerprint") != plan["fingerprint"]:
                raise ConfigError(
                    f"{directory}: finished blocks of another scoring (other rows, checkpoint or "
                    f"engine.block_prompts): give this run its own name=, or remove {directory.parent} "
                    "to start over")
        else:
            write_json(plan_file, plan)

    def path(self, block: int) -> Path:
        return self.dir / f"{block:06d}.npz"

    def load(self, block: int, rows: list[int]) -> dict | None:
        if self.dir is None or not self.path(block).is_file():
            return None
        try:
            with np.load(self.path(block), allow_pickle=False) as data:
                result = {key: data[key] for key in data.files}
        except (OSError, ValueError) as exc:  # written atomically, so not ours: redone
            log.warning("%s: unreadable (%s): the block is scored again", self.path(block), exc)
            return None
        if result["rows"].tolist() != rows:
            raise ConfigError(f"{self.path(block)}: holds rows other than its plan's: remove "
                              f"{self.dir.parent} to start over")
        result["counts"] = json.loads(str(result["counts"]))
        return result

    def save(self, block: int, result: dict) -> None:
        if self.dir is None:
            return
        arrays = {k: v for k, v in result.items() if k != "counts"}
        tmp = self.path(block).with_name(self.path(block).name + ".tmp")
        with open(tmp, "wb") as f:
            np.savez(f, counts=np.asarray(json.dumps(result["counts"])), **arrays)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(self.path(block))


# -- the driver ------------------------------------------------------------------------------------

def import_ray():
    try:
        import ray
    except ImportError:
        raise ConfigError(f"engine=ray needs Ray, which is not installed: {INSTALL_HINT} "
                          "(or engine=local)") from None
    return ray


def _check_reachable(address: str, timeout: float) -> None:
    """A host:port that does not answer is one line within `timeout` seconds (ray.init would retry
    for minutes)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"engine.address={address}: expected null, auto or host:port")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            pass
    except OSError as exc:
        raise ConfigError(f"engine.address={address}: no Ray cluster answers there within "
                          f"{timeout:g} s ({exc.strerror or exc}); start one (`ray start --head`, "
                          "launch/score.sbatch) or leave engine.address null for a local one") from None


def connect(config: EngineConfig) -> bool:
    """Ray connected as `config` says; True when this call started it (and so stops it)."""
    ray = import_ray()
    address = config.address
    if address == "auto":
        address = os.environ.get("RAY_ADDRESS") or "auto"
    if address not in (None, "auto"):
        _check_reachable(address.removeprefix("ray://"), config.connect_timeout)
    if ray.is_initialized():  # a Ray this process joined already (a test's, a notebook's)
        return False
    if address is None:
        gpus = torch.cuda.device_count()
        ray.init(num_cpus=os.cpu_count(), num_gpus=gpus, include_dashboard=False,
                 object_store_memory=config.object_store_mib * 2**20, logging_level=logging.WARNING,
                 configure_logging=False)
        return True
    try:
        ray.init(address=address, logging_level=logging.WARNING, configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError, ray.exceptions.RayError) as exc:
        # e.g. no cluster on this machine (auto), or a cluster that wants a token this process
        # lacks (RAY_AUTH_TOKEN_PATH)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"engine.address={config.address}: cannot join a Ray cluster: "
                          f"{first}") from None
    return True


class WorkerPool:
    """The Ray actors, one CRMScorer each, and what the driver needs of the CRM (kind, template,
    tokenizer, length limit) from the first of them: the driver loads no model.

    Workers that die are restarted by Ray; the pool keeps which are down until they answer again,
    across tasks. `close()` stops them, and a Ray that `connect` started here.
    """

    def __init__(self, load: Callable[[str], Any], config: EngineConfig):
        ray = import_ray()
        self.config = config
        self.actors: list = []
        self.down: set[int] = set()  # restarting: no block until they answer
        self.probes: dict = {}  # ref -> worker: a restarting worker's describe() call
        started = time.perf_counter()
        self._owns_ray = connect(config)
        try:
            self._start(ray, load)
        except BaseException:
            self.close()
            raise
        self.startup_seconds = time.perf_counter() - started

    def _start(self, ray, load) -> None:
        config = self.config
        total = ray.cluster_resources()
        cluster_gpus, cluster_cpus = total.get("GPU", 0), total.get("CPU", 0)
        gpus = config.gpus_per_worker
        if gpus is None:
            gpus = 1 if cluster_gpus > 0 else 0
        if config.workers is not None:
            workers = config.workers
        elif gpus > 0:
            workers = int(cluster_gpus // gpus)
        else:
            workers = int(cluster_cpus // config.cpus_per_worker)
        where = f"the cluster ({'local' if config.address is None else config.address})"
        if workers < 1:
            raise ConfigError(f"engine: no worker fits {where}: {cluster_cpus:g} CPUs, "
                              f"{cluster_gpus:g} GPUs")
        if workers * gpus > cluster_gpus:
            raise ConfigError(f"engine.workers={workers} x engine.gpus_per_worker={gpus:g} needs "
                              f"{workers * gpus:g} GPUs; {where} has {cluster_gpus:g}")
        if workers * config.cpus_per_worker > cluster_cpus:
            raise ConfigError(f"engine.workers={workers} x engine.cpus_per_worker="
                              f"{config.cpus_per_worker} needs {workers * config.cpus_per_worker} "
                              f"CPUs; {where} has {cluster_cpus:g}")
        device = "cuda" if gpus > 0 else "cpu"
        # max_task_retries=0: a dead worker's blocks come back as errors, which the driver counts
        # per block (Ray's own retries would redo a block that kills its worker forever).
        actor = ray.remote(num_cpus=config.cpus_per_worker, num_gpus=gpus, max_restarts=-1,
                           max_task_retries=0)(ScoringWorker)
        env = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
               "OMP_NUM_THREADS": str(config.cpus_per_worker)}
        self.actors = [actor.options(runtime_env={"env_vars": env}).remote(
            load, device, config.cpus_per_worker) for _ in range(workers)]
        try:
            infos = ray.get([a.describe.remote() for a in self.actors])
        except ray.exceptions.RayError as exc:
            raise RuntimeError(f"engine: a worker could not load the CRM: {_cause(exc)}") from None
        first = infos[0]
        self.kind = first["kind"]
        self.template = PromptTemplate(**first["template"])
        self.tokenizer = first["tokenizer"]
        self.encoder = PromptEncoder(self.tokenizer, self.template, first["max_tokens"],
                                     first["min_turn_tokens"])
        self.dtype = first["dtype"]
        self.gpus_per_worker = gpus
        self.address = ray.get_runtime_context().gcs_address
        self.workers = [_public(info) for info in infos]

    def died(self, w: int) -> None:
        """Worker `w` died: Ray restarts it; it gets blocks again once it answers."""
        if w not in self.down:
            self.down.add(w)
            self.probes[self.actors[w].describe.remote()] = w

    def probed(self, ref) -> None:
        """A restarting worker answered (back in the pool) or is still restarting (asked again)."""
        import ray

        w = self.probes.pop(ref)
        try:
            info = ray.get(ref)
        except ray.exceptions.ActorUnavailableError:  # still restarting
            time.sleep(0.2)
            self.probes[self.actors[w].describe.remote()] = w
            return
        except ray.exceptions.RayActorError as exc:  # dead for good (its node is gone)
            raise RuntimeError(f"engine: worker {w} died and cannot restart: {_cause(exc)}") from None
        self.workers[w] = _public(info)
        self.down.discard(w)

    def describe(self) -> dict:
        return {"engine": asdict(self.config), "address": self.address,
                "started_ray": self._owns_ray, "gpus_per_worker": self.gpus_per_worker,
                "blocks_in_flight": BLOCKS_IN_FLIGHT,
                "startup_seconds": round(self.startup_seconds, 3), "workers": self.workers}

    def close(self) -> None:
        """The workers stopped; a Ray this pool started, shut down."""
        import ray

        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
        self._owns_ray = False


def _public(info: dict) -> dict:
    """A worker's record for engine.json: where it runs, not the CRM it holds."""
    return {k: v for k, v in info.items() if k not in ("tokenizer", "template")}


class RayScorer:
    """What crm's evaluation reads of a CRMScorer (kind, template, encoder, counts,
    pair_probabilities, score_groups), each call a task of blocks run by a WorkerPool (module
    docstring). `RayScorer.start` makes the pool and stops it at `close()`; a RayScorer over
    another's pool (a rerun of the same command, in the tests) leaves it running.

    `identity` names the CRM in the blocks' fingerprint (`checkpoint_identity`); `run_dir` (None:
    nothing written) holds the blocks and engine.json; `on_block(task, block)` is called in the
    driver after each block is stored.
    """

    def __init__(self, pool: WorkerPool, *, identity: str, run_dir: str | Path | None = None,
                 on_block: Callable[[str, int], None] | None = None, owns_pool: bool = False,
                 config: EngineConfig | None = None, progress: bool = False):
        self.pool, self.identity, self.on_block = pool, identity, on_block
        self.progress = progress  # a bar over each task's blocks (stderr)
        self.config = config or pool.config  # its block_prompts and block_attempts
        self.run_dir = None if run_dir is None else Path(run_dir)
        self.owns_pool = owns_pool
        self.kind, self.template, self.encoder = pool.kind, pool.template, pool.encoder
        self.tokenizer, self.dtype = pool.tokenizer, pool.dtype
        self.counts = Counter()  # the workers' CRMScorer counts, summed over every block
        self.cpu_seconds = 0.0  # the workers' CPU time in the blocks, summed (skipped ones too)
        self.tasks: list[dict] = []
        self._calls = 0
        self._lock = threading.Lock()
        self._record()

    @classmethod
    def start(cls, load: Callable[[str], Any], config: EngineConfig, *, identity: str,
              run_dir: str | Path | None = None, **kwargs) -> RayScorer:
        """A pool of `config.workers` workers, each with `load(device)`'s CRMScorer, and a scorer
        that owns it."""
        return cls(WorkerPool(load, config), identity=identity, run_dir=run_dir, owns_pool=True,
                   **kwargs)

    # -- what the evaluation calls -----------------------------------------------------------------

    def pair_probabilities(self, examples: Sequence, unfit: str = "raise",
                           both_orders: bool = False) -> torch.Tensor:
        """(n, 3) P(A), P(B), P(tie), as CRMScorer.pair_probabilities computes them."""
        examples = list(examples)
        blocks = pair_blocks(examples, self.config.block_prompts)
        fingerprint = _digest("pairs", PLAN, self.identity, unfit, both_orders, self.config.block_prompts,
                              [(e.criteria, e.query, e.conv_a, e.conv_b) for e in examples])
        results = self._run("pairs", fingerprint, blocks, [e.key for e in examples],
                            lambda rows: ([examples[i] for i in rows], unfit, both_orders))
        out = torch.full((len(examples), 3), float("nan"))
        for rows, result in results:
            out[torch.as_tensor(rows)] = torch.from_numpy(np.array(result["values"]))
        return out

    def score_groups(self, groups: Sequence[tuple], names: Sequence[str] | None = None,
                     sequences_per_call: int = 4096) -> tuple[list[list[float]], list[bool], int]:
        """Per (criteria, query, completions): a score per completion (a pointwise CRM's reward,
        a pairwise CRM's round robin, NaN where criteria and query cannot fit), whether it fits,
        and the forwards run. `names` name the groups in errors."""
        groups = list(groups)
        blocks = plan_blocks(range(len(groups)), self.config.block_prompts,
                             [_chars(query, completions) for _, query, completions in groups])
        fingerprint = _digest("groups", PLAN, self.identity, self.config.block_prompts, groups)
        names = list(names) if names is not None else [str(i) for i in range(len(groups))]
        results = self._run("groups", fingerprint, blocks, names,
                            lambda rows: ([groups[i] for i in rows], sequences_per_call))
        scores: list = [None] * len(groups)
        fits = [False] * len(groups)
        forwards = 0
        for rows, result in results:
            values, start = result["values"].tolist(), 0
            for i, n, ok in zip(rows, result["lengths"].tolist(), result["fits"].tolist()):
                scores[i], fits[i] = values[start:start + n], ok
                start += n
            forwards += result["counts"].get("forwards", 0)
        return scores, fits, forwards

    # -- the blocks --------------------------------------------------------------------------------

    def _run(self, op: str, fingerprint: str, blocks: list[list[int]], names: list[str],
             arguments: Callable[[list[int]], tuple]) -> list[tuple[list[int], dict]]:
        with self._lock:
            return self._run_locked(op, fingerprint, blocks, names, arguments)

    def _run_locked(self, op, fingerprint, blocks, names, arguments):
        self._calls += 1
        task = f"{self._calls:03d}-{op}"
        rows_total = sum(len(b) for b in blocks)
        plan = {"task": task, "op": op, "fingerprint": fingerprint, "rows": rows_total,
                "block_prompts": self.config.block_prompts, "blocks": [len(b) for b in blocks]}
        store = BlockStore(None if self.run_dir is None else self.run_dir / "blocks" / task, plan)
        results: dict[int, dict] = {}
        for b, rows in enumerate(blocks):
            found = store.load(b, rows)
            if found is not None:
                results[b] = found
        skipped = len(results)
        if skipped:
            log.info("%s: %d of %d blocks already finished in %s: skipped", task, skipped,
                     len(blocks), store.dir)
        started = time.perf_counter()
        from tqdm.auto import tqdm

        run = _BlockRun(self, op, task, blocks, names, arguments, store, results)
        with tqdm(total=len(blocks), initial=skipped, disable=not self.progress, unit="block",
                  desc=task, dynamic_ncols=True, leave=False) as run.bar:
            try:
                run.until_done([b for b in range(len(blocks)) if b not in results])
            finally:  # interrupted (Ctrl-C, an error): what is still queued is abandoned
                run.abandon()
        self._gather_check(task, blocks, results)
        for result in results.values():
            self.counts.update(result["counts"])
            self.cpu_seconds += float(result.get("cpu_seconds", 0.0))
        self.tasks.append({"task": task, "op": op, "rows": rows_total, "blocks": len(blocks),
                           "skipped": skipped, "retried": run.retried,
                           "seconds": round(time.perf_counter() - started, 3)})
        log.info("%s: %d rows in %d blocks on %d workers, %.1f s (%d skipped, %d redone)", task,
                 rows_total, len(blocks), len(self.pool.actors), self.tasks[-1]["seconds"],
                 skipped, run.retried)
        self._record()
        return [(blocks[b], results[b]) for b in range(len(blocks))]

    @staticmethod
    def _gather_check(task: str, blocks: list[list[int]], results: dict) -> None:
        """Every row of the plan exactly once: a row missing or twice is a bug, never a score."""
        seen = Counter(i for b in results for i in results[b]["rows"].tolist())
        expected = Counter(i for rows in blocks for i in rows)
        if seen != expected or any(n != 1 for n in seen.values()):
            raise RuntimeError(f"{task}: the gathered rows differ from the plan's "
                               f"({sum(seen.values())} gathered, {sum(expected.values())} planned)")

    def _record(self) -> None:
        if self.run_dir is None:
            return
        write_json(self.run_dir / "engine.json", {**self.pool.describe(), "tasks": self.tasks})

    def close(self) -> None:
        """The pool stopped, where this scorer started it."""
        if self.owns_pool:
            self.pool.close()


class _BlockRun:
    """One task's blocks streamed to the pool's workers, at most BLOCKS_IN_FLIGHT per worker, each
    result stored as it arrives. A worker that dies gets no block until it is back, and its
    unanswered blocks are redone. A death counts against a block (towards `block_attempts`) only
    where that block was the worker's one unanswered block; a death with more leaves the culprit
    unknown, so none is counted and each is redone alone: first, and on a worker holding nothing
    else."""

    def __init__(self, scorer: RayScorer, op, task, blocks, names, arguments, store, results):
        import ray

        self.ray, self.scorer, self.pool, self.op, self.task = ray, scorer, scorer.pool, op, task
        self.blocks, self.names, self.arguments = blocks, names, arguments
        self.store, self.results = store, results
        self.in_flight: dict = {}  # ref -> (block, worker)
        self.given = {w: [] for w in range(len(self.pool.actors))}  # each worker's, oldest first
        self.alone: deque = deque()  # blocks to redo alone, after a death
        self.alone_given: set = set()  # those of them a worker holds now
        self.attempts: Counter = Counter()
        self.retried = 0

    def until_done(self, pending: list[int]) -> None:
        ray, pool = self.ray, self.pool
        self.queue = deque(pending)
        while self.queue or self.alone or self.in_flight:
            self._give()
            (ref,), _ = ray.wait([*self.in_flight, *pool.probes], num_returns=1)
            if ref in pool.probes:
                pool.probed(ref)
                continue
            b, w = self.in_flight.pop(ref)
            try:
                result = ray.get(ref)
            except ray.exceptions.RayTaskError as exc:  # the scorer's own error: as it is
                raise _cause(exc) from None
            except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError) as exc:
                self._worker_died(w, b, exc)
                continue
            self._store(b, w, result)

    def _give(self) -> None:
        """Each worker's first block before any worker's second, so that every worker is busy from
        the start; a block to redo alone goes to a worker holding nothing, and keeps it to itself."""
        for depth in range(BLOCKS_IN_FLIGHT):
            if depth and self.alone:  # no second block while one waits for an empty worker
                return
            for w in range(len(self.pool.actors)):
                held = self.given[w]
                if w in self.pool.down or len(held) != depth or self.alone_given.intersection(held):
                    continue
                if not held and self.alone:
                    b = self.alone.popleft()
                    self.alone_given.add(b)
                elif self.queue:
                    b = self.queue.popleft()
                else:
                    continue
                ref = getattr(self.pool.actors[w], self.op).remote(*self.arguments(self.blocks[b]))
                self.in_flight[ref] = (b, w)
                held.append(b)

    def _store(self, b: int, w: int, result: dict) -> None:
        self.given[w].remove(b)
        self.alone_given.discard(b)
        result["rows"] = np.asarray(self.blocks[b], dtype=np.int64)
        self.store.save(b, result)
        self.results[b] = result
        self.bar.update(1)
        if self.scorer.on_block is not None:
            self.scorer.on_block(self.task, b)

    def _worker_died(self, w: int, b: int, exc) -> None:
        ray = self.ray
        others = [ref for ref, (_, ow) in self.in_flight.items() if ow == w]
        if others:  # a dead worker's other blocks fail within moments; a finished one is kept
            ray.wait(others, num_returns=len(others), timeout=60)
        failed = [b]
        for ref in others:
            ob, _ = self.in_flight.pop(ref)
            try:
                self._store(ob, w, ray.get(ref, timeout=0))
            except ray.exceptions.RayTaskError as error:
                raise _cause(error) from None
            except (ray.exceptions.RayError, TimeoutError):
                failed.append(ob)
        failed.sort(key=self.given[w].index)
        self.retried += len(failed)
        self.given[w] = []
        self.alone_given.difference_update(failed)
        self.pool.died(w)
        if len(failed) > 1:
            log.warning("%s: worker %d died holding blocks %s (%s): each redone alone", self.task,
                        w, ", ".join(map(str, failed)), type(exc).__name__)
            self.alone.extendleft(reversed(failed))
            return
        self.attempts[b] += 1
        if self.attempts[b] >= self.scorer.config.block_attempts:
            rows = [self.names[i] for i in self.blocks[b]]
            listed = ""
            if self.store.dir is not None:  # every row, where a one-line message has no room
                path = write_json(self.store.dir / f"failed-{b:06d}.json",
                                  {"block": b, "deaths": self.attempts[b], "rows": rows})
                listed = f"; the rows: {path}"
            raise BlockFailed(
                f"{self.task}: block {b} ({len(rows)} rows: {', '.join(rows[:NAMED_ROWS])}"
                f"{f' and {len(rows) - NAMED_ROWS} more' if len(rows) > NAMED_ROWS else ''}) "
                "killed its worker "
                f"{self.attempts[b]} times ({type(exc).__name__}); its rows are not scored, "
                f"the job stops{listed}")
        log.warning("%s: worker %d died in block %d (%s): redone", self.task, w, b,
                    type(exc).__name__)
        self.alone.appendleft(b)

    def abandon(self) -> None:
        for ref in self.in_flight:
            try:
                self.ray.cancel(ref)
            except Exception:  # finished already, or its worker gone
                pass


def _cause(exc) -> BaseException:
    """The exception a Ray task raised inside its worker (Ray wraps it with the remote traceback)."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc
