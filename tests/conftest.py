"""Fixtures shared by the test modules, and the two workers' share of the two cores.

`make test` runs the suite on two pytest-xdist workers, each one process at one torch thread, so
the two cores each run one test. A test marked `both_cores` starts processes of its own (a
2-rank run, a SLURM job's tasks, a 2-thread run) that need both: while it runs, the other worker
starts nothing. A worker holds the cores shared for each other test and alone for a both_cores
one (flock on files of the run); a worker waiting to hold them alone says so first (`waiting`)
and then takes the gate, and no worker starts a test while the other waits: neither can starve
it by starting test after test, the worker that held the cores alone last included (flock wakes
waiters in no set order). Without xdist the lock is not used.
"""
from __future__ import annotations

import collections
import contextlib
import fcntl
import json
import os
import tempfile
from pathlib import Path

import pytest
import torch
from helpers import TINY_DEMO

XDIST_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID")
# Seconds per test file in a recorded run of the whole suite: the order files are handed out in.
# Rewritten by `python benchmarks/suite_durations.py JUNIT_XML --write-durations tests/durations.json`.
DURATIONS = Path(__file__).parent / "durations.json"


class CoreShare:
    def __init__(self, directory: Path):
        directory.mkdir(exist_ok=True)
        self.waiting = open(directory / "waiting", "a")  # held shared by a worker waiting to run alone
        self.gate = open(directory / "gate", "a")
        self.cores = open(directory / "cores", "a")

    @contextlib.contextmanager
    def hold(self, alone: bool):
        fcntl.flock(self.waiting, fcntl.LOCK_EX)  # returns once no worker waits to run alone
        fcntl.flock(self.waiting, fcntl.LOCK_SH if alone else fcntl.LOCK_UN)
        fcntl.flock(self.gate, fcntl.LOCK_EX)
        if alone:
            fcntl.flock(self.waiting, fcntl.LOCK_UN)
        try:
            fcntl.flock(self.cores, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            if not alone:
                fcntl.flock(self.gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(self.cores, fcntl.LOCK_UN)
            if alone:
                fcntl.flock(self.gate, fcntl.LOCK_UN)


CORES = CoreShare(Path(tempfile.gettempdir()) / f"crm-tests-{XDIST_RUN}") if XDIST_RUN else None


def pytest_configure(config):
    if CORES is not None:
        # One thread per worker (and per process a test starts unless it says otherwise): two
        # workers' default two threads each would be four on two cores.
        torch.set_num_threads(1)
        os.environ["OMP_NUM_THREADS"] = "1"
        os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"  # inductor's pool: a process per core


def pytest_collection_modifyitems(config, items):
    """xdist hands out whole files (--dist loadfile --no-loadscope-reorder: xdist's own reorder,
    by test count, would undo this) in this order: first the files of both_cores tests, then the
    others, each group longest first by the seconds it took in the run recorded in DURATIONS
    (a file not there: its tests at the median test's seconds), and in a file its both_cores
    tests first. A both_cores test waits for the other worker's test in progress to end, a core
    idle meanwhile: run while the other worker is in the same kind of file, it waits for little
    (behind its file's other tests it could wait for the other worker's longest test); and a long
    file started last would leave a core idle at the end (the longest-first rule of scheduling)."""
    recorded = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
    per_file, per_test = recorded.get("per_file", {}), recorded.get("median_test_seconds", 0.0)
    counts = collections.Counter(item.nodeid.split("::")[0] for item in items)
    seconds = {file: per_file.get(file, n * per_test) for file, n in counts.items()}
    alone = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("both_cores")}

    def key(item):
        file = item.nodeid.split("::")[0]
        return file not in alone, -seconds[file], file, item.get_closest_marker("both_cores") is None
    items.sort(key=key)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if CORES is None:
        return (yield)
    with CORES.hold(alone=item.get_closest_marker("both_cores") is not None):
        return (yield)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: intra-op threads only add overhead (and stall when another process holds the
    cores: 2 threads measured 12x slower than 1 on a busy 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def fresh_dynamo():
    """torch.compile's in-process caches emptied, so that a test sees the graphs it builds and many
    tests' graphs never add up to dynamo's recompile limit; inductor's on-disk cache keeps the
    rebuild quick."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="session")
def demo_root(tmp_path_factory) -> Path:
    """A paths.root_dir whose cache holds the (small) demo data, generated once per session."""
    from hydra import compose, initialize_config_module

    import crm.cli.train  # noqa: F401  (registers train.yaml's schema)
    from crm.data.demo import DemoConfig, prepare_demo

    root = tmp_path_factory.mktemp("crm_root")
    with initialize_config_module(version_base="1.3", config_module="crm_configs"):
        cfg = compose("train", overrides=[*TINY_DEMO, f"paths.root_dir={root}"])
    shard_dir = prepare_demo(DemoConfig(**cfg.data.demo))
    assert (shard_dir / "manifest.json").is_file()
    return root


@pytest.fixture(scope="session")
def length_crm(tmp_path_factory):
    """(export dir, demo training file): a tiny pointwise CRM that prefers fewer sentences under
    "short" criteria and more under "detailed" ones, trained once per session (tests/scorers.py)."""
    from scorers import train_length_crm

    root = tmp_path_factory.mktemp("length_crm")
    torch.set_num_threads(1)
    return train_length_crm(root / "export", root / "data")
