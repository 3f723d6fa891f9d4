"""crm-data: demo | validate | shard | stats (DESIGN section 7)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from crm.records import FORMATS, RecordError, read_lines


def _demo(args) -> int:
    from crm.data.demo import write_demo

    written = write_demo(args.out_dir, seed=args.seed, n_train=args.n_train, n_test=args.n_test,
                         n_bench=args.n_bench)
    for name, lines in written.items():
        print(f"{args.out_dir}/{name}: {lines} lines")
    return 0


def _validate(args) -> int:
    good = bad = 0
    for line in read_lines(args.file, args.format):
        if line.error:
            bad += 1
            print(line.error)
        else:
            good += 1
    print(f"{args.file}: {good + bad} lines, {good} valid, {bad} rejected", file=sys.stderr)
    return 1 if bad else 0


def _shard(args) -> int:
    from crm.data.shard import shard

    manifest = shard(args.files, args.out_dir, val_fraction=args.val_fraction,
                     shard_size=args.shard_size, seed=args.seed, fmt=args.format)
    c = manifest["counts"]
    _print_rejects(Path(args.out_dir) / manifest["rejects"])
    for split, info in manifest["splits"].items():
        sc = info["counts"]
        print(f"{split}: {sc['read']} read, {sc['written']} written to {len(info['shards'])} shards, "
              f"{sc['rejected']} rejected")
    print(f"{args.out_dir}: {c['read']} read = {c['written']} written + {c['rejected']} rejected"
          + (f" (see {args.out_dir}/{manifest['rejects']})" if c["rejected"] else ""))
    return 1 if args.strict and c["rejected"] else 0


def _print_rejects(path: Path, most: int = 20) -> None:
    """The first rejects as file:line: field: reason (all of them are in the rejects file)."""
    with open(path, encoding="utf-8") as rejects:
        for n, line in enumerate(rejects):
            if n == most:
                print(f"... and more in {path}", file=sys.stderr)
                break
            r = json.loads(line)
            print(RecordError(r["reason"], r["field"], r["file"], r["line"]), file=sys.stderr)


def _stats(args) -> int:
    from data_tools.stats import stats

    print(json.dumps(stats(args.path), indent=1))
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="crm-data", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="write the embedded demo data set")
    d.add_argument("out_dir")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--n-train", type=int, default=6000, help="training pairs")
    d.add_argument("--n-test", type=int, default=400, help="records per test file")
    d.add_argument("--n-bench", type=int, default=60, help="benchmark queries")
    d.set_defaults(run=_demo)

    v = sub.add_parser("validate", help="report every bad line as file:line: field: reason")
    v.add_argument("file")
    v.add_argument("--format", choices=FORMATS, help="default: detected from the first line")
    v.set_defaults(run=_validate)

    s = sub.add_parser("shard", help="validated tar shards + manifest.json + rejects.jsonl")
    s.add_argument("files", nargs="+", metavar="FILE.jsonl",
                   help="training-format or README-format (criteria + preference) JSONL files")
    s.add_argument("out_dir")
    s.add_argument("--val-fraction", type=float, default=0.05, help="share of lines held for validation")
    s.add_argument("--shard-size", type=int, default=5000, help="most records in one shard")
    s.add_argument("--seed", type=int, default=0, help="seeds the split and the order in shards")
    s.add_argument("--strict", action="store_true", help="exit 1 when any line is rejected")
    s.add_argument("--format", choices=("train", "test"),
                   help="the files' format (test = the README's criteria + preference); "
                        "default: detected per file")
    s.set_defaults(run=_shard)

    t = sub.add_parser("stats", help="counts, lengths, criteria per sample, label balance")
    t.add_argument("path", help="a JSONL file (any format) or a shard directory")
    t.set_defaults(run=_stats)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.run(args)
    except OSError as exc:  # a missing or unreadable input is one line, not a traceback
        where = f"{exc.filename}: " if exc.filename else ""  # some errors name the file in their text
        print(f"crm-data {args.command}: {where}{exc.strerror or exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"crm-data {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
