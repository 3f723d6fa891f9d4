"""The test suite's time, from pytest's JUnit XML: the slowest tests (setup, call and teardown
together, as JUnit reports them), the time per file, and the totals, as one JSON document.

    PYTEST_ADDOPTS="--junitxml=/tmp/suite.xml" bash .ci/run
    python benchmarks/suite_durations.py /tmp/suite.xml [--top 20] [--label "after, quiet"]

pytest's own total (the `in N s` of its last line) is the suite's wall time; with two xdist
workers the per-test times add up to more than it, as both workers run tests at once.
"""
from __future__ import annotations

import argparse
import collections
import json
import xml.etree.ElementTree as ET


def durations(path: str, top: int) -> dict:
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    tests, per_file = [], collections.Counter()
    for case in suite.iter("testcase"):
        file = case.get("classname").replace(".", "/") + ".py"
        seconds = float(case.get("time"))
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")),
                       "passed")
        tests.append({"test": f"{file}::{case.get('name')}", "seconds": seconds, "outcome": outcome})
        per_file[file] += seconds
    tests.sort(key=lambda t: -t["seconds"])
    outcomes = collections.Counter(t["outcome"] for t in tests)
    return {
        "pytest_wall_s": float(suite.get("time")),
        "tests": len(tests),
        "outcomes": dict(outcomes),
        "sum_of_test_seconds": round(sum(t["seconds"] for t in tests), 2),
        "slowest": tests[:top],
        "per_file": {f: round(s, 2) for f, s in per_file.most_common()},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("junit_xml")
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--label", default="", help="how and where the run was made")
    args = p.parse_args()
    print(json.dumps({"label": args.label, **durations(args.junit_xml, args.top)}, indent=1))


if __name__ == "__main__":
    main()
