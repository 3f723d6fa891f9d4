"""engine=ray (crm/inference/engine.py): the rows of crm-eval, a benchmark and crm-leaderboard
scored in blocks by Ray workers equal engine=local's; a worker SIGKILLed mid-job is replaced and its
blocks redone; a block that hangs is timed out and redone on another worker; a wrong reply is the
block's failure; a driver killed or interrupted between a block's temporary file and its rename
resumes without it; each row lands once; bad settings, a run dir of another scoring and a block
that keeps failing stop in one line.

One local Ray for the module, started as the engine starts one (`start_local`: 127.0.0.1 only, 6
logical CPUs, a 100 MB object store), shut down at its end, and one pool of 2 workers for the tests
that drive RayScorer directly (a pool's start is most of a test's time): its workers' scorers sleep
in a block holding a row keyed `slow:...` (so that a kill lands mid-block), SIGKILL their process in
one holding `die:...`, and, once per module, hang in one holding `hang:...` and answer NaN in one
holding `nan:...`. The 2-node cluster of launch/score.sbatch is tests/launch/test_score_cluster.py's.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import free_port
from scorers import export_tiny, run_cli

from crm.core.errors import ConfigError
from crm.evaluation.leaderboard import pairs, select
from crm.inference.engine import (BLOCKS_IN_FLIGHT, DRIVER_FIELDS, FAULT_ENV, WORKER_FIELDS,
                                  BlockFailed, BlockStore, EngineConfig, RayScorer, ScorerLoader,
                                  WorkerPool, _BlockRun, check_reply, checkpoint_identity,
                                  pair_blocks, plan_blocks, start_local)

ray = pytest.importorskip("ray", reason="engine=ray needs ray (pip install -e '.[ray]')")

# Not both_cores (tests/conftest.py): Ray's processes keep about one core busy here, its workers
# mostly waiting on the driver, a kill or a timeout; holding both would idle the other.
TESTS = Path(__file__).resolve().parents[1]
TWO_WORKERS = EngineConfig(name="ray", workers=2, block_prompts=1, block_attempts=3)
CPUS = 6  # logical: the module's pool (2), a test's own pool and a crm-leaderboard's (1 each)


def stderr_of(function) -> str:
    """What `function()` wrote to stderr: sys.stderr (where Ray's log handler writes, pytest's
    capture included) and file descriptor 2."""
    with tempfile.TemporaryFile() as err, contextlib.redirect_stderr(io.StringIO()) as text:
        sys.__stderr__.flush()
        saved = os.dup(2)
        os.dup2(err.fileno(), 2)
        try:
            function()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        err.seek(0)
        return text.getvalue() + err.read().decode(errors="replace")


@pytest.fixture(scope="module")
def local_ray():
    """One small local Ray for the module, started as engine=ray starts one; what it wrote to
    stderr as it started. Its workers import this module (a test's loader is pickled by reference), so they
    get the tests' folders on PYTHONPATH."""
    path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(TESTS), str(TESTS / "inference"), *([path] if path else [])])
    said = stderr_of(lambda: start_local(CPUS, 100, log_to_driver=False))
    try:
        yield said
    finally:
        ray.shutdown()
        if path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = path


@pytest.fixture(scope="module")
def pairwise_export(tmp_path_factory):
    return export_tiny(tmp_path_factory.mktemp("ray_engine") / "export")


def demo_files(root: Path) -> tuple[list[str], Path]:
    raw = root / ".cache" / "demo" / "raw"
    return sorted(str(p) for p in (raw / "test").glob("*.jsonl")), raw / "bench.jsonl"


def board_examples(bench: Path):
    selection = select(bench, "baseline")
    return [e for _, _, e in pairs(selection, ["I prefer short, to-the-point answers."])]


@dataclass(frozen=True)
class Faulty:
    """A worker's loader whose scorer sleeps `seconds` in a block holding a `slow:` row and
    SIGKILLs its own process in one holding a `die:` row; the first block of all the pool's
    workers holding a `hang:` row hangs, the first holding a `nan:` row answers NaN there (a mark
    file in `marks` says it happened). With `gate`, the CRM loads once that file exists (or a
    minute has passed: a test that waits for the load fails rather than hangs)."""

    export: str
    seconds: float = 1.0
    marks: str | None = None
    gate: str | None = None

    def __call__(self, device):
        opens = time.time() + 60
        while self.gate and not os.path.exists(self.gate) and time.time() < opens:
            time.sleep(0.05)
        scorer = ScorerLoader(self.export)(device)
        score = scorer.pair_probabilities

        def pair_probabilities(examples, **kwargs):
            if any(e.key.startswith("die:") for e in examples):
                os.kill(os.getpid(), signal.SIGKILL)
            if any(e.key.startswith("slow:") for e in examples):
                time.sleep(self.seconds)
            if any(e.key.startswith("hang:") for e in examples) and self._first("hang"):
                time.sleep(120)  # past any block_timeout a test sets; a test without one fails
            probs = score(examples, **kwargs)
            if any(e.key.startswith("nan:") for e in examples) and self._first("nan"):
                probs[[e.key.startswith("nan:") for e in examples]] = float("nan")
            return probs

        scorer.pair_probabilities = pair_probabilities
        return scorer

    def _first(self, what: str) -> bool:
        try:
            os.close(os.open(os.path.join(self.marks, what), os.O_CREAT | os.O_EXCL))
            return True
        except FileExistsError:
            return False


@pytest.fixture(scope="module")
def pool(local_ray, pairwise_export, tmp_path_factory):
    marks = tmp_path_factory.mktemp("faults")
    pool = WorkerPool(Faulty(str(pairwise_export), marks=str(marks)), TWO_WORKERS)
    try:
        yield pool
    finally:
        pool.close()


def ray_scorer(pool: WorkerPool, export: Path, run_dir: Path | None, **kwargs) -> RayScorer:
    return RayScorer(pool, identity=checkpoint_identity(export), run_dir=run_dir, **kwargs)


def marked(examples, mark: str, which=lambda i: True) -> list:
    return [replace(e, key=f"{mark}:{e.key}") if which(i) else e for i, e in enumerate(examples)]


# -- the plan --------------------------------------------------------------------------------------

def test_a_block_holds_whole_prompt_groups_in_first_seen_order():
    keys = ["q1", "q2", "q1", "q3", "q2", "q4", "q5"]
    assert plan_blocks(keys, 2) == [[0, 2, 1, 4], [3, 5], [6]]
    blocks = plan_blocks(keys, 1)
    assert sorted(i for b in blocks for i in b) == list(range(len(keys)))
    assert all(len({keys[i] for i in b}) == 1 for b in blocks)
    # With row lengths: groups of longer rows first, so a block's rows are of like length.
    lengths = [10, 50, 10, 5, 70, 20, 20]  # q1: 10, q2: 60 on average, q3: 5, q4: 20, q5: 20
    assert plan_blocks(keys, 2, lengths) == [[1, 4, 5], [6, 0, 2], [3]]


def test_every_worker_gets_two_blocks_where_the_groups_allow():
    """A 480-row board (60 queries x 8 models) at the default 64 prompt groups per block went to
    2 workers as one block; now each worker gets two."""
    keys = [f"q{q}" for q in range(60) for _ in range(8)]
    assert len(plan_blocks(keys, 64)) == 1
    blocks = plan_blocks(keys, 64, min_blocks=2 * 2)
    assert len(blocks) == 4 and sorted(i for b in blocks for i in b) == list(range(480))
    assert len(plan_blocks(keys[:16], 64, min_blocks=4)) == 2  # 2 groups: no more blocks than that
    assert len(plan_blocks(keys, 8, min_blocks=4)) == 8  # block_prompts stays the most per block


class _Actor:
    """Stands for a worker's actor handle: `pairs.remote(block)` returns a reference."""

    def __init__(self):
        self.pairs = self

    def remote(self, *block):
        return object()


def block_run(workers: int, nodes: list[str] | None = None, blocks: int = 8) -> _BlockRun:
    """A _BlockRun over stand-in workers (`nodes`: each one's node), to test where blocks go."""
    nodes = nodes or ["n0"] * workers
    pool = SimpleNamespace(actors=[_Actor() for _ in range(workers)], down=set(), fresh=set(),
                           workers=[{"node": n, "node_id": n, "pid": i} for i, n in enumerate(nodes)])
    scorer = SimpleNamespace(pool=pool, config=TWO_WORKERS, seconds_per_char=None)
    run = _BlockRun(scorer, "pairs", "001-pairs", [[i] for i in range(blocks)], [],
                    lambda rows: tuple(rows), None, {})
    run.queue = deque(range(blocks))
    return run


def test_each_worker_gets_a_first_block_before_any_a_second_and_a_block_to_redo_runs_alone():
    run = block_run(2)
    run._give()
    assert BLOCKS_IN_FLIGHT == 2 and run.given == {0: [0, 2], 1: [1, 3]}
    # Worker 0 died holding 0 and 2 (neither counted); worker 1 finished block 1.
    run.given[0], run.given[1] = [], [3]
    run.alone.extend([0, 2])
    run._give()  # 0 to the empty worker, alone; no second block anywhere while 2 waits
    assert run.given == {0: [0], 1: [3]} and list(run.alone) == [2]
    run.given[1] = []  # block 3 done: worker 1 is empty
    run._give()  # 2 alone on worker 1; no block waits alone any more, but both hold one
    assert run.given == {0: [0], 1: [2]} and not run.alone
    run.alone_given.discard(0)
    run.given[0] = []  # block 0 done: worker 0 takes two of the queue again
    run._give()
    assert run.given == {0: [4, 5], 1: [2]}


def test_a_failed_block_is_redone_on_another_worker_on_another_node():
    run = block_run(3, nodes=["a", "a", "b"])
    run.queue.clear()
    run.given = {0: [], 1: [], 2: [7]}  # worker 2, the other node's, is busy
    run.failures[0] = [(0, "a", "worker 0 at a: its worker died")]
    run.alone.append(0)
    run._give()  # worker 1 is empty but on the node the block failed on: it waits for worker 2
    assert run.given == {0: [], 1: [], 2: [7]} and list(run.alone) == [0]
    run.given[2] = []
    run._give()
    assert run.given[2] == [0]
    # One node: another worker of it, though the one it failed on is empty first.
    run = block_run(2)
    run.queue.clear()
    run.failures[0] = [(0, "n0", "worker 0 at n0: no reply within 4 s")]
    run.alone.append(0)
    run._give()
    assert run.given == {0: [], 1: [0]}
    # Failed on every worker up: any of them, rather than waiting for ever.
    run = block_run(2)
    run.queue.clear()
    run.failures[0] = [(0, "n0", "x"), (1, "n0", "y")]
    run.alone.append(0)
    run.pool.down.add(1)
    run._give()
    assert run.given == {0: [0], 1: []}


# -- what a worker's reply must be -----------------------------------------------------------------

def test_a_reply_that_does_not_match_its_block_is_named():
    nan = float("nan")
    pairs = {"rows": [4, 5], "values": [[0.2, 0.8, 0.0], [0.6, 0.4, 0.0]], "scorable": [True, True]}
    assert check_reply("pairs", [4, 5], None, "nan", pairs) is None
    assert "rows are not the block's" in check_reply("pairs", [4, 6], None, "nan", pairs)
    short = {**pairs, "values": [[0.2, 0.8, 0.0]]}
    assert check_reply("pairs", [4, 5], None, "nan", short) == "1 values for 2 rows"
    unfit = {**pairs, "values": [[nan] * 3, [0.6, 0.4, 0.0]], "scorable": [False, True]}
    assert check_reply("pairs", [4, 5], None, "nan", unfit) is None  # a row that cannot fit
    assert "NaN values where unfit=raise" in check_reply("pairs", [4, 5], None, "raise", unfit)
    model_nan = {**unfit, "scorable": [True, True]}
    assert "1 NaN values where the prompts fit" in check_reply("pairs", [4, 5], None, "nan", model_nan)
    # Groups: a short lengths array would be truncated by a zip; it is the block's failure.
    groups = {"rows": [0, 1], "values": [0.1, 0.9, 0.5, 0.5], "lengths": [2, 2],
              "fits": [True, True], "scorable": [True] * 4}
    assert check_reply("groups", [0, 1], [2, 2], "nan", groups) is None
    assert "1 groups of 2 completions for 2 groups of 4" in check_reply(
        "groups", [0, 1], [2, 2], "nan", {**groups, "lengths": [2], "values": [0.1, 0.9]})
    assert "3 values for 4 completions" in check_reply(
        "groups", [0, 1], [2, 2], "nan", {**groups, "values": [0.1, 0.9, 0.5]})


# -- what a block's scores depend on ---------------------------------------------------------------

FINGERPRINT = {"rows": "r1", "criteria": "c1", "checkpoint": "k1", "scoring": "pairs, unfit=nan",
               "cut": "groups-by-length, block_prompts=8", "tokenizer": "t1", "template": "p1",
               "dtype": "float32", "device": "cpu"}


@pytest.mark.parametrize("field", [*DRIVER_FIELDS, *WORKER_FIELDS])
def test_a_rerun_with_any_field_changed_is_refused_naming_it(field, tmp_path):
    task = tmp_path / "blocks" / "001-pairs"
    task.mkdir(parents=True)
    (task / "plan.json").write_text(json.dumps({"fingerprint": FINGERPRINT}))
    store = BlockStore(task)
    store.check(FINGERPRINT, [*DRIVER_FIELDS, *WORKER_FIELDS])  # the same: resumed
    changed = {**FINGERPRINT, field: {"dtype": "bfloat16", "device": "cuda"}.get(field, "other")}
    with pytest.raises(ConfigError, match=f"finished blocks of another scoring \\((their )?{field}"):
        store.check(changed, [*DRIVER_FIELDS, *WORKER_FIELDS])
    if field == "dtype":  # short values are shown
        with pytest.raises(ConfigError, match="dtype: float32 there, bfloat16 now"):
            store.check(changed, WORKER_FIELDS)


# -- equal to engine=local -------------------------------------------------------------------------

@pytest.fixture
def cli_on_pool(pool, monkeypatch):
    """crm-eval and crm-leaderboard with engine=ray score on the module's pool (its start is most
    of a test's time) rather than starting their own: what they ask `RayScorer.start` for is
    recorded, and must be the pool's CRM."""
    asked = []

    def start(load, config, *, identity, run_dir=None, **kwargs):
        asked.append((load, config))
        return RayScorer(pool, identity=identity, run_dir=run_dir, config=config, **kwargs)

    monkeypatch.setattr(RayScorer, "start", staticmethod(start))
    return asked


def test_crm_eval_on_a_test_file_and_a_benchmark_equals_engine_local(cli_on_pool, pairwise_export,
                                                                     demo_root, tmp_path,
                                                                     monkeypatch):
    import crm.cli.eval
    from crm.cli.eval import evaluate

    read = crm.cli.eval.load_benchmark
    started_before_reading = []
    monkeypatch.setattr(crm.cli.eval, "load_benchmark", lambda *args: (
        started_before_reading.append(len(cli_on_pool)), read(*args))[1])
    tests = demo_files(demo_root)[0][:1]
    common = [f"checkpoint={pairwise_export}", f"data.test=[{','.join(tests)}]", "benchmark=pairs",
              f"benchmark.path={tests[0]}", 'criteria=["I prefer short answers."]', "progress=false"]
    local = run_cli("eval", evaluate, common, tmp_path / "local")
    spread = run_cli("eval", evaluate, [*common, "engine=ray", "engine.workers=2",
                                        "engine.block_prompts=8"], tmp_path / "ray")
    (load, config), = cli_on_pool
    assert load == ScorerLoader(str(pairwise_export), 32) and config.block_prompts == 8
    assert started_before_reading == [0, 1]  # local: read, then load; ray: Ray starts, then read
    for path in tests:  # every figure equal
        assert spread["files"][path] == local["files"][path]
    assert {k: v for k, v in spread["benchmark"].items() if k != "forwards"} == \
        {k: v for k, v in local["benchmark"].items() if k != "forwards"}
    for name in ("predictions.jsonl", "scores.jsonl"):
        left = [json.loads(line) for line in (tmp_path / "local" / name).read_text().splitlines()]
        right = [json.loads(line) for line in (tmp_path / "ray" / name).read_text().splitlines()]
        assert len(left) == len(right) > 0
        for a, b in zip(left, right):
            for key in ("p_given", "p_swapped", "score"):
                if key in a and a[key] is not None:
                    assert torch.allclose(torch.tensor(a[key]), torch.tensor(b[key]), atol=1e-5)
                    a[key] = b[key]
            assert a == b
    engine = json.loads((tmp_path / "ray" / "engine.json").read_text())
    assert engine["engine"]["name"] == "ray" and len(engine["workers"]) == 2
    assert engine["blocks_in_flight"] == 2
    assert [t["op"] for t in engine["tasks"]] == ["pairs", "pairs", "groups"]
    assert all(t["skipped"] == 0 and t["retried"] == 0 for t in engine["tasks"])
    plan = json.loads((tmp_path / "ray" / "blocks" / "001-pairs" / "plan.json").read_text())
    assert sum(plan["blocks"]) == plan["rows"] == local["files"][tests[0]]["n"]
    assert len(plan["blocks"]) > 1


def test_crm_leaderboard_equals_engine_local(cli_on_pool, pairwise_export, demo_root, tmp_path):
    from crm.cli.leaderboard import run

    _, bench = demo_files(demo_root)
    common = [f"checkpoint={pairwise_export}", f"bench={bench}", "baseline=baseline",
              "progress=false", "both_orders=true",
              'criteria=["I prefer short, to-the-point answers."]']
    local = run_cli("leaderboard", run, common, tmp_path / "local")
    spread = run_cli("leaderboard", run, [*common, "engine=ray", "engine.workers=2",
                                          "engine.block_prompts=1"], tmp_path / "ray")
    for key in ("boards", "examples", "models"):
        assert spread[key] == local[key], key
    # the same sequences, prefixes and real tokens; padding differs with the batches' make-up
    assert {k: v for k, v in spread["sequences"].items() if k != "padded_tokens"} == \
        {k: v for k, v in local["sequences"].items() if k != "padded_tokens"}
    # The slot-bias sample in both orders (crm.evaluation.slot_bias), then the board's pairs in
    # both orders (slot_bias.judge_both_orders): a block per query.
    tasks = json.loads((tmp_path / "ray" / "engine.json").read_text())["tasks"]
    assert [t["op"] for t in tasks] == ["pairs"] * 4
    slot, board = tasks[:2], tasks[2:]
    assert slot[0]["rows"] == slot[1]["rows"] > 0
    assert board[0]["blocks"] == board[1]["blocks"] == local["examples"]["used"]


# -- faults ------------------------------------------------------------------------------------------

def test_a_worker_killed_mid_job_is_replaced_and_each_row_lands_once(pool, pairwise_export,
                                                                     demo_root, tmp_path, caplog):
    from crm.inference.scorer import CRMScorer

    examples = board_examples(demo_files(demo_root)[1])
    second = set(pair_blocks(examples, 1)[1])  # block 1, worker 1's first: slow
    examples = marked(examples, "slow", lambda i: i in second)
    expected = CRMScorer.load(pairwise_export).pair_probabilities(examples, both_orders=True)
    killed = []

    def kill_one_worker(task, block):
        if not killed:  # after block 0: worker 1 is inside block 1, block 3 queued behind it
            killed.append(pool.workers[1]["pid"])
            os.kill(killed[0], signal.SIGKILL)

    scorer = ray_scorer(pool, pairwise_export, tmp_path / "run", on_block=kill_one_worker)
    with caplog.at_level("WARNING", logger="crm.inference.engine"):
        got = scorer.pair_probabilities(examples, both_orders=True)
    # Two blocks unanswered: which one killed the worker is unknown, so neither is counted and
    # each is redone alone.
    assert scorer.tasks[0]["retried"] == 2
    said = [r.getMessage() for r in caplog.records if r.name == "crm.inference.engine"]
    (died,) = [m for m in said if "died" in m]  # Ray's error type depends on when it noticed
    assert re.fullmatch(r"001-pairs: worker 1 died holding blocks 1, 3 \(\w+\): each redone alone",
                        died), said
    assert torch.allclose(got, expected, atol=1e-5) and not got.isnan().any()
    blocks = sorted((tmp_path / "run" / "blocks" / "001-pairs").glob("*.npz"))
    rows = [i for b in blocks for i in np.load(b, allow_pickle=False)["rows"].tolist()]
    assert sorted(rows) == list(range(len(examples)))  # each row once
    # Ray restarted the killed worker: the pool takes it back once it answers
    deadline = __import__("time").time() + 120
    while 1 in pool.down and __import__("time").time() < deadline:
        pool.probed(ray.wait(list(pool.probes), num_returns=1)[0][0])
    assert 1 not in pool.down and pool.workers[1]["pid"] != killed[0]


def wait_until_back(pool: WorkerPool) -> None:
    """Every worker Ray restarted answers again (a later test counts on both)."""
    deadline = time.time() + 120
    while pool.down and time.time() < deadline:
        pool.probed(ray.wait(list(pool.probes), num_returns=1)[0][0])
    assert not pool.down


def stored_rows(task: Path) -> list[int]:
    return sorted(i for b in task.glob("*.npz") for i in np.load(b, allow_pickle=False)["rows"].tolist())


def test_a_block_that_hangs_is_timed_out_and_redone_on_another_worker(pool, pairwise_export,
                                                                      demo_root, tmp_path):
    from crm.inference.scorer import CRMScorer

    examples = board_examples(demo_files(demo_root)[1])
    hung = pair_blocks(examples, 1)[2]  # block 2: a worker's second
    examples = marked(examples, "hang", lambda i: i in hung)
    expected = CRMScorer.load(pairwise_export).pair_probabilities(examples)
    scorer = ray_scorer(pool, pairwise_export, tmp_path / "run",
                        config=replace(TWO_WORKERS, block_timeout=4))
    got = scorer.pair_probabilities(examples)
    assert torch.allclose(got, expected, atol=1e-5) and not got.isnan().any()
    task = tmp_path / "run" / "blocks" / "001-pairs"
    assert stored_rows(task) == list(range(len(examples)))  # each row once
    engine = json.loads((tmp_path / "run" / "engine.json").read_text())
    (timeout,) = [r for r in engine["tasks"][0]["retries"] if r["reason"] == "timeout"]
    assert timeout["block"] == 2 and timeout["counted"] and timeout["detail"] == "no reply within 4 s"
    assert timeout["node"] == "127.0.0.1" and timeout["pid"] is not None
    # redone on the other worker, not on the one Ray restarts in place of the hung one
    assert int(np.load(task / "000002.npz")["worker"]) != timeout["worker"]
    wait_until_back(pool)


def test_a_wrong_reply_is_the_blocks_failure_and_is_redone_elsewhere(pool, pairwise_export,
                                                                    demo_root, tmp_path, caplog):
    """A worker whose model answers NaN on rows that fit (a broken device): the driver checks
    the reply against the block, and the block is redone on the other worker."""
    from crm.inference.scorer import CRMScorer

    examples = board_examples(demo_files(demo_root)[1])
    examples = marked(examples, "nan", lambda i: i in pair_blocks(examples, 1)[1])
    expected = CRMScorer.load(pairwise_export).pair_probabilities(examples, unfit="nan")
    scorer = ray_scorer(pool, pairwise_export, tmp_path / "run")
    with caplog.at_level("WARNING", logger="crm.inference.engine"):
        got = scorer.pair_probabilities(examples, unfit="nan")
    assert torch.allclose(got, expected, atol=1e-5) and not got.isnan().any()
    (retry,) = scorer.tasks[0]["retries"]
    assert retry["block"] == 1 and retry["reason"] == "reply" and retry["counted"]
    assert "NaN values where the prompts fit" in retry["detail"] and "answered block 1 wrongly" in caplog.text
    task = tmp_path / "run" / "blocks" / "001-pairs"
    assert int(np.load(task / "000001.npz")["worker"]) != retry["worker"]


def test_an_interrupt_between_a_blocks_write_and_its_rename_leaves_it_unfinished(
        pool, pairwise_export, demo_root, tmp_path, monkeypatch, caplog):
    """Ctrl-C after the third block's temporary file is written, before its rename: two blocks
    count as finished, the third does not, and the rerun redoes it."""
    examples = board_examples(demo_files(demo_root)[1])
    run_dir = tmp_path / "run"
    task = run_dir / "blocks" / "001-pairs"
    monkeypatch.setenv(FAULT_ENV, "interrupt:3")
    with pytest.raises(KeyboardInterrupt):
        ray_scorer(pool, pairwise_export, run_dir).pair_probabilities(examples)
    monkeypatch.delenv(FAULT_ENV)
    (tmp,) = task.glob("*.tmp")
    assert len(list(task.glob("*.npz"))) == 2 and not tmp.with_suffix("").exists()
    rerun = ray_scorer(pool, pairwise_export, run_dir)  # the same command again
    with caplog.at_level("INFO", logger="crm.inference.engine"):
        got = rerun.pair_probabilities(examples)
    fresh = rerun.pair_probabilities(examples)  # the next task: nothing to resume
    assert "001-pairs: 2 of 4 blocks already finished" in caplog.text
    assert rerun.tasks[0]["skipped"] == 2 and rerun.tasks[1]["skipped"] == 0
    assert not list(task.glob("*.tmp")) and stored_rows(task) == list(range(len(examples)))
    assert torch.allclose(got, fresh, atol=1e-5) and not got.isnan().any()
    assert rerun.counts["sequences"] == 2 * len(examples)  # skipped blocks' counts included
    engine = json.loads((run_dir / "engine.json").read_text())
    assert [t["skipped"] for t in engine["tasks"]] == [2, 0]


def test_blocks_of_other_rows_in_the_run_dir_are_refused(pool, pairwise_export, demo_root,
                                                         tmp_path):
    examples = board_examples(demo_files(demo_root)[1])
    ray_scorer(pool, pairwise_export, tmp_path / "run").pair_probabilities(examples[:4])
    plan = json.loads((tmp_path / "run" / "blocks" / "001-pairs" / "plan.json").read_text())
    # what the workers resolved, not the settings' "auto"
    assert plan["fingerprint"]["dtype"] == "float32" and plan["fingerprint"]["device"] == "cpu"
    with pytest.raises(ConfigError, match=r"finished blocks of another scoring \(their rows differ\)"):
        ray_scorer(pool, pairwise_export, tmp_path / "run").pair_probabilities(examples)
    other = [replace(e, criteria=("I prefer long answers.",)) for e in examples[:4]]
    with pytest.raises(ConfigError, match=r"\(their criteria differ\)"):
        ray_scorer(pool, pairwise_export, tmp_path / "run").pair_probabilities(other)


def test_a_run_dir_of_another_scoring_is_refused_before_the_workers_are_up(
        local_ray, pairwise_export, demo_root, tmp_path):
    """RayScorer.start returns while Ray's workers start (they load once the gate file exists):
    the driver reads and plans meanwhile, and a run dir of another scoring is refused then, not
    after the start-up; closing does not wait for the start, which stops what it started."""
    examples = board_examples(demo_files(demo_root)[1])
    task = tmp_path / "run" / "blocks" / "001-pairs"
    task.mkdir(parents=True)
    (task / "plan.json").write_text(json.dumps({"fingerprint": {**FINGERPRINT, "rows": "other"}}))
    gate = tmp_path / "gate"
    scorer = RayScorer.start(Faulty(str(pairwise_export), gate=str(gate)),
                             replace(TWO_WORKERS, workers=1), run_dir=tmp_path / "run",
                             identity=checkpoint_identity(pairwise_export))
    try:
        assert not scorer.pool.ready
        with pytest.raises(ConfigError, match="finished blocks of another scoring"):
            scorer.pair_probabilities(examples)
        assert not scorer.pool.ready  # refused without waiting for the workers
        scorer.close()
        scorer.pool.join()  # the start stopped its worker, still loading (the gate is shut)
        assert scorer.pool.actors == [] and not scorer.pool.ready
    finally:
        gate.touch()
        scorer.pool.join()


def test_a_local_ray_listens_on_loopback_only_and_says_no_token_warning(local_ray):
    import psutil

    assert "Token authentication" not in local_ray, local_ray
    assert ray.get_runtime_context().gcs_address.startswith("127.0.0.1:")
    listening = []
    for process in psutil.Process().children(recursive=True):
        try:
            listening += [(process.name(), c.laddr.ip) for c in process.net_connections("tcp")
                          if c.status == psutil.CONN_LISTEN]
        except psutil.NoSuchProcess:  # a worker that ended meanwhile
            pass
    assert {"gcs_server", "raylet"} <= {name for name, _ in listening}
    assert all(ip in ("127.0.0.1", "::ffff:127.0.0.1") for _, ip in listening), listening


def test_a_driver_killed_mid_write_resumes_and_the_real_loader_equals_engine_local(
        pool, pairwise_export, demo_root, tmp_path, monkeypatch):
    """crm-leaderboard with engine=ray joins the running cluster (engine.address=auto), its real
    loader in a real worker, and is SIGKILLed between its second block's temporary file and the
    rename: the rerun keeps the first block, redoes the second, and every figure equals
    engine=local's."""
    from crm.cli.leaderboard import run

    _, bench = demo_files(demo_root)
    common = [f"checkpoint={pairwise_export}", f"bench={bench}", "baseline=baseline",
              "progress=false", "both_orders=false", "slot_sample=0",
              'criteria=["I prefer short, to-the-point answers."]']
    spread = [*common, "engine=ray", "engine.address=auto", "engine.workers=1",
              "engine.block_prompts=1"]
    monkeypatch.setenv("RAY_ADDRESS", ray.get_runtime_context().gcs_address)
    killed = subprocess.run(
        [sys.executable, "-m", "crm.cli.leaderboard", *spread, f"hydra.run.dir={tmp_path / 'ray'}"],
        env={**os.environ, FAULT_ENV: "kill:2"}, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    task = tmp_path / "ray" / "blocks" / "001-pairs"
    assert sorted(p.name for p in task.iterdir()) == ["000000.npz", "000001.npz.tmp", "plan.json"]
    local = run_cli("leaderboard", run, common, tmp_path / "local")
    resumed = run_cli("leaderboard", run, spread, tmp_path / "ray")  # RayScorer.start, real loader
    for key in ("boards", "examples", "models"):
        assert resumed[key] == local[key], key
    engine = json.loads((tmp_path / "ray" / "engine.json").read_text())
    assert engine["started_ray"] is False and engine["loader"]["checkpoint"] == str(pairwise_export)
    assert engine["tasks"][0]["skipped"] == 1
    assert not list(task.glob("*.tmp")) and stored_rows(task) == list(range(engine["tasks"][0]["rows"]))


def test_more_workers_than_the_cluster_has_and_an_unreachable_address_are_one_line(
        local_ray, pairwise_export):
    load = ScorerLoader(str(pairwise_export))
    with pytest.raises(ConfigError, match=rf"engine.workers={CPUS + 1} x engine.cpus_per_worker=1 "
                                          rf"needs {CPUS + 1} CPUs; the cluster \(local\) has {CPUS}$"):
        WorkerPool(load, EngineConfig(name="ray", workers=CPUS + 1))
    with pytest.raises(ConfigError, match="needs 2 GPUs; the cluster .* has 0"):
        WorkerPool(load, EngineConfig(name="ray", workers=2, gpus_per_worker=1))
    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(ConfigError, match=f"engine.address={address}: no Ray cluster answers "
                                          "there within 2 s"):
        WorkerPool(load, EngineConfig(name="ray", address=address, connect_timeout=2))


def test_engine_ray_without_ray_installed_names_the_extra(pairwise_export, tmp_path, monkeypatch,
                                                          capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as where it is missing
    from crm.cli.eval import _main

    monkeypatch.setattr(sys, "argv", ["crm-eval", f"checkpoint={pairwise_export}",
                                      f"hydra.run.dir={tmp_path}", "engine=ray",
                                      f"data.test=[{TESTS / 'nonexistent.jsonl'}]"])
    with pytest.raises(SystemExit) as exit_info:
        _main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == ("crm-eval: engine=ray needs Ray, which is not installed: pip install 'crm[ray]' "
                   "(or engine=local)")


def test_a_crm_usl_board_on_the_pool_equals_engine_local(pool, pairwise_export, demo_root):
    """crm-usl's service (crm/app/service.py) takes a RayScorer where it takes a CRMScorer."""
    from crm.app.cache import VerdictCache
    from crm.app.service import Leaderboards
    from crm.inference.scorer import CRMScorer

    selection = select(demo_files(demo_root)[1], "baseline")

    def board(scorer):
        service = Leaderboards(scorer, selection, crm_fingerprint="crm", bench_fingerprint="bench",
                               version="test", cache=VerdictCache(None))
        criteria = service.criteria("I prefer short, to-the-point answers.")
        return service.board(criteria, service.choose(None))

    spread = board(ray_scorer(pool, pairwise_export, None))
    assert spread["rows"] == board(CRMScorer.load(pairwise_export))["rows"]


def test_a_block_that_keeps_killing_its_worker_stops_the_job_naming_its_rows(
        pool, pairwise_export, demo_root, tmp_path):
    """Last of the module: its pool's workers are left restarting."""
    examples = board_examples(demo_files(demo_root)[1])
    examples = marked(examples, "die", lambda i: i == len(examples) - 1)
    scorer = ray_scorer(pool, pairwise_export, tmp_path / "run",
                        config=replace(TWO_WORKERS, block_attempts=2))
    task = tmp_path / "run" / "blocks" / "001-pairs"
    # the block of the last example: its prompt group's rows
    block, rows = next((b, rows) for b, rows in enumerate(pair_blocks(examples, 1))
                       if len(examples) - 1 in rows)
    keys = [examples[i].key for i in rows]
    with pytest.raises(BlockFailed, match=f"001-pairs: block {block} \\({len(keys)} rows: "
                                          f"{re.escape(keys[0])}.* and {len(keys) - 5} more\\) failed "
                                          r"2 times \(worker \d at 127.0.0.1: its worker died \(\w+\); "
                                          r"worker \d at 127.0.0.1: its worker died .*\); its rows are not "
                                          f"scored, the job stops; the rows: {task}"):
        scorer.pair_probabilities(examples)
    assert not (task / f"{block:06d}.npz").exists()
    failed = json.loads((task / f"failed-{block:06d}.json").read_text())
    assert failed["rows"] == keys and len(failed["failures"]) == 2
    # each counted death on another worker: a bad worker does not use up an innocent block
    assert len({f.split(" at ")[0] for f in failed["failures"]}) == 2



def test_crm_usl_closes_its_scorer_when_the_server_stops(monkeypatch):
    """Ctrl-C (or SIGTERM) ends crm-usl's server: its RayScorer's workers, and a Ray it started,
    stop with it."""
    import crm.cli.usl as usl

    closed = []
    service = SimpleNamespace(scorer=SimpleNamespace(close=lambda: closed.append(True)),
                              version="v", selection=SimpleNamespace(baseline="b"))

    def launch(*args, **kwargs):
        raise KeyboardInterrupt

    page = SimpleNamespace(HttpLimits=type("HttpLimits", (), {"__dataclass_fields__": {}}),
                           launch=launch)
    monkeypatch.setitem(sys.modules, "crm.app.page", page)  # not Gradio's import
    monkeypatch.setattr(usl, "build_app", lambda cfg: (object(), service))
    monkeypatch.setattr(usl, "save_run_record", lambda cfg: None)
    monkeypatch.setattr(usl, "freeze_startup_heap", lambda: None)
    monkeypatch.setattr(usl.signal, "signal", lambda *args: None)  # the test's SIGTERM kept
    cfg = SimpleNamespace(auth_env=None, host="127.0.0.1", port=1, serve={})
    with pytest.raises(KeyboardInterrupt):
        usl.main.__wrapped__(cfg)
    assert closed == [True]
