"""Scoring spread over workers and nodes on Ray (`engine=ray`; docs/DESIGN.md section 8.5).

`RayScorer` stands where a CRMScorer stands for crm-eval, crm-leaderboard and crm-usl: it answers
`pair_probabilities` (test files, boards) and `score_groups` (benchmarks) by cutting the rows into
blocks and running the blocks on a pool of Ray actors, each holding one CRMScorer (one per GPU on a
cluster; on CPU one per `cpus_per_worker` cores, with that many torch threads).

- **Blocks of whole prompt groups.** Rows that share criteria and query (a benchmark query's
  candidates, a benchmark prompt's completions) stay in one block, so the scorer's prefix reuse and
  the round robin see what they see in one process; a block holds at most `block_prompts` groups,
  fewer where that leaves a worker without two blocks.
- **Streamed to idle workers.** Each worker holds two blocks at a time (it starts the second while
  the driver stores the first's result); the next block goes to whichever worker frees up first, so
  long and short rows balance.
- **Checked and keyed by row.** A worker's reply names its block's rows and is checked against the
  block (row count, ids, no NaN where a row could be scored); the driver places the rows, checks
  that every row arrived exactly once, and returns them in the caller's order.
- **Resumable.** With a run dir, each finished block is written atomically (a temporary file, then
  a rename: a half-written block never counts) to `blocks/<task>/<block>.npz` (numpy arrays and a
  JSON string: no pickle). The same command rerun finds them, says how many it skipped and runs the
  rest. `blocks/<task>/plan.json` holds the block plan and, field by field, what its scores depend
  on: blocks of other inputs are refused naming the field, never mixed in. `engine.json` records
  the engine, its workers and each task's plan, skips and retries.
- **Faults.** A block that fails (its worker dies, it runs past `block_timeout`, its reply is
  wrong) is redone on another worker, on another node where there is one; it stops the job, naming
  its rows, once it has failed `block_attempts` times. A worker that dies or hangs is replaced (Ray
  restarts its process). An error the scorer raises (a pair that cannot fit) is raised as it is.
- **Started behind the driver.** `RayScorer.start` returns at once: Ray and the workers start in a
  thread while the command reads its inputs and plans its blocks; the first call waits for them.

Plain Ray actors rather than Ray Data: the work is a few thousand blocks whose results must land
exactly once, be written by the driver as they finish and be skipped on a rerun; a block is a
prompt group set, not a fixed number of rows; and a block that keeps failing must be named and
stop the job. Ray Data's streaming executor owns batching, retries and output order, and gives
none of these hooks (and needs ray[data]'s pandas/pyarrow stack in every worker).

torch is imported where it is used, not here: a driver starts Ray before it loads torch.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import signal
import socket
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import Any

import numpy as np

from crm.core.errors import ConfigError
from crm.core.files import write_json
from crm.core.prompts import PromptEncoder, PromptTemplate
from crm.inference.config import EngineConfig

log = logging.getLogger("crm.inference.engine")

INSTALL_HINT = "pip install 'crm[ray]'"
# Blocks per worker at a time: two, so that a worker starts its next block while the driver is
# still storing the last one's result (one at a time left each worker idle between blocks,
# docs/PERFORMANCE.md section 12). A death with two of a worker's blocks unanswered does not say
# which one it was running: neither is counted, and each is redone alone (_BlockRun), where a
# death is that block's.
BLOCKS_IN_FLIGHT = 2
# A worker's blocks per task at least, where the prompt groups allow: blocks of `block_prompts`
# groups left a board smaller than workers x block_prompts groups on fewer workers than the pool.
BLOCKS_PER_WORKER = 2
NAMED_ROWS = 5  # rows an error names before "..."

# engine.block_timeout=auto. A block may run TIMEOUT_SLACK times the slowest seconds per character
# the session measured (a block's characters: its rows' texts), and never less than TIMEOUT_FLOOR
# seconds. A worker's first block after it started (loading kernels, compiling layers, warming
# caches) and any block before a rate is measured get TIMEOUT_WARMUP: a hang there is still found,
# later.
TIMEOUT_FLOOR = 300.0
TIMEOUT_SLACK = 10.0
TIMEOUT_WARMUP = 1800.0

# Seconds a block to redo waits for a restarting worker it has not failed on, before it takes one
# it has (a worker whose node is gone is never back; a restart loads the CRM again).
RESTART_WAIT = 600.0

# Tests only: "kill:N" SIGKILLs this process, "interrupt:N" raises KeyboardInterrupt, between the
# N-th block a task stores writing its temporary file and renaming it (a driver killed mid-write).
FAULT_ENV = "CRM_ENGINE_FAULT"


@dataclass(frozen=True)
class ScorerLoader:
    """How each worker loads its CRMScorer (what `crm.cli.scorer.load_scorer` would load)."""

    checkpoint: str
    batch_size: int = 16
    dtype: str = "auto"
    compile: Any = "auto"
    prefix_reuse: bool = True

    def __call__(self, device: str):
        import torch

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
                row_lengths: Sequence[int] | None = None, min_blocks: int = 1) -> list[list[int]]:
    """Row indices per block: rows of one key (a prompt group) in one block, at most
    `block_prompts` groups per block and fewer where that makes at least `min_blocks` blocks,
    groups in order of first appearance; with `row_lengths`, groups of longer rows first (ties in
    order of appearance).

    A worker's scorer sorts its block's rows by length into batches, as one process sorts all of
    them: blocks of like-length groups keep its batches' padding near one process's (blocks of
    groups as they come pad more: docs/PERFORMANCE.md section 12), and the longest blocks going
    out first leave short ones for the end."""
    groups: dict = {}
    for i, key in enumerate(group_keys):
        groups.setdefault(key, []).append(i)
    members = list(groups.values())
    if row_lengths is not None:
        members.sort(key=lambda rows: -sum(row_lengths[i] for i in rows) / len(rows))
    per_block = max(1, min(block_prompts, math.ceil(len(members) / max(min_blocks, 1))))
    return [[i for group in members[start:start + per_block] for i in group]
            for start in range(0, len(members), per_block)]


def pair_blocks(examples: Sequence, block_prompts: int, min_blocks: int = 1) -> list[list[int]]:
    """The block plan of pairs (test files, boards): a prompt group is a criteria and query."""
    return plan_blocks([(e.criteria, e.query) for e in examples], block_prompts,
                       [_chars(e.query, e.conv_a, e.conv_b) for e in examples], min_blocks)


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
    """A block that failed `block_attempts` times: the job stops, naming the block's rows."""


# -- the worker ------------------------------------------------------------------------------------

class ScoringWorker:
    """One CRMScorer in a Ray actor (made remote by WorkerPool, with the worker's resources)."""

    def __init__(self, load: Callable[[str], Any], device: str, threads: int):
        # Set here rather than as a runtime_env: an actor without one starts in the worker
        # processes Ray has already started, not in new ones (a process and Ray's import each).
        # Before the CRM loads: the tokenizer reads its switch at first use, the hub at import.
        os.environ.update(TOKENIZERS_PARALLELISM="false", HF_HUB_DISABLE_PROGRESS_BARS="1",
                          OMP_NUM_THREADS=str(threads))
        import torch

        if device == "cpu":
            torch.set_num_threads(threads)
        self.scorer = load(device)

    def describe(self) -> dict:
        import ray
        import torch

        s = self.scorer
        return {"pid": os.getpid(), "node": ray.util.get_node_ip_address(),
                "node_id": ray.get_runtime_context().get_node_id(), "device": str(s.device),
                "dtype": str(next(s.model.parameters()).dtype).removeprefix("torch."),
                "threads": torch.get_num_threads(), "kind": s.kind,
                "template": asdict(s.template), "max_tokens": s.encoder.max_tokens,
                "min_turn_tokens": s.encoder.min_turn_tokens,
                "tokenizer_id": tokenizer_identity(s.tokenizer), "tokenizer": s.tokenizer}

    def pairs(self, rows: list[int], examples: list, unfit: str, both_orders: bool) -> dict:
        started, cpu = time.perf_counter(), time.process_time()
        self.scorer.counts.clear()
        probs = self.scorer.pair_probabilities(examples, unfit=unfit, both_orders=both_orders)
        values = probs.float().numpy()
        scorable = np.ones(len(examples), dtype=bool)
        for i in np.flatnonzero(np.isnan(values).any(axis=1)):  # none, or the few that do not fit
            scorable[i] = self._pair_fits(examples[i], both_orders)
        return {"rows": np.asarray(rows, dtype=np.int64), "values": values,
                "scorable": scorable, "counts": dict(self.scorer.counts),
                "seconds": np.float64(time.perf_counter() - started),
                "cpu_seconds": np.float64(time.process_time() - cpu)}

    def groups(self, rows: list[int], groups: list, sequences_per_call: int) -> dict:
        from crm.inference.reward import CRMReward, split_calls

        started, cpu = time.perf_counter(), time.process_time()
        reward = CRMReward(self.scorer, unfit="nan")  # as engine=local: an unfit group is NaN
        self.scorer.counts.clear()
        fits = reward.fits([(criteria, query) for criteria, query, _ in groups])
        values = [[float("nan")] * len(completions) for _, _, completions in groups]
        fitting = [i for i, ok in enumerate(fits) if ok]
        for chunk in split_calls([len(groups[i][2]) for i in fitting], fitting, sequences_per_call,
                                 pairwise=reward.strategy == "round_robin"):
            for i, scores in zip(chunk, reward.score_groups([groups[i] for i in chunk]), strict=True):
                values[i] = scores
        scorable = []
        for (criteria, query, completions), ok, scores in zip(groups, fits, values):
            for j, value in enumerate(scores):
                scorable.append(ok and (not math.isnan(value)
                                        or self._completion_fits(criteria, query, completions, j)))
        return {"rows": np.asarray(rows, dtype=np.int64),
                "values": np.asarray([v for vs in values for v in vs], dtype=np.float64),
                "lengths": np.asarray([len(vs) for vs in values], dtype=np.int64),
                "fits": np.asarray(fits, dtype=bool), "scorable": np.asarray(scorable, dtype=bool),
                "counts": {**self.scorer.counts, "forwards": reward.counts["forwards"]},
                "seconds": np.float64(time.perf_counter() - started),
                "cpu_seconds": np.float64(time.process_time() - cpu)}

    # Whether a row that came back NaN could have been scored: its prompts, through the length
    # policy again (only NaN rows are: none, or the few that do not fit). A NaN where they fit is
    # the model's (a broken device, an overflow), and the driver fails the block.

    def _pair_fits(self, e, both_orders: bool) -> bool:
        s = self.scorer
        if s.kind == "pointwise":
            fits = s.encoder.fit_pointwise([(e.criteria, e.query, e.conv_a),
                                            (e.criteria, e.query, e.conv_b)])
        else:
            orders = [(e.criteria, e.query, e.conv_a, e.conv_b)]
            if both_orders:
                orders.append((e.criteria, e.query, e.conv_b, e.conv_a))
            fits = s.encoder.fit_pairwise(orders)
        return all(f.ids is not None for f in fits)

    def _completion_fits(self, criteria, query, completions, j: int) -> bool:
        from crm.inference.scorer import as_conversation

        s = self.scorer
        criteria = tuple(criteria)
        convs = [as_conversation(c) for c in completions]
        if s.kind == "pointwise":
            fits = s.encoder.fit_pointwise([(criteria, query, convs[j])])
        else:  # the round robin: each pairing of completion j, in both orders
            others = [c for k, c in enumerate(convs) if k != j and c != convs[j]]
            fits = s.encoder.fit_pairwise([(criteria, query, a, b) for o in others
                                           for a, b in ((convs[j], o), (o, convs[j]))])
        return all(f.ids is not None for f in fits)


def tokenizer_identity(tokenizer) -> str:
    """What the tokenizer encodes with: its vocabulary, merges and normalisation, chat template and
    padding (a fast tokenizer's whole serialisation)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocabulary = backend.to_str() if backend is not None else sorted(tokenizer.get_vocab().items())
    return _digest(vocabulary, getattr(tokenizer, "chat_template", None),
                   tokenizer.pad_token_id, tokenizer.padding_side)


def check_reply(op: str, rows: list[int], sizes: list[int] | None, unfit: str, result: dict) -> str | None:
    """What is wrong with a worker's reply to a block of `rows` (`sizes`: each group's completions,
    for op groups), or None: its rows, its number of values, and no NaN where a row could be
    scored. A reply that is wrong is the block's failure, never a silent truncation."""
    got = result.get("rows")
    if got is None or np.asarray(got).tolist() != rows:
        return f"its rows are not the block's ({0 if got is None else len(got)} rows, {len(rows)} sent)"
    values, scorable = np.asarray(result["values"]), np.asarray(result["scorable"], dtype=bool)
    if op == "pairs":
        if values.shape != (len(rows), 3):
            return f"{values.shape[0] if values.ndim else 0} values for {len(rows)} rows"
        nan = np.isnan(values).any(axis=1)
    else:
        lengths = np.asarray(result["lengths"]).tolist()
        if lengths != sizes or len(result["fits"]) != len(rows):
            return (f"{len(lengths)} groups of {sum(lengths)} completions for {len(rows)} groups "
                    f"of {sum(sizes)}")
        if values.shape != (sum(sizes),):
            return f"{values.size} values for {sum(sizes)} completions"
        nan = np.isnan(values)
    if scorable.shape != nan.shape:
        return "no fit mask for its values"
    if unfit == "raise" and nan.any():
        return f"{int(nan.sum())} NaN values where unfit=raise"
    bad = int((nan & scorable).sum())
    if bad:
        return f"{bad} NaN values where the prompts fit (the model's, not the length policy's)"
    return None


# -- blocks on disk --------------------------------------------------------------------------------

# What a task's scores depend on, field by field (plan.json's fingerprint): a rerun with another
# value of any is refused, naming it. `compile`, `batch_size` and `prefix_reuse` are not among
# them: they change how rows are batched and which kernels run, which moves a score by float
# rounding only, as the batches' make-up already does between engine=local and engine=ray.
DRIVER_FIELDS = ("rows", "criteria", "checkpoint", "scoring", "cut")  # known before the workers are
WORKER_FIELDS = ("tokenizer", "template", "dtype", "device")  # as the workers loaded the CRM
SHOWN = ("scoring", "cut", "dtype", "device")  # short values a refusal shows (the rest: digests)


class BlockStore:
    """`dir/plan.json` and one `dir/<block>.npz` per finished block, each written whole or not at
    all; None for a run without a run dir (crm-usl: its verdict cache keeps what was scored)."""

    def __init__(self, directory: Path | None):
        self.dir = directory
        self.before: dict | None = None
        self.saved = 0
        if directory is not None and (directory / "plan.json").is_file():
            self.before = json.loads((directory / "plan.json").read_text(encoding="utf-8"))

    def check(self, fingerprint: dict, fields: Sequence[str]) -> None:
        """A ConfigError naming the first of `fields` whose value the finished blocks here were
        scored with differs."""
        if self.before is None:
            return
        before = self.before.get("fingerprint")
        if not isinstance(before, dict):
            differ = "they were written by an older crm, without a field-by-field fingerprint"
        else:
            field = next((f for f in fields if before.get(f) != fingerprint[f]), None)
            if field is None:
                return
            differ = (f"{field}: {before.get(field)} there, {fingerprint[field]} now"
                      if field in SHOWN else f"their {field} differ")
        raise ConfigError(f"{self.dir}: finished blocks of another scoring ({differ}): give this "
                          f"run its own name=, or remove {self.dir.parent} to start over")

    def planned(self, rows: int) -> list[list[int]] | None:
        """The blocks a run with the same fingerprint cut here (its cut is kept: a rerun on another
        number of workers resumes it)."""
        blocks = (self.before or {}).get("block_rows")
        if blocks is None:
            return None
        if sorted(i for b in blocks for i in b) != list(range(rows)):
            raise ConfigError(f"{self.dir / 'plan.json'}: its blocks are not a plan of the task's "
                              f"{rows} rows: remove {self.dir.parent} to start over")
        return blocks

    def write_plan(self, plan: dict) -> None:
        if self.dir is not None and self.before is None:
            write_json(self.dir / "plan.json", plan)

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
        self.saved += 1
        _fault(self.saved)
        tmp.replace(self.path(block))


def _fault(saved: int) -> None:
    """FAULT_ENV's fault, at the `saved`-th block a task stores (tests only)."""
    action, _, n = os.environ.get(FAULT_ENV, "").partition(":")
    if not n or int(n) != saved:
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise KeyboardInterrupt(f"{FAULT_ENV}={action}:{n}")


# -- starting Ray ----------------------------------------------------------------------------------

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


class _NotMainThread(logging.Filter):
    """Ray's note that a ray.init outside the main thread sets no SIGTERM handler: the pool starts
    in a thread on purpose, and the command keeps its own handling of SIGTERM."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "SIGTERM handler is not set" not in record.getMessage()


@contextlib.contextmanager
def _single_machine():
    """Ray 2.60 on Linux replaces a node or cluster address of 127.0.0.1 by the machine's routable
    one (resolve_ip_for_localhost), except in its single-machine mode (the one it uses on macOS and
    Windows: `ray_constants.ENABLE_RAY_CLUSTER` off). On for a ray.init of a loopback cluster only:
    a local one this process starts (whose processes then listen on 127.0.0.1 only), or one it
    joins there."""
    from ray._private import ray_constants

    mode = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = mode


def start_local(num_cpus: int, object_store_mib: int, **kwargs) -> None:
    """A Ray on this machine only: its processes listen on 127.0.0.1, with token authentication.

    Token authentication is asked for explicitly: what Ray does for a local start anyway, minus
    the warning it prints on every run when the mode is left unset (docs/DESIGN.md section 8.5)."""
    ray = import_ray()
    _token_auth(local=True)
    with _single_machine():  # address "local": a new Ray, even where `ray start` made one here
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False,
                 _node_ip_address="127.0.0.1",
                 object_store_memory=object_store_mib * 2**20, logging_level=logging.WARNING,
                 configure_logging=False, **kwargs)


def _token_auth(local: bool) -> None:
    """Ray's token authentication, asked for as Ray would turn it on by itself (a local start; a
    cluster joined with a token on this machine), minus the warning Ray prints on every run when
    `RAY_AUTH_MODE` is unset. A mode the user set is theirs; without a token, a join is left to
    Ray (which warns, rightly, that the cluster it joins has no authentication)."""
    from ray._private.authentication import authentication_token_setup as auth
    from ray._raylet import AuthenticationTokenLoader

    if auth.AUTH_MODE_ENV_VAR in os.environ:
        return
    if local or AuthenticationTokenLoader.instance().has_token(ignore_auth_mode=True):
        auth._enable_token_auth()  # the variable, and Ray's cached config re-read (as Ray does)


def _loopback(address: str) -> bool:
    """Whether a cluster address (auto: the one Ray would join) is 127.0.0.1 or localhost."""
    if address == "auto":
        from ray._private.services import get_ray_address_from_environment

        try:
            address = get_ray_address_from_environment("auto", None) or ""
        except Exception:  # no cluster here: ray.init says so, in connect's one line
            return False
    # what Ray replaces (not 127.0.0.2 and the like: the tests' simulated nodes are reached there)
    return address.removeprefix("ray://").rpartition(":")[0] in ("127.0.0.1", "localhost", "::1")


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
    quiet = _NotMainThread()
    logging.getLogger("ray._private.worker").addFilter(quiet)
    try:
        if address is None:
            start_local(os.cpu_count() or 1, config.object_store_mib)
            return True
        _token_auth(local=False)
        try:
            with _single_machine() if _loopback(address) else contextlib.nullcontext():
                ray.init(address=address, logging_level=logging.WARNING, configure_logging=False)
        except (ConnectionError, RuntimeError, ValueError, ray.exceptions.RayError) as exc:
            # e.g. no cluster on this machine (auto), or a cluster that wants a token this process
            # lacks (RAY_AUTH_TOKEN_PATH)
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(f"engine.address={config.address}: cannot join a Ray cluster: "
                              f"{first}") from None
        return True
    finally:
        logging.getLogger("ray._private.worker").removeFilter(quiet)


# -- the pool --------------------------------------------------------------------------------------

# What every worker must agree on (a worker that differs would score another CRM): the checkpoint's
# kind, template and tokenizer, the dtype its device resolved, the device's kind.
AGREE = ("kind", "template", "max_tokens", "min_turn_tokens", "tokenizer_id", "dtype", "device_kind")


class WorkerPool:
    """The Ray actors, one CRMScorer each, and what the driver needs of the CRM (kind, template,
    tokenizer, length limit) from the first of them: the driver loads no model.

    Started in a thread (`wait=False`): `size()` waits for the number of workers (Ray up),
    `wait()` for the workers to hold their CRMs. Workers that die are restarted by Ray; the pool
    keeps which are down until they answer again, across tasks. `close()` stops them, and a Ray
    that `connect` started here.
    """

    def __init__(self, load: Callable[[str], Any], config: EngineConfig, wait: bool = True):
        import_ray()
        self.config, self.load = config, load
        self.actors: list = []
        self.workers: list[dict] = []
        self.down: set[int] = set()  # restarting: no block until they answer
        self.fresh: set[int] = set()  # no block answered since they (re)started: warming up
        self.probes: dict = {}  # ref -> worker: a restarting worker's describe() call
        self.address = self.gpus_per_worker = None
        self._owns_ray = False
        self._error: BaseException | None = None
        self._sized, self._ready = threading.Event(), threading.Event()
        self._closing, self._close = False, threading.Event()
        self.started_at = time.perf_counter()
        self.startup_seconds = None
        # Daemon: a command that exits without close() is not held by it (Ray's processes end
        # with the process, as after a ray.init that was never shut down).
        self._thread = threading.Thread(target=self._run, name="crm-ray", daemon=True)
        self._thread.start()
        if wait:
            self.wait()

    def _run(self) -> None:
        """The pool's life, in its own thread: Ray started (or joined), the workers asked for and
        waited for, then held until close() and stopped. The thread lives as long as Ray does:
        the processes a local start spawns die with the thread that spawned them (Ray sets their
        parent-death signal, which Linux ties to the spawning thread), so a thread that started
        Ray and returned would take Ray down with it."""
        import ray

        try:
            self._owns_ray = connect(self.config)
            self._create(ray)
            self._sized.set()
            self._describe(ray)
            self.startup_seconds = time.perf_counter() - self.started_at
        except BaseException as exc:  # the waiting driver raises it
            self._error = exc
        finally:
            self._sized.set()
            self._ready.set()
        if self._error is None:
            self._close.wait()
        self._stop()

    def _create(self, ray) -> None:
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
        self.device = "cuda" if gpus > 0 else "cpu"
        self.gpus_per_worker = gpus
        self.address = ray.get_runtime_context().gcs_address
        # max_task_retries=0: a dead worker's blocks come back as errors, which the driver counts
        # per block (Ray's own retries would redo a block that kills its worker forever).
        actor = ray.remote(num_cpus=config.cpus_per_worker, num_gpus=gpus, max_restarts=-1,
                           max_task_retries=0)(ScoringWorker)
        self.actors = [actor.remote(self.load, self.device, config.cpus_per_worker)
                       for _ in range(workers)]
        self.fresh = set(range(workers))

    def _describe(self, ray) -> None:
        refs = [a.describe.remote() for a in self.actors]
        while ray.wait(refs, num_returns=len(refs), timeout=0.2)[1]:
            if self._closing:  # closed while the workers load: stopped now, not once loaded
                raise _Closed
        try:
            infos = ray.get(refs)
        except ray.exceptions.RayError as exc:
            raise RuntimeError(f"engine: a worker could not load the CRM: {_cause(exc)}") from None
        first = infos[0]
        for w, info in enumerate(infos):
            self._agrees(w, info, first)
        self.kind = first["kind"]
        self.template = PromptTemplate(**first["template"])
        self.tokenizer = first["tokenizer"]
        self.encoder = PromptEncoder(self.tokenizer, self.template, first["max_tokens"],
                                     first["min_turn_tokens"])
        self.dtype = first["dtype"]
        self.crm = {k: _kind(first)[k] for k in AGREE}
        self.workers = [_public(info) for info in infos]

    @staticmethod
    def _agrees(w: int, info: dict, first: dict) -> None:
        mine, theirs = _kind(info), _kind(first)
        for key in AGREE:
            if mine[key] != theirs[key]:
                shown = (f"{mine[key]} where worker 0 has {theirs[key]}"
                         if key in ("dtype", "device_kind", "kind", "max_tokens") else "another")
                raise ConfigError(f"engine: worker {w} (node {info['node']}) loaded the CRM with "
                                  f"{key} {shown}: every worker must score with the same CRM "
                                  "(set dtype=, or give the job nodes of one kind)")

    # -- waiting for it ----------------------------------------------------------------------------

    def size(self) -> int:
        """The number of workers (waits until Ray is up and the actors are asked for)."""
        self._sized.wait()
        if self._error is not None:
            raise self._error
        return len(self.actors)

    def wait(self) -> None:
        """Every worker holds its CRM (or the start's error, raised here)."""
        self._ready.wait()
        if self._error is not None:
            raise self._error

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self._error is None

    # -- faults ------------------------------------------------------------------------------------

    def died(self, w: int) -> None:
        """Worker `w` died: Ray restarts it; it gets blocks again once it answers."""
        if w not in self.down:
            self.down.add(w)
            self.fresh.add(w)
            self.probes[self.actors[w].describe.remote()] = w

    def replace(self, w: int) -> None:
        """Worker `w` hangs: its process killed, for Ray to restart (its blocks fail)."""
        import ray

        ray.kill(self.actors[w], no_restart=False)
        self.died(w)

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
        for key in AGREE:
            if _kind(info)[key] != self.crm[key]:
                raise RuntimeError(f"engine: worker {w} came back on node {info['node']} with "
                                   f"{key} {_kind(info)[key]}, where the pool has {self.crm[key]}")
        self.workers[w] = _public(info)
        self.down.discard(w)

    def describe(self) -> dict:
        startup = None if self.startup_seconds is None else round(self.startup_seconds, 3)
        return {"engine": asdict(self.config), "address": self.address,
                "started_ray": self._owns_ray, "gpus_per_worker": self.gpus_per_worker,
                "blocks_in_flight": BLOCKS_IN_FLIGHT, "block_timeout": _timeout_rule(self.config),
                "loader": asdict(self.load) if is_dataclass(self.load) else repr(self.load),
                "startup_seconds": startup, "workers": self.workers}

    # -- stopping ----------------------------------------------------------------------------------

    def close(self, wait: bool = True) -> None:
        """The workers stopped; a Ray this pool started, shut down (by the pool's thread). A pool
        still starting stops once Ray's own start returns (it cannot be interrupted), a worker
        still loading included: with `wait`, after waiting for that; without, at once (the
        refusal that closes it is said now)."""
        self._closing = True
        self._close.set()
        if wait:
            self._thread.join()

    def join(self) -> None:
        """Its start, and a close it was asked for, over."""
        self._thread.join()

    def _stop(self) -> None:
        import ray

        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # Ray gone already
                pass
        self.actors = []
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
        self._owns_ray = False


class _Closed(Exception):
    """The pool was closed while it started."""


def _kind(info: dict) -> dict:
    return {**info, "device_kind": info["device"].split(":")[0]}


def _public(info: dict) -> dict:
    """A worker's record for engine.json: where it runs, not the CRM it holds."""
    return {k: v for k, v in info.items() if k not in ("tokenizer", "template", "tokenizer_id")}


def _timeout_rule(config: EngineConfig) -> str:
    if config.block_timeout != "auto":
        return f"{float(config.block_timeout):g} s"
    return (f"auto: {TIMEOUT_SLACK:g} x the slowest seconds per character measured, at least "
            f"{TIMEOUT_FLOOR:g} s; {TIMEOUT_WARMUP:g} s for a worker's first block")


# -- the driver ------------------------------------------------------------------------------------

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
        self.config = config or pool.config  # its block_prompts, block_attempts, block_timeout
        self.run_dir = None if run_dir is None else Path(run_dir)
        self.owns_pool = owns_pool
        self.counts = Counter()  # the workers' CRMScorer counts, summed over every block
        self.cpu_seconds = 0.0  # the workers' CPU time in the blocks, summed (skipped ones too)
        self.seconds_per_char: float | None = None  # the slowest measured (block_timeout=auto)
        self.tasks: list[dict] = []
        self.created = time.perf_counter()
        self._calls = 0
        self._lock = threading.Lock()

    @classmethod
    def start(cls, load: Callable[[str], Any], config: EngineConfig, *, identity: str,
              run_dir: str | Path | None = None, **kwargs) -> RayScorer:
        """A scorer that owns a pool of `config.workers` workers, each with `load(device)`'s
        CRMScorer; returned while Ray and the workers start (the first call waits for them)."""
        return cls(WorkerPool(load, config, wait=False), identity=identity, run_dir=run_dir,
                   owns_pool=True, **kwargs)

    # What the driver reads of the CRM: the first worker's (waits for the pool).

    @property
    def kind(self) -> str:
        self.pool.wait()
        return self.pool.kind

    @property
    def template(self) -> PromptTemplate:
        self.pool.wait()
        return self.pool.template

    @property
    def encoder(self) -> PromptEncoder:
        self.pool.wait()
        return self.pool.encoder

    @property
    def tokenizer(self):
        self.pool.wait()
        return self.pool.tokenizer

    @property
    def dtype(self) -> str:
        self.pool.wait()
        return self.pool.dtype

    # -- what the evaluation calls -----------------------------------------------------------------

    def pair_probabilities(self, examples: Sequence, unfit: str = "raise", both_orders: bool = False):
        """(n, 3) P(A), P(B), P(tie), as CRMScorer.pair_probabilities computes them."""
        import torch

        examples = list(examples)
        lengths = [_chars(e.query, e.conv_a, e.conv_b) for e in examples]  # as pair_blocks
        driver = {"rows": _digest("pairs", [(e.query, e.conv_a, e.conv_b) for e in examples]),
                  "criteria": _digest([e.criteria for e in examples]),
                  "scoring": f"pairs, unfit={unfit}, both_orders={both_orders}"}
        results = self._run(
            "pairs", driver, [(e.criteria, e.query) for e in examples], lengths,
            [e.key for e in examples], unfit, None,
            lambda rows: (rows, [examples[i] for i in rows], unfit, both_orders))
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
        driver = {"rows": _digest("groups", [(q, completions) for _, q, completions in groups]),
                  "criteria": _digest([c for c, _, _ in groups]), "scoring": "groups"}
        names = list(names) if names is not None else [str(i) for i in range(len(groups))]
        sizes = [len(completions) for _, _, completions in groups]
        results = self._run(
            "groups", driver, range(len(groups)),
            [_chars(query, completions) for _, query, completions in groups], names, "nan",
            sizes, lambda rows: (rows, [groups[i] for i in rows], sequences_per_call))
        scores: list = [None] * len(groups)
        fits = [False] * len(groups)
        forwards = 0
        for rows, result in results:
            values, start = result["values"].tolist(), 0
            for i, n, ok in zip(rows, result["lengths"].tolist(), result["fits"].tolist(),
                                strict=True):
                scores[i], fits[i] = values[start:start + n], ok
                start += n
            forwards += result["counts"].get("forwards", 0)
        return scores, fits, forwards

    # -- the blocks --------------------------------------------------------------------------------

    def _run(self, op, driver, group_keys, lengths, names, unfit, sizes, arguments):
        with self._lock:
            return self._run_locked(op, driver, group_keys, lengths, names, unfit, sizes, arguments)

    def _run_locked(self, op, driver, group_keys, lengths, names, unfit, sizes, arguments):
        self._calls += 1
        task = f"{self._calls:03d}-{op}"
        started = time.perf_counter()
        fingerprint = {**driver, "checkpoint": self.identity,
                       "cut": f"{PLAN}, block_prompts={self.config.block_prompts}"}
        store = BlockStore(None if self.run_dir is None else self.run_dir / "blocks" / task)
        store.check(fingerprint, DRIVER_FIELDS)  # before waiting for Ray: refused at once
        blocks = store.planned(len(names))
        if blocks is None:
            blocks = plan_blocks(group_keys, self.config.block_prompts, lengths,
                                 min_blocks=BLOCKS_PER_WORKER * self.pool.size())
        self.pool.wait()
        crm = self.pool.crm
        fingerprint.update(tokenizer=crm["tokenizer_id"], dtype=crm["dtype"],
                           device=crm["device_kind"],
                           template=_digest(crm["template"], crm["max_tokens"], crm["min_turn_tokens"]))
        store.check(fingerprint, WORKER_FIELDS)
        rows_total = sum(len(b) for b in blocks)
        store.write_plan({"task": task, "op": op, "rows": rows_total,
                          "block_prompts": self.config.block_prompts, "fingerprint": fingerprint,
                          "blocks": [len(b) for b in blocks], "block_rows": blocks})
        results: dict[int, dict] = {}
        for b, rows in enumerate(blocks):
            found = store.load(b, rows)
            if found is not None:
                results[b] = found
        skipped = len(results)
        if skipped:
            log.info("%s: %d of %d blocks already finished in %s: skipped", task, skipped,
                     len(blocks), store.dir)
        from tqdm.auto import tqdm

        sizes_of = (lambda rows: [sizes[i] for i in rows]) if sizes is not None else (lambda rows: None)
        run = _BlockRun(self, op, task, blocks, names, arguments, store, results,
                        chars=[sum(lengths[i] for i in rows) for rows in blocks],
                        check=lambda b, result: check_reply(op, blocks[b], sizes_of(blocks[b]),
                                                            unfit, result))
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
                           "skipped": skipped, "retried": len(run.retries),
                           "retries": run.retries, "seconds": round(time.perf_counter() - started, 3),
                           "first_block_seconds": run.first_block})
        log.info("%s: %d rows in %d blocks on %d workers, %.1f s (%d skipped, %d redone)", task,
                 rows_total, len(blocks), len(self.pool.actors), self.tasks[-1]["seconds"],
                 skipped, len(run.retries))
        self._record()
        return [(blocks[b], results[b]) for b in range(len(blocks))]

    @staticmethod
    def _gather_check(task: str, blocks: list[list[int]], results: dict) -> None:
        """Every row of the plan exactly once, as the workers named them: a row missing or twice
        is a bug, never a score."""
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
        """The pool stopped, where this scorer started it; a start still under way is not
        waited for (the pool's thread stops what it started)."""
        if self.owns_pool:
            self.pool.close(wait=self.pool._ready.is_set())


class _BlockRun:
    """One task's blocks streamed to the pool's workers, at most BLOCKS_IN_FLIGHT per worker, each
    reply checked and stored as it arrives.

    A block fails when its worker dies, when it runs past its timeout (the worker is replaced) or
    when its reply is wrong. A failure counts against the block (towards `block_attempts`) where
    the block is known to be the culprit: a death counts only where it was its worker's one
    unanswered block; a death with more leaves the culprit unknown, so none is counted. A failed
    block is redone alone (first, and on a worker holding nothing else), on a worker it has not
    failed on (on a node it has not failed on, where one is up), so that a bad device or node does
    not use up an innocent block's attempts."""

    def __init__(self, scorer: RayScorer, op, task, blocks, names, arguments, store, results,
                 chars=None, check=None):
        import ray

        self.ray, self.scorer, self.pool, self.op, self.task = ray, scorer, scorer.pool, op, task
        self.blocks, self.names, self.arguments = blocks, names, arguments
        self.store, self.results = store, results
        self.chars = chars or [len(b) for b in blocks]
        self.check = check or (lambda b, result: None)
        self.config = scorer.config
        self.in_flight: dict = {}  # ref -> (block, worker)
        self.given = {w: [] for w in range(len(self.pool.actors))}  # each worker's, oldest first
        self.deadline: dict[int, tuple] = {}  # worker -> (when, seconds): its oldest block's timeout
        self.alone: deque = deque()  # blocks to redo alone, after a failure
        self.alone_given: set = set()  # those of them a worker holds now
        self.failures: dict[int, list] = {}  # block -> [(worker, node_id, what)] counted
        self.waiting: dict[int, float] = {}  # block -> since when it waits for a restarting worker
        self.retries: list[dict] = []  # every block redone: engine.json's record
        self.first_block: float | None = None

    def until_done(self, pending: list[int]) -> None:
        ray, pool = self.ray, self.pool
        self.queue = deque(pending)
        while self.queue or self.alone or self.in_flight:
            self._give()
            wait = min([*(when for when, _ in self.deadline.values()),
                        *(since + RESTART_WAIT for since in self.waiting.values())], default=None)
            ready, _ = ray.wait([*self.in_flight, *pool.probes], num_returns=1,
                                timeout=None if wait is None else max(wait - time.perf_counter(), 0))
            if not ready:
                self._expire()
                continue
            ref = ready[0]
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
            self._answered(b, w, result)

    # -- giving blocks -----------------------------------------------------------------------------

    def _give(self) -> None:
        """Blocks to redo first, each alone on an empty worker it may run on; then each worker's
        first block before any worker's second, so that every worker is busy from the start. No
        second block while a block to redo waits: the worker it waits for soon empties."""
        for b in list(self.alone):
            w = self._empty_worker_for(b)
            if w is not None:
                self.alone.remove(b)
                self.alone_given.add(b)
                self._send(b, w)
        for depth in range(BLOCKS_IN_FLIGHT):
            if depth and self.alone:
                return
            for w in range(len(self.pool.actors)):
                held = self.given[w]
                if w in self.pool.down or len(held) != depth or self.alone_given.intersection(held):
                    continue
                if not self.queue:
                    return
                self._send(self.queue.popleft(), w)

    def _empty_worker_for(self, b: int) -> int | None:
        """An up worker holding nothing on which block `b` may be redone: one it has not failed
        on, on a node it has not failed on where such a worker is up. Where the workers it has
        not failed on are all restarting, it waits for them up to RESTART_WAIT seconds (a worker
        whose node is gone may never come back), then takes any; where it has failed on every
        worker of the pool, any."""
        pool = self.pool
        up = [w for w in range(len(pool.actors)) if w not in pool.down]
        failed = self.failures.get(b, [])
        workers = {w for w, _, _ in failed}
        nodes = {node for _, node, _ in failed}
        others = [w for w in range(len(pool.actors)) if w not in workers]
        candidates = [w for w in others if w in up]
        if others and not candidates:
            since = self.waiting.setdefault(b, time.perf_counter())
            if time.perf_counter() - since < RESTART_WAIT:
                return None
        candidates = candidates or up
        elsewhere = [w for w in candidates if self._node(w) not in nodes]
        for w in elsewhere or candidates:
            if not self.given[w]:
                self.waiting.pop(b, None)
                return w
        return None

    def _node(self, w: int):
        return self.pool.workers[w].get("node_id") if w < len(self.pool.workers) else None

    def _send(self, b: int, w: int) -> None:
        ref = getattr(self.pool.actors[w], self.op).remote(*self.arguments(self.blocks[b]))
        self.in_flight[ref] = (b, w)
        self.given[w].append(b)
        if len(self.given[w]) == 1:
            self._started(w)

    def _started(self, w: int) -> None:
        """Worker `w`'s oldest block is the one it runs now: its clock starts."""
        seconds = self._timeout(self.given[w][0], w)
        self.deadline[w] = (time.perf_counter() + seconds, seconds)

    def _timeout(self, b: int, w: int) -> float:
        if self.config.block_timeout != "auto":
            return float(self.config.block_timeout)
        rate = self.scorer.seconds_per_char
        if rate is None or w in self.pool.fresh:
            return TIMEOUT_WARMUP
        return max(TIMEOUT_FLOOR, TIMEOUT_SLACK * rate * self.chars[b])

    def _done_with(self, b: int, w: int) -> None:
        self.given[w].remove(b)
        self.alone_given.discard(b)
        self.deadline.pop(w, None)
        if self.given[w]:
            self._started(w)

    # -- replies -----------------------------------------------------------------------------------

    def _answered(self, b: int, w: int, result: dict) -> None:
        problem = self.check(b, result)
        self._done_with(b, w)
        if problem is not None:
            log.warning("%s: worker %d answered block %d wrongly (%s): redone elsewhere",
                        self.task, w, b, problem)
            self._failed(b, w, "reply", problem, counted=True)
            return
        result["worker"] = np.int64(w)  # where it was scored (engine.json names the failed ones)
        if w in self.pool.fresh:
            self.pool.fresh.discard(w)  # warmed up: its next blocks are measured
        elif self.chars[b] > 0:
            rate = float(result["seconds"]) / self.chars[b]
            self.scorer.seconds_per_char = max(self.scorer.seconds_per_char or 0.0, rate)
        self._store(b, result)

    def _store(self, b: int, result: dict) -> None:
        self.store.save(b, result)
        self.results[b] = result
        if self.first_block is None:
            self.first_block = round(time.perf_counter() - self.scorer.created, 3)
        self.bar.update(1)
        if self.scorer.on_block is not None:
            self.scorer.on_block(self.task, b)

    # -- failures ----------------------------------------------------------------------------------

    def _expire(self) -> None:
        """Workers whose running block is past its timeout: replaced, the block redone elsewhere
        (counted: it was the one running), the blocks queued behind it put back unblamed."""
        now = time.perf_counter()
        for w, (deadline, seconds) in list(self.deadline.items()):
            if deadline > now:
                continue
            held = self.given[w]
            b, behind = held[0], held[1:]
            for ref in [r for r, (_, ow) in self.in_flight.items() if ow == w]:
                del self.in_flight[ref]
            self.given[w] = []
            del self.deadline[w]
            self.alone_given.difference_update(held)
            log.warning("%s: worker %d held block %d past its %g s: replaced, the block redone "
                        "elsewhere", self.task, w, b, seconds)
            for other in behind:
                self._record(other, w, "replaced", "queued behind a block that timed out",
                             counted=False)
            self.pool.replace(w)
            self.queue.extendleft(reversed(behind))
            self._failed(b, w, "timeout", f"no reply within {seconds:g} s", counted=True)

    def _worker_died(self, w: int, b: int, exc) -> None:
        ray = self.ray
        others = [ref for ref, (_, ow) in self.in_flight.items() if ow == w]
        if others:  # a dead worker's other blocks fail within moments; a finished one is kept
            ray.wait(others, num_returns=len(others), timeout=60)
        failed = [b]
        for ref in others:
            ob, _ = self.in_flight.pop(ref)
            try:
                result = ray.get(ref, timeout=0)
            except ray.exceptions.RayTaskError as error:
                raise _cause(error) from None
            except (ray.exceptions.RayError, TimeoutError):
                failed.append(ob)
                continue
            self._answered(ob, w, result)
        failed.sort(key=self.given[w].index)
        self.given[w] = []
        self.deadline.pop(w, None)
        self.alone_given.difference_update(failed)
        what = f"its worker died ({type(exc).__name__})"
        self.pool.died(w)
        if len(failed) > 1:
            log.warning("%s: worker %d died holding blocks %s (%s): each redone alone", self.task,
                        w, ", ".join(map(str, failed)), type(exc).__name__)
            for fb in failed:
                self._record(fb, w, "died", what + ", beside another block", counted=False)
            self.alone.extendleft(reversed(failed))
            return
        log.warning("%s: worker %d died in block %d (%s): redone", self.task, w, b,
                    type(exc).__name__)
        self._failed(b, w, "died", what, counted=True)

    def _record(self, b: int, w: int, reason: str, detail: str, counted: bool) -> None:
        info = self.pool.workers[w] if w < len(self.pool.workers) else {}
        self.retries.append({"block": b, "worker": w, "node": info.get("node"),
                             "node_id": info.get("node_id"), "pid": info.get("pid"),
                             "reason": reason, "detail": detail, "counted": counted})

    def _failed(self, b: int, w: int, reason: str, detail: str, counted: bool) -> None:
        """Block `b` failed on worker `w`: recorded, counted, redone alone elsewhere or, at
        `block_attempts`, the job stopped naming its rows."""
        self._record(b, w, reason, detail, counted)
        if counted:
            node = self.pool.workers[w].get("node") if w < len(self.pool.workers) else None
            self.failures.setdefault(b, []).append((w, self._node(w), f"worker {w} at {node}: {detail}"))
            if len(self.failures[b]) >= self.config.block_attempts:
                self._stop(b)
        self.alone.appendleft(b)

    def _stop(self, b: int) -> None:
        rows = [self.names[i] for i in self.blocks[b]]
        failures = self.failures[b]
        listed = ""
        if self.store.dir is not None:  # every row, where a one-line message has no room
            path = write_json(self.store.dir / f"failed-{b:06d}.json",
                              {"block": b, "failures": [what for _, _, what in failures],
                               "rows": rows})
            listed = f"; the rows: {path}"
        raise BlockFailed(
            f"{self.task}: block {b} ({len(rows)} rows: {', '.join(rows[:NAMED_ROWS])}"
            f"{f' and {len(rows) - NAMED_ROWS} more' if len(rows) > NAMED_ROWS else ''}) "
            f"failed {len(failures)} times ({'; '.join(what for _, _, what in failures)}); "
            f"its rows are not scored, the job stops{listed}")

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
