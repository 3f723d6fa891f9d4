"""The test suite's time, from pytest's JUnit XML: the slowest tests (setup, call and teardown
together, as JUnit reports them), the time per file, and the totals, as one JSON document.

    PYTEST_ADDOPTS="--junitxml=/tmp/suite.xml" bash .ci/run
    python benchmarks/suite_durations.py /tmp/suite.xml [--top 20] [--label "after, quiet"]
                                         [--write-durations tests/durations.json]

`--write-durations` also writes the seconds per file and the median test's, which tests/conftest.py
reads to hand out the files longest first.

pytest's own total (the `in N s` of its last line) is the suite's wall time; with two xdist
workers the per-test times add up to more than it, as both workers run tests at once.
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
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
        "median_test_seconds": round(statistics.median(t["seconds"] for t in tests), 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("junit_xml")
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--label", default="", help="how and where the run was made")
    p.add_argument("--write-durations", metavar="FILE",
                   help="also write the seconds per file and the median test's (tests/durations.json)")
    args = p.parse_args()
    try:
        result = durations(args.junit_xml, args.top)
    except (OSError, ET.ParseError) as exc:
        p.error(f"{args.junit_xml}: not a readable JUnit XML file ({exc})")
    print(json.dumps({"label": args.label, **result}, indent=1))
    if args.write_durations:
        with open(args.write_durations, "w") as f:
            json.dump({"source": args.label or args.junit_xml, "per_file": result["per_file"],
                       "median_test_seconds": result["median_test_seconds"]}, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
