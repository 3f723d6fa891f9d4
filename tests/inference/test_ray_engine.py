"""engine=ray (crm/inference/engine.py): the rows of crm-eval, a benchmark and crm-leaderboard
scored in blocks by Ray workers equal engine=local's; a worker SIGKILLed mid-job is replaced and its
blocks redone; an interrupted job rerun resumes from its finished blocks; each row lands once; bad
settings and a block that keeps killing its worker stop in one line.

One local Ray for the module (2 CPUs, a 100 MB object store, no dashboard), shut down at its end,
and one pool of 2 workers for the tests that drive RayScorer directly (a pool's start is most of
a test's time): its workers' scorers sleep in a block holding a row keyed `slow:...` (so that a
kill lands mid-block) and SIGKILL their process in one holding `die:...`. The 2-node cluster of
launch/score.sbatch is tests/launch/test_score_cluster.py's.
"""
from __future__ import annotations

import json
import os
import re
import signal
import sys
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import free_port
from scorers import export_tiny, run_cli

from crm.core.errors import ConfigError
from crm.evaluation.leaderboard import pairs, select
from crm.inference.engine import (BlockFailed, EngineConfig, RayScorer, ScorerLoader, WorkerPool,
                                  checkpoint_identity, pair_blocks, plan_blocks)

ray = pytest.importorskip("ray", reason="engine=ray needs ray (pip install -e '.[ray]')")

# A local Ray of two worker processes runs beside each test here: the other xdist worker waits
# (tests/conftest.py).
pytestmark = pytest.mark.both_cores
TESTS = Path(__file__).resolve().parents[1]
TWO_WORKERS = EngineConfig(name="ray", workers=2, block_prompts=1, block_attempts=3)


@pytest.fixture(scope="module")
def local_ray():
    """One small local Ray for the module. Its workers import this module (a test's loader is
    pickled by reference), so they get the tests' folders on PYTHONPATH."""
    path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(TESTS), str(TESTS / "inference"), *([path] if path else [])])
    ray.init(num_cpus=2, num_gpus=0, object_store_memory=100 * 2**20, include_dashboard=False,
             configure_logging=False, log_to_driver=False)
    try:
        yield
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
    SIGKILLs its own process in one holding a `die:` row."""

    export: str
    seconds: float = 1.0

    def __call__(self, device):
        import time

        scorer = ScorerLoader(self.export)(device)
        score = scorer.pair_probabilities

        def pair_probabilities(examples, **kwargs):
            if any(e.key.startswith("die:") for e in examples):
                os.kill(os.getpid(), signal.SIGKILL)
            if any(e.key.startswith("slow:") for e in examples):
                time.sleep(self.seconds)
            return score(examples, **kwargs)

        scorer.pair_probabilities = pair_probabilities
        return scorer


@pytest.fixture(scope="module")
def pool(local_ray, pairwise_export):
    pool = WorkerPool(Faulty(str(pairwise_export)), TWO_WORKERS)
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


class _Actor:
    """Stands for a worker's actor handle: `pairs.remote(block)` returns a reference."""

    def __init__(self):
        self.pairs = self

    def remote(self, block):
        return object()


def test_each_worker_gets_a_first_block_before_any_a_second_and_a_block_to_redo_runs_alone():
    from types import SimpleNamespace

    from crm.inference.engine import BLOCKS_IN_FLIGHT, _BlockRun

    pool = SimpleNamespace(actors=[_Actor(), _Actor()], down=set())
    scorer = SimpleNamespace(pool=pool)
    blocks = [[i] for i in range(8)]
    run = _BlockRun(scorer, "pairs", "001-pairs", blocks, [], lambda rows: tuple(rows), None, {})
    run.queue = deque(range(8))
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
                                                                     demo_root, tmp_path):
    from crm.cli.eval import evaluate

    tests = demo_files(demo_root)[0][:1]
    common = [f"checkpoint={pairwise_export}", f"data.test=[{','.join(tests)}]", "benchmark=pairs",
              f"benchmark.path={tests[0]}", 'criteria=["I prefer short answers."]', "progress=false"]
    local = run_cli("eval", evaluate, common, tmp_path / "local")
    spread = run_cli("eval", evaluate, [*common, "engine=ray", "engine.workers=2",
                                        "engine.block_prompts=8"], tmp_path / "ray")
    (load, config), = cli_on_pool
    assert load == ScorerLoader(str(pairwise_export), 32) and config.block_prompts == 8
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
    # The slot-bias sample in both orders (crm.evaluation.slot_bias), then the board's pairs: a
    # block per query.
    *slot, board = json.loads((tmp_path / "ray" / "engine.json").read_text())["tasks"]
    assert board["blocks"] == local["examples"]["used"]
    assert [t["op"] for t in slot] == ["pairs", "pairs"] and slot[0]["rows"] == slot[1]["rows"] > 0


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


def test_an_interrupted_job_rerun_resumes_from_its_finished_blocks(pool, pairwise_export,
                                                                   demo_root, tmp_path, caplog):
    examples = board_examples(demo_files(demo_root)[1])
    run_dir = tmp_path / "run"

    def interrupt(task, block):
        if len(list((run_dir / "blocks" / task).glob("*.npz"))) == 2:
            raise KeyboardInterrupt  # Ctrl-C, after two blocks were written

    first = ray_scorer(pool, pairwise_export, run_dir, on_block=interrupt)
    with pytest.raises(KeyboardInterrupt):
        first.pair_probabilities(examples)
    assert not list((run_dir / "blocks" / "001-pairs").glob("*.tmp"))
    rerun = ray_scorer(pool, pairwise_export, run_dir)  # the same command again
    with caplog.at_level("INFO", logger="crm.inference.engine"):
        got = rerun.pair_probabilities(examples)
    fresh = rerun.pair_probabilities(examples)  # the next task: nothing to resume
    assert "001-pairs: 2 of 4 blocks already finished" in caplog.text
    assert rerun.tasks[0]["skipped"] == 2 and rerun.tasks[1]["skipped"] == 0
    assert torch.allclose(got, fresh, atol=1e-5) and not got.isnan().any()
    assert rerun.counts["sequences"] == 2 * len(examples)  # skipped blocks' counts included
    engine = json.loads((run_dir / "engine.json").read_text())
    assert [t["skipped"] for t in engine["tasks"]] == [2, 0]


def test_blocks_of_other_rows_in_the_run_dir_are_refused(pool, pairwise_export, demo_root,
                                                         tmp_path):
    examples = board_examples(demo_files(demo_root)[1])
    ray_scorer(pool, pairwise_export, tmp_path / "run").pair_probabilities(examples[:4])
    with pytest.raises(ConfigError, match="finished blocks of another scoring"):
        ray_scorer(pool, pairwise_export, tmp_path / "run").pair_probabilities(examples)


def test_more_workers_than_the_cluster_has_and_an_unreachable_address_are_one_line(
        local_ray, pairwise_export):
    load = ScorerLoader(str(pairwise_export))
    with pytest.raises(ConfigError, match=r"engine.workers=3 x engine.cpus_per_worker=1 needs 3 "
                                          r"CPUs; the cluster \(local\) has 2$"):
        WorkerPool(load, EngineConfig(name="ray", workers=3))
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
                                          f"{re.escape(keys[0])}.* and {len(keys) - 5} more\\) killed "
                                          "its worker 2 times.*its rows are not scored, the job stops; "
                                          f"the rows: {task}"):
        scorer.pair_probabilities(examples)
    assert not (task / f"{block:06d}.npz").exists()
    failed = json.loads((task / f"failed-{block:06d}.json").read_text())
    assert failed["rows"] == keys and failed["deaths"] == 2

