"""The suite's wall time on two workers under an order of its files, simulated from a recorded
run's per-test seconds: how much the order of tests/conftest.py gains, before a run of minutes.

The model is `make test`'s: xdist's loadfile scheduling (whole files, in the given order; a worker
is handed its next file once at most 2 of its tests are pending), two workers, and
tests/conftest.py's lock (a both_cores test starts once the other worker's test in progress has
ended, and the other worker starts nothing while it runs). Collection, start-up and the tests'
own variation are left out: the figures compare orders; they are not the suite's time. With
`--noise F` each test's seconds are drawn from [1 - F, 1 + F) times the recorded ones, `--trials`
times, and the mean and the 10th and 90th percentiles are printed.

    PYTEST_ADDOPTS="--junitxml=/tmp/suite.xml" bash .ci/run
    python benchmarks/suite_schedule.py /tmp/suite.xml [--noise 0.25] [--trials 60]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import random
import statistics
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from suite_durations import durations

ROOT = Path(__file__).resolve().parents[1]


def collected() -> list[tuple[str, bool]]:
    """(test id, whether it is marked both_cores) in collection order, as pytest collects them."""
    found = []

    class Plugin:
        def pytest_collection_finish(self, session):
            found.extend((item.nodeid, item.get_closest_marker("both_cores") is not None)
                         for item in session.items)

    with contextlib.redirect_stdout(io.StringIO()):  # pytest's listing: this prints JSON alone
        pytest.main(["--collect-only", "-q", "-p", "no:randomly", str(ROOT / "tests")], plugins=[Plugin()])
    return found


def recorded(junit_xml: str) -> dict[str, float]:
    """Seconds per test id, as benchmarks/suite_durations.py reads them."""
    return {t["test"]: t["seconds"] for t in durations(junit_xml, top=sys.maxsize)["slowest"]}


def simulate(files: dict[str, list[tuple[float, bool]]], order: list[str]) -> float:
    queue = list(order)
    pending: dict[int, list[tuple[float, bool]]] = {0: [], 1: []}
    free, alone = [0.0, 0.0], [False, False]  # when each worker's test ends; whether it is both_cores

    def hand_out(worker: int) -> None:
        if queue and len(pending[worker]) <= 2:
            pending[worker].extend(files[queue.pop(0)])

    for worker in (0, 1):
        hand_out(worker)
    for worker in (0, 1):
        hand_out(worker)
    while pending[0] or pending[1]:
        worker = min((w for w in (0, 1) if pending[w]), key=lambda w: free[w])
        other = 1 - worker
        seconds, both = pending[worker].pop(0)
        start = free[worker]
        if (both or alone[other]) and free[other] > start:
            start = free[other]
        free[worker], alone[worker] = start + seconds, both
        hand_out(worker)
    return max(free)


def orders(files: dict, both_files: set, seconds: dict) -> dict[str, list[str]]:
    by_count = sorted(files, key=lambda f: -len(files[f]))  # xdist's loadscope reorder
    return {
        "xdist reorder by test count (before)": by_count,
        "both_cores files first, then longest first (tests/conftest.py)":
            sorted(files, key=lambda f: (f not in both_files, -seconds[f])),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("junit_xml")
    p.add_argument("--noise", type=float, default=0.25)
    p.add_argument("--trials", type=int, default=60)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    try:
        seconds_of = recorded(args.junit_xml)
    except (OSError, ET.ParseError) as exc:
        p.error(f"{args.junit_xml}: not a readable JUnit XML file ({exc})")
    items = collected()
    known = [seconds_of[i] for i, _ in items if i in seconds_of]
    median = statistics.median(known) if known else 0.0
    files: dict[str, list[tuple[float, bool]]] = {}
    for test_id, both in items:
        files.setdefault(test_id.split("::")[0], []).append((seconds_of.get(test_id, median), both))
    both_files = {f for f, tests in files.items() if any(b for _, b in tests)}
    file_seconds = {f: sum(s for s, _ in tests) for f, tests in files.items()}
    rng = random.Random(args.seed)
    results = {}
    for name, order in orders(files, both_files, file_seconds).items():
        walls = []
        for _ in range(args.trials):
            drawn = {f: [(s * rng.uniform(1 - args.noise, 1 + args.noise), b) for s, b in tests]
                     for f, tests in files.items()}
            walls.append(simulate(drawn, order))
        walls.sort()
        results[name] = {"as_recorded_s": round(simulate(files, order), 1),
                         "mean_s": round(statistics.mean(walls), 1),
                         "p10_s": round(walls[len(walls) // 10], 1),
                         "p90_s": round(walls[len(walls) * 9 // 10], 1)}
    both_seconds = sum(s for tests in files.values() for s, b in tests if b)
    shared_seconds = sum(s for tests in files.values() for s, b in tests if not b)
    print(json.dumps({
        "junit_xml": args.junit_xml, "tests": len(items),
        "tests_without_a_recorded_time": sum(1 for i, _ in items if i not in seconds_of),
        "both_cores_s": round(both_seconds, 1), "shared_s": round(shared_seconds, 1),
        "bound_s": round(both_seconds + shared_seconds / 2, 1),
        "noise": args.noise, "trials": args.trials, "orders": results}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
