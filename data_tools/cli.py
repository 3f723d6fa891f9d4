"""crm-data: demo | validate | shard | stats | criteria | topics | flip (docs/DESIGN.md section 7)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from crm.core.records import (FORMATS, RecordError, fingerprint, line_format, open_data, read_lines,
                              whole_document)

REJECTS_NAME = "rejects.jsonl"


def _demo(args) -> int:
    from crm.data.demo import write_demo

    written = write_demo(args.out_dir, seed=args.seed, n_train=args.n_train, n_test=args.n_test,
                         n_bench=args.n_bench, n_user=args.n_user)
    for name, lines in written.items():
        print(f"{args.out_dir}/{name}: {lines} lines")
    return 0


def _validate(args) -> int:
    """Each distinct defect (field and reason) once, at its first line, with how many lines share
    it and where: a file missing one field on every line is one line of output, not thousands."""
    _check_text(args.file)
    good = bad = duplicates = 0
    same: dict[tuple[str, str], list[RecordError]] = {}
    first_line: dict[bytes, int] = {}
    for line in read_lines(args.file, args.format):
        if line.error:
            bad += 1
            same.setdefault((line.error.field, line.error.reason), []).append(line.error)
            continue
        good += 1
        first = first_line.setdefault(fingerprint(json.loads(line.text)), line.number)
        if first != line.number:  # valid, and said: a duplicate is not a defect, but rarely meant
            duplicates += 1
            same.setdefault(("", f"an exact duplicate of line {first}"), []).append(
                RecordError(f"an exact duplicate of line {first}", "", args.file, line.number))
    for errors in same.values():
        more = ""
        if len(errors) > 1:
            lines = ", ".join(str(e.line) for e in errors[1:11]) + (", ..." if len(errors) > 11 else "")
            more = f" (and {len(errors) - 1} more lines: {lines})"
        print(f"{errors[0]}{more}")
    print(f"{args.file}: {good + bad} lines, {good} valid, {bad} rejected"
          + (f"; {duplicates} valid lines repeat an earlier line exactly" if duplicates else ""),
          file=sys.stderr)
    return 1 if bad else 0


def _shard(args) -> int:
    from crm.data.shard import shard

    for path in args.files:
        _check_text(path)
    _check_topic_tables(args.files)
    manifest = shard(args.files, args.out_dir, val_fraction=args.val_fraction,
                     shard_size=args.shard_size, seed=args.seed, fmt=args.format,
                     overwrite=args.overwrite)
    c = manifest["counts"]
    _print_rejects(Path(args.out_dir) / manifest["rejects"])
    for split, info in manifest["splits"].items():
        sc = info["counts"]
        print(f"{split}: {sc['read']} read, {sc['written']} written to {len(info['shards'])} shards, "
              f"{sc['rejected']} rejected")
    print(f"{args.out_dir}: {c['read']} read = {c['written']} written + {c['rejected']} rejected"
          + (f" (see {args.out_dir}/{manifest['rejects']})" if c["rejected"] else ""))
    if not c["written"]:  # shards a run would refuse: the user's mistake, not a result
        why = "every line was rejected" if c["read"] else "the input has no line"
        print(f"crm-data shard: nothing written: {why} ({', '.join(args.files)})", file=sys.stderr)
        return 2
    return 1 if args.strict and c["rejected"] else 0


def _check_text(path: str) -> None:
    """A file that is not JSONL text at all (Parquet, a binary, another encoding, a README caught
    by a glob, votes that have no criteria yet) is one error saying what to do, not a reject per
    line: its start shows it. A directory is refused with its data files named. gzip is read."""
    if Path(path).is_dir():
        raise ValueError(f"{path}: a directory, not a JSONL file: {_data_files_in(path)}")
    with open_data(path) as handle:
        head = handle.read(1 << 16)
    if head.startswith(b"PAR1"):
        raise ValueError(f"{path}: a Parquet file, not JSONL (votes in Parquet go to `crm-data "
                         "criteria`; records: write them as JSON lines)")
    try:
        text = head.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        if exc.start < len(head) - 3:  # not a character cut at the end of the sample
            raise ValueError(f"{path}: not UTF-8 text (byte {exc.start}): crm-data reads "
                             "JSONL files") from None
        text = head[:exc.start].decode("utf-8-sig")
    lines = text.splitlines()
    number, first = next(((n, line.strip()) for n, line in enumerate(lines, start=1)
                          if line.strip()), (0, ""))
    if not first or (number == len(lines) and len(head) == 1 << 16):
        return  # empty, or a first line longer than the sample: read_lines judges it
    document = whole_document(first)
    if document:  # read_lines would say it too, after OUT_DIR is made
        raise ValueError(f"{path}:{number}: {document}")
    try:
        obj = json.loads(first)
    except (ValueError, RecursionError):
        if first[0] in "[{":
            return  # a JSON document or a broken line: read_lines says which
        hint = ("votes in CSV go to `crm-data criteria`" if path.endswith(".csv") else
                "crm-data reads JSONL files (a README or notes caught by a glob? give the "
                ".jsonl files only)")
        raise ValueError(f"{path}:{number}: not JSON lines (the line reads {first[:40]!r}): "
                         f"{hint}") from None
    if line_format(obj) is None and isinstance(obj, dict):
        from data_tools.crowd_votes import vote_format

        votes = vote_format(obj)
        if votes:
            raise ValueError(f"{path}:{number}: votes ({votes} format), not training records: "
                             f"`crm-data criteria {path} OUT_DIR --base-url URL --model NAME` "
                             "writes the criteria under which each side wins (docs/DATA_PIPELINE.md)")


def _data_files_in(directory: str) -> str:
    """What to give instead of a directory: its data files, or that it holds none."""
    data = sorted(p.name for p in Path(directory).iterdir()
                  if p.name.endswith((".jsonl", ".jsonl.gz")) and p.name != REJECTS_NAME)
    return (f"give its data files ({', '.join(data[:5])}{', ...' if len(data) > 5 else ''}: "
            f"{Path(directory) / '*.jsonl'})" if data else "it holds no .jsonl file")


def _check_topic_tables(files: list[str]) -> None:
    """Topic ids are a table's (`crm-data topics` writes `<stem>.topics.json` beside its output):
    files clustered apart number their topics apart (1 is "short" in one, "formal" in the other),
    and `add` noise, which draws criteria of another topic, would mix them up. Refused in one
    line with the way to one table."""
    from data_tools.topics import read_topic_table

    tables = []  # (input, its table's path, topic id -> name)
    for path in files:
        table = Path(path).with_name(Path(path).name.removesuffix(".gz").removesuffix(".jsonl")
                                     + ".topics.json")
        if table.is_file():
            names = {t["id"]: t["name"] for t in read_topic_table(table)[1]}
            tables.append((path, table, names))
    for path, table, names in tables[1:]:
        first_path, first_table, first_names = tables[0]
        differs = [i for i in sorted(set(names) | set(first_names)) if names.get(i) != first_names.get(i)]
        if differs:
            topic = differs[0]
            raise ValueError(
                f"{first_path} and {path} carry topic ids of different tables ({first_table}, "
                f"{table}): topic {topic} is {first_names.get(topic)!r} in one, "
                f"{names.get(topic)!r} in the other; give them one table: `cat FILES > all.jsonl "
                "&& crm-data topics all.jsonl all.jsonl`, then shard all.jsonl")


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
    from crm.data.manifest import MANIFEST
    from data_tools.stats import stats

    if not Path(args.path).is_dir():
        _check_text(args.path)
    elif not (Path(args.path) / MANIFEST).is_file():
        raise ValueError(f"{args.path}: a directory without {MANIFEST}, not a shard dir (crm-data "
                         f"shard's OUT_DIR): {_data_files_in(args.path)}")

    print(json.dumps(stats(args.path), indent=1))
    return 0


def _criteria(args) -> int:
    from data_tools.criteria import AskConfig, extract, write_summary

    cfg = AskConfig(base_url=args.base_url, model=args.model, concurrency=args.concurrency,
                    timeout=args.timeout, max_retries=args.max_retries,
                    answer_attempts=args.answer_attempts, backoff=args.backoff,
                    max_tokens=args.max_tokens or None, temperature=args.temperature)
    summary = extract(args.votes, args.out_dir, cfg, fmt=args.format, prompt_path=args.prompt,
                      progress=not args.no_progress)
    out = Path(args.out_dir)
    if not summary["written"]:  # nothing to cluster; summary.json still says why
        summary["topics"] = None
        note = ""
    elif args.no_topics:
        summary["topics"] = None
        note = f"; no topic ids yet: run `crm-data topics {out / 'train.jsonl'} {out / 'train.jsonl'}`"
    else:
        from data_tools.topics import topics

        summary["topics"] = topics(out / "train.jsonl", out / "train.jsonl", k=args.k, seed=args.seed)
        note = f"; {summary['topics']['topics']} criteria topics ({summary['topics']['table']})"
    write_summary(out, summary)
    by_stage = ", ".join(f"{n} {stage}" for stage, n in summary["rejected_by_stage"].items() if n)
    print(f"{args.votes}: {summary['read']} votes read = {summary['written']} written to "
          f"{out / 'train.jsonl'} + {summary['rejected']} rejected"
          + (f" ({by_stage}; see {out / 'rejects.jsonl'})" if by_stage else "") + note)
    if summary["tie_records"]:
        print(f"  + {summary['tie_records']} tie records beside them: criteria on which a decisive "
              "vote's two answers are equally good")
    for r in summary["top_reasons"]:
        print(f"  {r['stage']}: {r['reason']} x{r['count']}")
    print(f"{summary['asked']} asked ({summary['cached_before']} answered before), "
          f"{summary['requests']} requests, {summary['retries']} retries, {summary['tokens_in']} "
          f"tokens in, {summary['tokens_out']} out, {summary['seconds']} s")
    if not summary["written"] and summary["read"]:
        top = summary["top_reasons"][0]
        print(f"crm-data criteria: no vote got criteria: {top['reason']} x{top['count']}"
              f"{_criteria_hint(top)} (summary: {out / 'summary.json'})", file=sys.stderr)
        return 2
    return 1 if args.strict and summary["rejected"] else 0


def _criteria_hint(reason: dict) -> str:
    """What to check when every vote failed for `reason`."""
    if reason["stage"] == "request":
        return ": check --base-url (is the server up?)"
    if reason["stage"] == "answer":
        return f": check --model and --prompt (each answer is in {REJECTS_NAME})"
    return ": check the votes file and --format"


def _topics(args) -> int:
    from data_tools.topics import topics

    _check_text(args.input)
    summary = topics(args.input, args.output, k=args.k, seed=args.seed, embedder=args.embedder,
                     overwrite=args.overwrite)
    print(f"{args.input}: {summary['read']} read = {summary['written']} written to {args.output} + "
          f"{summary['rejected']} rejected" + (f" (see {summary['rejects']})" if summary["rejected"] else ""))
    print(f"{summary['criteria']} criteria ({summary['distinct_criteria']} distinct) in "
          f"{summary['topics']} topics: {summary['table']}")
    return 0


def _flip(args) -> int:
    from data_tools.flip import flip

    _check_text(args.input)
    c = flip(args.input, args.output, overwrite=args.overwrite)
    print(f"{args.input}: {c['read']} read = {c['written']} written to {args.output} (criteria swapped) + "
          f"{c['rejected']} rejected" + (f" (see {c['rejects']})" if c["rejected"] else ""))
    return 1 if c["rejected"] else 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="crm-data", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="write the embedded demo data set")
    d.add_argument("out_dir")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--n-train", type=int, default=6000, help="voted training pairs")
    d.add_argument("--n-user", type=int, default=6000,
                   help="training pairs under criteria as a user writes them (docs/DESIGN.md section 4)")
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
    s.add_argument("--overwrite", action="store_true",
                   help="replace OUT_DIR's shards of other inputs, or another command's "
                        "rejects.jsonl there (refused without it)")
    s.add_argument("--format", choices=("train", "test"),
                   help="the files' format (test = the README's criteria + preference); "
                        "default: detected per file")
    s.set_defaults(run=_shard)

    t = sub.add_parser("stats", help="counts, lengths, criteria per sample, label balance")
    t.add_argument("path", help="a JSONL file (any format) or a shard directory")
    t.set_defaults(run=_stats)

    c = sub.add_parser(
        "criteria", help="votes -> the criteria under which each side wins, from an LLM",
        description="For each human vote, ask an OpenAI-compatible endpoint (vLLM, SGLang, OpenAI) "
                    "for the criteria under which response A, and response B, is preferred, and "
                    "those under which the two are equally good (tie records); write "
                    "OUT_DIR/train.jsonl (training format, with criteria topics), rejects.jsonl, "
                    "summary.json. Answers are cached in OUT_DIR/answers.jsonl as they arrive: "
                    "rerun the same command after a crash to continue. The API key is read from "
                    "OPENAI_API_KEY when the endpoint needs one.",
        epilog="Vote formats (docs/DATA_PIPELINE.md): arena-55k (id, prompt, response_a, response_b "
               "as JSON turn lists, winner_model_a/winner_model_b/winner_tie); arena-conversations "
               "(question_id or id, conversation_a, conversation_b, winner); chosen-rejected "
               "(chosen, rejected, optional prompt and id). Files: .csv, .jsonl/.json, .parquet.")
    c.add_argument("votes", help="a .csv, .jsonl or .parquet file of votes")
    c.add_argument("out_dir")
    c.add_argument("--base-url", required=True, help="the endpoint, e.g. http://localhost:8000/v1")
    c.add_argument("--model", required=True, help="the model name the endpoint serves")
    c.add_argument("--format", choices=("arena-55k", "arena-conversations", "chosen-rejected"),
                   help="default: detected from the columns")
    c.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    c.add_argument("--prompt", default=None,
                   help="a prompt template (default: data_tools/criteria_prompt.yaml)")
    c.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    c.add_argument("--max-retries", type=int, default=8,
                   help="retries of a request after a 429, 5xx, timeout or connection error")
    c.add_argument("--answer-attempts", type=int, default=3,
                   help="answers asked for when one is not JSON or breaks the schema")
    c.add_argument("--backoff", type=float, default=1.0, help="seconds before the first retry (doubles)")
    c.add_argument("--max-tokens", type=int, default=1024, help="tokens per answer (0: the server's limit)")
    c.add_argument("--temperature", type=float, default=None, help="default: the server's")
    c.add_argument("--k", type=int, default=20, help="criteria topics")
    c.add_argument("--seed", type=int, default=0, help="seeds the topic clustering")
    c.add_argument("--no-topics", action="store_true", help="leave the topic ids to `crm-data topics`")
    c.add_argument("--no-progress", action="store_true", help="no progress bar")
    c.add_argument("--strict", action="store_true", help="exit 1 when any vote is rejected")
    c.set_defaults(run=_criteria)

    o = sub.add_parser("topics", help="cluster the criteria into topics; fill the topic ids")
    o.add_argument("input", metavar="IN.jsonl", help="training records (topic ids missing or replaced)")
    o.add_argument("output", metavar="OUT.jsonl",
                   help="a new file, an earlier output of topics, or IN.jsonl; the table goes beside it")
    o.add_argument("--overwrite", action="store_true",
                   help="replace an OUT.jsonl that is not an output of topics (refused without it)")
    o.add_argument("--k", type=int, default=20, help="topics")
    o.add_argument("--seed", type=int, default=0, help="seeds KMeans")
    o.add_argument("--embedder", default=None,
                   help="a local sentence-transformers model dir to cluster embeddings (default: TF-IDF)")
    o.set_defaults(run=_topics)

    f = sub.add_parser("flip", help="swap each record's two sides' criteria, keep the vote "
                                    "(a flipped-label control)")
    f.add_argument("input", metavar="IN.jsonl", help="training records (both sides' criteria)")
    f.add_argument("output", metavar="OUT.jsonl",
                   help="a new file or an earlier output of flip; rejects go to OUT.jsonl.rejects.jsonl")
    f.add_argument("--overwrite", action="store_true",
                   help="replace an OUT.jsonl that is not an output of flip (refused without it)")
    f.set_defaults(run=_flip)
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
