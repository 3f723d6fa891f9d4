"""crm-data validate | shard | stats: the command-line contract of docs/DESIGN.md section 7.

Everything runs in-process through `data_tools.cli.main`, except one subprocess run of the
installed `crm-data` script that proves the entry point and its exit code.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
import tarfile
from collections import Counter
from pathlib import Path

import pytest

from crm.data.manifest import load_manifest
from crm.data.reader import iter_shard
from crm.core.records import NO_TOPIC, PREFERENCES
from data_tools.cli import main
from crm.data.shard import assign_split

# ---------------------------------------------------------------------------------------------
# hand-made inputs


def conv(query: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": query}, {"role": "assistant", "content": answer}]


def train_obj(i: int, **fields) -> dict:
    """A valid training record whose criteria are unique to `i` (so a pool entry names its record)."""
    q = f"question {i}?"
    n_a = 1 + i % 3
    obj = {
        "human_winner": PREFERENCES[i % 3],
        "model_a": conv(q, f"answer a {i}"),
        "model_b": conv(q, f"answer b {i} is longer"),
        "a_criteria": [f"a{i}-{j}" for j in range(n_a)],
        "b_criteria": [f"b{i}-0"],
        "a_broad_criteria_topic": [(i + j) % 7 for j in range(n_a)],
        "b_broad_criteria_topic": [10 + i % 5],
        "idx": i,
    }
    obj.update(fields)
    return obj


def make_test_obj(i: int, **fields) -> dict:
    q = f"test question {i}?"
    obj = {"idx": f"t{i}", "prompt": q, "model_a": conv(q, "yes"), "model_b": conv(q, "no"),
           "criteria": ["is correct", "is short"][: 1 + i % 2], "preference": PREFERENCES[i % 3]}
    obj.update(fields)
    return obj


def bench_obj(i: int, **fields) -> dict:
    obj = {"idx": f"q{i}", "topic": "math", "prompt": f"bench {i}?",
           "responses": {"m1": "one two", "m2": conv(f"bench {i}?", "three")}}
    obj.update(fields)
    return obj


def dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False)


missing_a_criteria = train_obj(900)
del missing_a_criteria["a_criteria"]

# (line text, field named by the error, start of the reason); inserted among the good lines
BAD_TRAIN = [
    ('{"human_winner": "model_a", "model_a": [', "", "bad JSON"),
    (dumps(missing_a_criteria), "a_criteria", "missing field"),
    (dumps(train_obj(901, human_winner="model_c")), "human_winner", "unknown preference 'model_c'"),
    ("[1, 2, 3]", "", "line is list, expected a JSON object"),
    ('"just a string"', "", "line is str, expected a JSON object"),
]


def write_mixed(path: Path, n_good: int = 40) -> dict:
    """Good lines with bad and blank lines among them; returns what a reader must find.

    good: line number -> stripped line text; bad: line number -> (text, field, reason).
    """
    rows: list[tuple[str, object]] = [(dumps(train_obj(i)), ("good",)) for i in range(n_good)]
    for k, (text, field, reason) in enumerate(BAD_TRAIN):
        rows.insert(3 + 7 * k, (text, ("bad", field, reason)))
    rows.insert(5, ("", None))          # blank lines: skipped, never counted
    rows.insert(12, ("   \t", None))
    rows.append(("", None))
    rows[8] = ("  " + rows[8][0] + "  ", rows[8][1])  # surrounding spaces are not part of the record
    good, bad = {}, {}
    for number, (text, kind) in enumerate(rows, start=1):
        if kind is None:
            continue
        if kind[0] == "good":
            good[number] = text.strip()
        else:
            bad[number] = (text.strip(), kind[1], kind[2])
    path.write_text("\n".join(text for text, _ in rows) + "\n", encoding="utf-8")
    return {"good": good, "bad": bad}


@pytest.fixture()
def mixed(tmp_path):
    path = tmp_path / "train.jsonl"
    return path, write_mixed(path)


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def read_members(out_dir: Path, url: str) -> list[tuple[str, bytes]]:
    with tarfile.open(out_dir / url) as tar:
        return [(m.name, tar.extractfile(m).read()) for m in tar if m.isreg()]


def shard_contents(out_dir: Path) -> dict[str, list[tuple[str, dict]]]:
    """shard url -> [(key, record)] read back through the library's own reader."""
    manifest = json.loads((out_dir / "manifest.json").read_text())
    return {s["url"]: list(iter_shard(str(out_dir / s["url"])))
            for split in manifest["splits"].values() for s in split["shards"]}


def tar_files(out_dir: Path) -> set[str]:
    return {p.name for p in out_dir.glob("*.tar")}


# ---------------------------------------------------------------------------------------------
# shard


def test_shard_counts_rejects_and_contents(tmp_path, mixed, capsys):
    src, expect = mixed
    out = tmp_path / "shards"
    code, stdout, _ = run(capsys, "shard", src, out, "--val-fraction", "0.3", "--shard-size", "7")
    assert code == 0  # rejects alone do not fail without --strict
    manifest = json.loads((out / "manifest.json").read_text())
    n_good, n_bad = len(expect["good"]), len(expect["bad"])

    # counts: read = written + rejected, overall and per split; blank lines are not read
    assert manifest["counts"] == {"read": n_good + n_bad, "written": n_good, "rejected": n_bad}
    for split, info in manifest["splits"].items():
        c = info["counts"]
        assert c["read"] == c["written"] + c["rejected"], split
        assert c["written"] == sum(s["records"] for s in info["shards"]), split
    assert set(manifest["splits"]) == {"train", "val"}
    assert all(manifest["splits"][s]["counts"]["written"] > 0 for s in ("train", "val"))
    assert f"{n_good + n_bad} read = {n_good} written + {n_bad} rejected" in stdout
    assert "rejects.jsonl" in stdout

    # rejects.jsonl: one line per rejected line, naming file, line, field, reason, raw text
    rejects = [json.loads(x) for x in (out / "rejects.jsonl").read_text().splitlines()]
    assert len(rejects) == n_bad
    assert {r["line"] for r in rejects} == set(expect["bad"])
    for r in rejects:
        text, field, reason = expect["bad"][r["line"]]
        assert r["file"] == str(src)
        assert r["field"] == field
        assert r["reason"].startswith(reason), r
        assert r["raw"] == text
    per_split_rejects = Counter(r["split"] for r in rejects)
    for split, info in manifest["splits"].items():
        assert info["counts"]["rejected"] == per_split_rejects.get(split, 0)

    # every good line is in exactly one shard, byte for byte, under the key of its line number
    seen: dict[str, bytes] = {}
    for split, info in manifest["splits"].items():
        for s in info["shards"]:
            assert s["url"].startswith(f"{split}-")
            for name, data in read_members(out, s["url"]):
                assert name.endswith(".json")
                key = name[: -len(".json")]
                assert key not in seen, f"{key} in two shards"
                seen[key] = data
    expected = {f"l{n:09d}": text.encode("utf-8") for n, text in expect["good"].items()}
    assert seen == expected
    # ... and the library's reader sees the same samples, parsed
    read_back = {k: obj for recs in shard_contents(out).values() for k, obj in recs}
    assert read_back == {k: json.loads(v) for k, v in expected.items()}

    # shard sizes: no shard over --shard-size, balanced within one record, fewest shards
    for split, info in manifest["splits"].items():
        sizes = [s["records"] for s in info["shards"]]
        assert max(sizes) <= 7 and max(sizes) - min(sizes) <= 1, (split, sizes)
        assert len(sizes) == math.ceil(info["counts"]["written"] / 7), (split, sizes)
    assert tar_files(out) == {s["url"] for i in manifest["splits"].values() for s in i["shards"]}

    # the split follows the key's hash, rejects included
    for split, info in manifest["splits"].items():
        for s in info["shards"]:
            for key, _ in iter_shard(str(out / s["url"])):
                assert assign_split(0, key, 0.3) == split
    for r in rejects:
        assert assign_split(0, f"l{r['line']:09d}", 0.3) == r["split"]


def test_shard_ties_counted_per_shard(tmp_path, mixed, capsys):
    src, _ = mixed
    out = tmp_path / "shards"
    assert run(capsys, "shard", src, out, "--val-fraction", "0.3", "--shard-size", "5")[0] == 0
    manifest = json.loads((out / "manifest.json").read_text())
    contents = shard_contents(out)
    total_ties = 0
    for info in manifest["splits"].values():
        for s in info["shards"]:
            ties = sum(obj["human_winner"] == "tie" for _, obj in contents[s["url"]])
            assert s["ties"] == ties, s
            assert s["records"] == len(contents[s["url"]])
            total_ties += ties
    assert total_ties == sum(i % 3 == 2 for i in range(40)) > 0
    # the stream's reader agrees
    loaded = load_manifest(out)
    assert [sh.ties for sh in loaded.shards("train")] == [
        s["ties"] for s in manifest["splits"]["train"]["shards"]]


def test_shard_criteria_pool_is_train_split_with_aligned_topics(tmp_path, mixed, capsys):
    src, _ = mixed
    out = tmp_path / "shards"
    assert run(capsys, "shard", src, out, "--val-fraction", "0.3", "--shard-size", "7")[0] == 0
    manifest = json.loads((out / "manifest.json").read_text())
    contents = shard_contents(out)

    def pairs(split):
        got = []
        for s in manifest["splits"][split]["shards"]:
            for _, obj in contents[s["url"]]:
                got += zip(obj["a_criteria"], obj["a_broad_criteria_topic"])
                got += zip(obj["b_criteria"], obj["b_broad_criteria_topic"])
        return got

    pool = manifest["criteria_pool"]
    assert len(pool["criteria"]) == len(pool["topics"])
    pooled = list(zip(pool["criteria"], pool["topics"]))
    assert len(pooled) == len(set(pooled))
    assert set(pooled) == set(pairs("train"))
    val = set(pairs("val"))
    assert val and not val & set(pooled)  # held-out criteria never leak into the noise pool
    # rejected lines contribute nothing either
    assert not any(c.startswith(("a900", "b900", "a901", "b901")) for c in pool["criteria"])
    assert load_manifest(out).criteria_pool.as_dict() == pool


def test_shard_is_deterministic_per_seed(tmp_path, mixed, capsys):
    src, _ = mixed
    dirs = {name: tmp_path / name for name in ("a", "b", "c")}
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        assert run(capsys, "shard", src, dirs[name], "--seed", seed, "--val-fraction", "0.3",
                   "--shard-size", "6")[0] == 0
    a, b, c = ((d / "manifest.json").read_text() for d in dirs.values())
    assert a == b
    assert tar_files(dirs["a"]) == tar_files(dirs["b"])
    for name in tar_files(dirs["a"]):
        assert (dirs["a"] / name).read_bytes() == (dirs["b"] / name).read_bytes(), name
    assert (dirs["a"] / "rejects.jsonl").read_bytes() == (dirs["b"] / "rejects.jsonl").read_bytes()

    def split_keys(d):
        return {split: sorted(k for recs in (list(iter_shard(str(d / s["url"])))
                                             for s in info["shards"]) for k, _ in recs)
                for split, info in json.loads((d / "manifest.json").read_text())["splits"].items()}

    assert a != c
    assert split_keys(dirs["a"])["val"] != split_keys(dirs["c"])["val"]
    assert json.loads(c)["seed"] == 4


def test_shard_strict(tmp_path, mixed, capsys):
    src, expect = mixed
    assert run(capsys, "shard", "--strict", src, tmp_path / "s1")[0] == 1
    clean = tmp_path / "clean.jsonl"
    clean.write_text("".join(text + "\n" for text in expect["good"].values()), encoding="utf-8")
    code, stdout, _ = run(capsys, "shard", "--strict", clean, tmp_path / "s2")
    assert code == 0
    assert (tmp_path / "s2" / "rejects.jsonl").read_text() == ""
    assert "0 rejected" in stdout


def test_shard_missing_input_is_one_line(tmp_path, capsys):
    missing = tmp_path / "nope.jsonl"
    code, stdout, stderr = run(capsys, "shard", missing, tmp_path / "out")
    assert code == 2
    assert len(stderr.strip().splitlines()) == 1
    assert str(missing) in stderr and "Traceback" not in stderr
    assert not (tmp_path / "out" / "manifest.json").exists()
    # OUT_DIR an existing file (the user's data, given last by a slip): what is wrong, not errno 17
    mine = tmp_path / "mine.jsonl"
    mine.write_text(dumps(train_obj(1)) + "\n")
    for out, where in ((mine, "is a file"), (mine / "shards", f"is under a file ({mine})")):
        code, _, stderr = run(capsys, "shard", mine, out)
        assert code == 2 and stderr.strip().splitlines() == [
            f"crm-data shard: {out} {where}, not a directory: OUT_DIR is the folder the shards, "
            "manifest.json and rejects.jsonl go in; give a new directory or an existing one"]
    assert mine.read_text() == dumps(train_obj(1)) + "\n"


def test_shard_failed_rerun_leaves_earlier_output_consistent(tmp_path, mixed, capsys):
    src, expect = mixed
    out = tmp_path / "shards"
    assert run(capsys, "shard", src, out, "--val-fraction", "0.3")[0] == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    code, _, stderr = run(capsys, "shard", src, tmp_path / "typo.jsonl", out)
    assert code == 2 and "typo.jsonl" in stderr
    # the manifest still describes what is on disk, and rejects.jsonl still matches its counts
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # no .tmp left behind either
    assert len((out / "rejects.jsonl").read_text().splitlines()) == len(expect["bad"])


def test_shard_rerun_with_fewer_records_leaves_no_stale_shards(tmp_path, mixed, capsys):
    src, _ = mixed
    out = tmp_path / "shards"
    assert run(capsys, "shard", src, out, "--val-fraction", "0.3", "--shard-size", "3")[0] == 0
    many = tar_files(out)
    small = tmp_path / "small.jsonl"
    small.write_text("".join(dumps(train_obj(i)) + "\n" for i in range(5)), encoding="utf-8")
    assert run(capsys, "shard", small, out, "--val-fraction", "0.3", "--shard-size", "3",
               "--overwrite")[0] == 0
    manifest = json.loads((out / "manifest.json").read_text())
    listed = {s["url"] for info in manifest["splits"].values() for s in info["shards"]}
    assert tar_files(out) == listed
    assert len(listed) < len(many)
    assert not list(out.glob("*.tmp"))
    keys = [k for recs in shard_contents(out).values() for k, _ in recs]
    assert sorted(keys) == [f"l{n:09d}" for n in range(1, 6)]
    assert manifest["counts"] == {"read": 5, "written": 5, "rejected": 0}
    assert (out / "rejects.jsonl").read_text() == ""


def test_shard_multiple_inputs_get_distinct_keys(tmp_path, mixed, capsys):
    src, expect = mixed
    copy = tmp_path / "copy.jsonl"
    copy.write_bytes(src.read_bytes())  # identical lines: only the file tells them apart
    out = tmp_path / "shards"
    assert run(capsys, "shard", src, copy, out, "--val-fraction", "0.3", "--shard-size", "9")[0] == 0
    manifest = json.loads((out / "manifest.json").read_text())
    n_good, n_bad = len(expect["good"]), len(expect["bad"])
    assert manifest["counts"] == {"read": 2 * (n_good + n_bad), "written": 2 * n_good,
                                  "rejected": 2 * n_bad}
    assert manifest["inputs"] == [str(src), str(copy)]
    keys = [k for recs in shard_contents(out).values() for k, _ in recs]
    assert len(keys) == len(set(keys)) == 2 * n_good
    assert set(keys) == {f"f{fi}-{n:09d}" for fi in (0, 1) for n in expect["good"]}
    assert all("." not in k for k in keys)  # webdataset cuts keys at the first dot
    rejects = [json.loads(x) for x in (out / "rejects.jsonl").read_text().splitlines()]
    assert Counter(r["file"] for r in rejects) == {str(src): n_bad, str(copy): n_bad}


def readme_obj(i: int, **fields) -> dict:
    """A README-format record ({idx, prompt, model_a, model_b, criteria, preference}) with texts
    of its own: every 5th a tie, every 7th two turns, every 3rd in another script."""
    q = ["question {}?", "question {} en français ?", "问题 {}？"][i % 3].format(i)
    a, b = conv(q, f"answer a {i}"), conv(q, f"answer b {i}")
    if i % 7 == 6:
        a += [{"role": "user", "content": "and?"}, {"role": "assistant", "content": "more a"}]
        b += [{"role": "user", "content": "and?"}, {"role": "assistant", "content": "more b"}]
    obj = {"idx": f"r{i}", "prompt": q, "model_a": a, "model_b": b,
           "criteria": [f"c{i}-{j}" for j in range(1 + i % 3)],
           "preference": "tie" if i % 5 == 4 else ("model_a", "model_b")[i % 2]}
    obj.update(fields)
    return obj


no_prompt = readme_obj(903)
del no_prompt["prompt"]
BAD_README = [
    ('{"idx": "r900", "prompt": ', "", "bad JSON: Expecting value at column 26"),
    (dumps(readme_obj(901, preference="model_c")), "preference",
     "unknown preference 'model_c', expected one of model_a, model_b, tie"),
    (dumps(readme_obj(902, criteria=[])), "criteria", "empty criteria list"),
    (dumps(no_prompt), "prompt", "missing field"),
    ("[1, 2]", "", "line is list, expected a JSON object"),
    (dumps(readme_obj(904, model_b=[{"role": "user", "content": "question 904?"}])), "model_b",
     "no assistant message"),
]


def write_readme_file(path: Path, n_good: int = 30) -> dict:
    """Good README-format lines with BAD_README among them: good {line: text}, bad {line: (field,
    reason)}."""
    rows = [(dumps(readme_obj(i)), None) for i in range(n_good)]
    for k, (text, field, reason) in enumerate(BAD_README):
        rows.insert(2 + 5 * k, (text, (field, reason)))
    path.write_text("".join(text + "\n" for text, _ in rows), encoding="utf-8")
    good = {n: text for n, (text, bad) in enumerate(rows, start=1) if bad is None}
    bad = {n: bad for n, (_, bad) in enumerate(rows, start=1) if bad is not None}
    return {"good": good, "bad": bad}


@pytest.mark.parametrize("fmt", [[], ["--format", "test"]], ids=["detected", "named"])
def test_shard_readme_format_writes_every_good_line_and_rejects_exactly_the_bad(tmp_path, capsys, fmt):
    src = tmp_path / "readme.jsonl"
    expect = write_readme_file(src)
    out = tmp_path / "shards"
    code, stdout, stderr = run(capsys, "shard", src, out, "--val-fraction", "0.25", "--shard-size", "8", *fmt)
    assert code == 0
    n_good, n_bad = len(expect["good"]), len(expect["bad"])
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"] == {"read": n_good + n_bad, "written": n_good, "rejected": n_bad}
    assert f"{n_good + n_bad} read = {n_good} written + {n_bad} rejected" in stdout
    # every reject, as file:line: field: reason, on stderr and in rejects.jsonl
    printed = [ln for ln in stderr.splitlines() if ln.startswith(f"{src}:")]
    assert len(printed) == n_bad
    for ln, (number, (field, reason)) in zip(printed, sorted(expect["bad"].items())):
        assert ln == f"{src}:{number}: " + (f"{field}: " if field else "") + reason
    rejects = [json.loads(x) for x in (out / "rejects.jsonl").read_text().splitlines()]
    assert {r["line"]: (r["field"], r["reason"]) for r in rejects} == expect["bad"]
    # every good line once, as it was; every shard counts its one-sided records and ties
    contents = shard_contents(out)
    members = {k: obj for recs in contents.values() for k, obj in recs}
    assert members == {f"l{n:09d}": json.loads(t) for n, t in expect["good"].items()}
    for info in manifest["splits"].values():
        for s in info["shards"]:
            objs = [obj for _, obj in contents[s["url"]]]
            assert s["one_sided"] == s["records"] == len(objs)
            assert s["ties"] == sum(o["preference"] == "tie" for o in objs)
    # the pool holds the train split's README criteria, under no topic
    train_criteria = {c for s in manifest["splits"]["train"]["shards"]
                      for _, o in contents[s["url"]] for c in o["criteria"]}
    pool = manifest["criteria_pool"]
    assert set(pool["criteria"]) == train_criteria and set(pool["topics"]) == {NO_TOPIC}


def test_shard_refuses_a_file_of_mixed_formats_and_a_bench_file(tmp_path, capsys):
    mixed_file = tmp_path / "mixed.jsonl"
    lines = [dumps(readme_obj(i)) for i in range(4)] + [dumps(train_obj(4)), dumps(readme_obj(5))]
    mixed_file.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "shards"
    code, _, stderr = run(capsys, "shard", mixed_file, out)
    assert code == 2
    assert stderr.strip() == (f"crm-data shard: {mixed_file}:5: a train-format record in a "
                              "test-format file (the format of line 1): a file holds one format")
    assert not (out / "manifest.json").exists() and not list(out.glob("*.tmp"))
    # a named format the file does not have stops at its first line
    readme = tmp_path / "readme.jsonl"
    readme.write_text(dumps(readme_obj(0)) + "\n", encoding="utf-8")
    code, _, stderr = run(capsys, "shard", "--format", "train", readme, out)
    assert code == 2 and f"{readme}:1: a test-format record where train-format records are wanted" in stderr
    bench = tmp_path / "bench.jsonl"
    bench.write_text(dumps(bench_obj(0)) + "\n", encoding="utf-8")
    code, _, stderr = run(capsys, "shard", bench, out)
    assert code == 2
    assert f"{bench}:1: a bench-format record (prompt + responses) is not training data" in stderr
    # validate says the same of a mixed file, after the lines before it
    code, _, stderr = run(capsys, "validate", mixed_file)
    assert code == 2 and f"{mixed_file}:5: a train-format record" in stderr


def test_readme_and_training_files_shard_together(tmp_path, mixed, capsys):
    src, expect = mixed
    readme = tmp_path / "readme.jsonl"
    readme.write_text("".join(dumps(readme_obj(i)) + "\n" for i in range(10)), encoding="utf-8")
    out = tmp_path / "shards"
    assert run(capsys, "shard", src, readme, out, "--val-fraction", "0")[0] == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"]["written"] == len(expect["good"]) + 10
    (info,) = manifest["splits"]["train"]["shards"]
    assert info["one_sided"] == 10
    s = stats_out(capsys, out)["train"]
    assert s["records"] == len(expect["good"]) + 10
    # a README record counts its one side (a tie's criteria once)
    sides = Counter(len(obj["a_criteria"]) for obj in map(json.loads, expect["good"].values()))
    sides += Counter(len(obj["b_criteria"]) for obj in map(json.loads, expect["good"].values()))
    sides += Counter(1 + i % 3 for i in range(10))
    assert s["criteria_per_side"] == {str(k): v for k, v in sorted(sides.items())}


# ---------------------------------------------------------------------------------------------
# validate


def test_validate_reports_every_bad_line(mixed, capsys):
    src, expect = mixed
    code, stdout, stderr = run(capsys, "validate", src)
    assert code == 1
    lines = stdout.splitlines()
    assert len(lines) == len(expect["bad"])
    for out_line, (number, (_, field, reason)) in zip(lines, sorted(expect["bad"].items())):
        where = f"{src}:{number}: "
        assert out_line.startswith(where), out_line
        rest = out_line[len(where):]
        assert rest.startswith(f"{field}: {reason}" if field else reason), out_line
    n = len(expect["good"]) + len(expect["bad"])
    assert f"{n} lines, {len(expect['good'])} valid, {len(expect['bad'])} rejected" in stderr


def test_validate_clean_train_file(tmp_path, capsys):
    path = tmp_path / "ok.jsonl"
    path.write_text("".join(dumps(train_obj(i)) + "\n" for i in range(4)), encoding="utf-8")
    code, stdout, stderr = run(capsys, "validate", path)
    assert code == 0 and stdout == ""
    assert "4 valid, 0 rejected" in stderr


def test_validate_detects_test_format(tmp_path, capsys):
    path = tmp_path / "test.jsonl"
    path.write_text("".join(dumps(make_test_obj(i)) + "\n" for i in range(3)), encoding="utf-8")
    assert run(capsys, "validate", path)[0] == 0
    no_criteria = make_test_obj(5)
    del no_criteria["criteria"]
    with path.open("a", encoding="utf-8") as f:
        f.write(dumps(make_test_obj(3, preference="model_c")) + "\n")
        f.write(dumps(no_criteria) + "\n")
        f.write(dumps(make_test_obj(4, criteria="['repr', 'list']")) + "\n")  # accepted repr string
        f.write(dumps(make_test_obj(6, criteria="__import__('os')")) + "\n")  # never eval'd
    code, stdout, _ = run(capsys, "validate", path)
    assert code == 1
    assert stdout.splitlines() == [
        f"{path}:4: preference: unknown preference 'model_c', expected one of model_a, model_b, tie",
        f"{path}:5: criteria: missing field",
        f"{path}:7: criteria: string is not a list literal",
    ]  # validated as test records: no complaint about a missing human_winner


def test_validate_detects_bench_format(tmp_path, capsys):
    path = tmp_path / "bench.jsonl"
    path.write_text("".join(dumps(bench_obj(i)) + "\n" for i in range(3)), encoding="utf-8")
    assert run(capsys, "validate", path)[0] == 0
    with path.open("a", encoding="utf-8") as f:
        f.write(dumps(bench_obj(3, responses=["not", "a", "dict"])) + "\n")
        f.write(dumps(bench_obj(4, responses={"m1": ""})) + "\n")
    code, stdout, _ = run(capsys, "validate", path)
    assert code == 1
    assert stdout.splitlines() == [
        f"{path}:4: responses: expected an object of model name -> response, got list",
        f"{path}:5: responses.m1: empty string",
    ]


def test_validate_missing_file(tmp_path, capsys):
    code, _, stderr = run(capsys, "validate", tmp_path / "absent.jsonl")
    assert code == 2
    assert len(stderr.strip().splitlines()) == 1 and "absent.jsonl" in stderr


# ---------------------------------------------------------------------------------------------
# stats

# (winner, number of a criteria, number of b criteria, answer words a, answer words b)
STATS_ROWS = [("model_a", 2, 1, 1, 2), ("model_a", 1, 1, 3, 1), ("tie", 3, 2, 2, 2),
              ("model_b", 1, 3, 4, 1)]


def write_stats_input(path: Path) -> None:
    lines = []
    for i, (winner, na, nb, wa, wb) in enumerate(STATS_ROWS):
        q = f"q{i}?"
        lines.append(dumps({
            "human_winner": winner,
            "model_a": conv(q, " ".join(["w"] * wa)), "model_b": conv(q, " ".join(["w"] * wb)),
            "a_criteria": [f"a{i}{j}" for j in range(na)], "b_criteria": [f"b{i}{j}" for j in range(nb)],
            "a_broad_criteria_topic": list(range(na)), "b_broad_criteria_topic": list(range(nb)),
            "topic": "math" if i % 2 else "code"}))
    lines.insert(2, '{"human_winner": "nobody"}')  # one rejected line
    lines.insert(1, "")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def stats_out(capsys, path) -> dict:
    code, stdout, _ = run(capsys, "stats", path)
    assert code == 0
    return json.loads(stdout)


def test_stats_on_jsonl(tmp_path, capsys):
    path = tmp_path / "train.jsonl"
    write_stats_input(path)
    got = stats_out(capsys, path)
    assert list(got) == ["train.jsonl"]
    s = got["train.jsonl"]
    assert s["records"] == 4 and s["rejected"] == 1
    assert s["labels"] == {"model_a": 2, "model_b": 1, "tie": 1}
    assert s["shapes"] == {"decides": s["labels"]}  # no `shape`: the paper's
    # both sides of every pair: sizes a=[2,1,3,1], b=[1,1,2,3]
    assert s["criteria_per_side"] == {"1": 4, "2": 2, "3": 2}
    assert s["response_words"]["max"] == 4
    assert s["messages_per_conversation"] == {"2": 4}
    assert s["topics"] == {"code": 2, "math": 2}


def test_stats_on_test_file(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(dumps(make_test_obj(i)) + "\n" for i in range(5)), encoding="utf-8")
    s = stats_out(capsys, path)["t.jsonl"]
    assert s["records"] == 5 and s["rejected"] == 0
    assert s["labels"] == {"model_a": 2, "model_b": 2, "tie": 1}
    assert s["criteria_per_side"] == {"1": 3, "2": 2}


def test_stats_on_shard_dir(tmp_path, capsys):
    path = tmp_path / "train.jsonl"
    write_stats_input(path)
    out = tmp_path / "shards"
    assert run(capsys, "shard", path, out, "--val-fraction", "0")[0] == 0
    got = stats_out(capsys, out)
    assert list(got) == ["train"]  # the empty val split has no records to describe
    s = got["train"]
    assert s["records"] == 4 and s["rejected"] == 0  # shards hold only valid records
    assert s["labels"] == {"model_a": 2, "model_b": 1, "tie": 1}
    assert s["criteria_per_side"] == {"1": 4, "2": 2, "3": 2}

    # with a held-out split, the splits add up to the file and each matches its own records
    out2 = tmp_path / "shards2"
    big = tmp_path / "big.jsonl"
    big.write_text("".join(dumps(train_obj(i)) + "\n" for i in range(30)), encoding="utf-8")
    assert run(capsys, "shard", big, out2, "--val-fraction", "0.4", "--shard-size", "4")[0] == 0
    got = stats_out(capsys, out2)
    assert set(got) == {"train", "val"}
    manifest = json.loads((out2 / "manifest.json").read_text())
    for split, s in got.items():
        objs = [obj for sh in manifest["splits"][split]["shards"]
                for _, obj in iter_shard(str(out2 / sh["url"]))]
        assert s["records"] == manifest["splits"][split]["counts"]["written"] == len(objs)
        assert s["labels"] == dict(sorted(Counter(o["human_winner"] for o in objs).items()))
        sides = Counter(len(o[k]) for o in objs for k in ("a_criteria", "b_criteria"))
        assert s["criteria_per_side"] == {str(k): v for k, v in sorted(sides.items())}
    assert sum(s["records"] for s in got.values()) == 30


def shaped_obj(i: int) -> dict:
    """train_obj(i) in turn of the paper's shape, a tie record (one list of 2 criteria on both
    sides) and a user's criteria."""
    shape = ("decides", "tie", "user")[i % 3]
    if shape != "tie":
        return train_obj(i, shape=shape, human_winner=("model_a", "model_b")[i // 3 % 2])
    tie = {"criteria": [f"t{i}-0", f"t{i}-1"], "topics": [1, 2]}
    return train_obj(i, shape="tie", human_winner="tie", a_criteria=tie["criteria"],
                     b_criteria=tie["criteria"], a_broad_criteria_topic=tie["topics"],
                     b_broad_criteria_topic=tie["topics"])


def test_stats_counts_records_by_shape_and_label(tmp_path, capsys):
    path = tmp_path / "shaped.jsonl"
    path.write_text("".join(dumps(shaped_obj(i)) + "\n" for i in range(12)), encoding="utf-8")
    expected = Counter((o.get("shape"), o["human_winner"]) for o in map(shaped_obj, range(12)))
    s = stats_out(capsys, path)["shaped.jsonl"]
    assert s["shapes"] == {shape: {label: n for (sh, label), n in sorted(expected.items()) if sh == shape}
                           for shape in ("decides", "tie", "user")}
    assert s["shapes"]["tie"] == {"tie": 4} and s["shapes"]["user"] == {"model_a": 2, "model_b": 2}
    # a tie record's criteria are one list: counted once, as a README-format tie's
    assert s["criteria_per_side"]["2"] == 4 + Counter(1 + i % 3 for i in range(12) if i % 3 != 1)[2]
    out = tmp_path / "shards"
    assert run(capsys, "shard", path, out, "--val-fraction", "0.3")[0] == 0
    splits = stats_out(capsys, out)
    summed = Counter()
    for split in splits.values():
        summed.update({(shape, label): n for shape, labels in split["shapes"].items()
                       for label, n in labels.items()})
    assert summed == expected
    manifest = json.loads((out / "manifest.json").read_text())
    assert sum(sh["ties"] for split in manifest["splits"].values() for sh in split["shards"]) == \
        sum(n for (_, label), n in expected.items() if label == "tie")


def test_stats_missing_path(tmp_path, capsys):
    code, _, stderr = run(capsys, "stats", tmp_path / "nothing")
    assert code == 2 and "nothing" in stderr and len(stderr.strip().splitlines()) == 1
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    code, _, stderr = run(capsys, "stats", empty_dir)
    assert code == 2 and stderr.strip().splitlines() == [
        f"crm-data stats: {empty_dir}: a directory without manifest.json, not a shard dir (crm-data "
        "shard's OUT_DIR): it holds no .jsonl file"]
    (empty_dir / "train.jsonl").write_text(dumps(train_obj(1)) + "\n")
    code, _, stderr = run(capsys, "stats", empty_dir)
    assert code == 2 and stderr.strip().endswith(
        f"not a shard dir (crm-data shard's OUT_DIR): give its data files (train.jsonl: "
        f"{empty_dir / '*.jsonl'})")
    # votes without criteria are counted as 40 rejected records no more: crm-data criteria is named
    votes = tmp_path / "votes.jsonl"
    votes.write_text(json.dumps({"prompt": "q", "chosen": conv("q", "a"), "rejected": conv("q", "b")})
                     + "\n")
    arena = tmp_path / "arena.csv"
    arena.write_text("id,prompt,response_a,response_b,winner_model_a,winner_model_b,winner_tie\n")
    for path, why in ((votes, "votes (chosen-rejected format), not training records: `crm-data "
                               f"criteria {votes} OUT_DIR"),
                      (arena, "votes in CSV go to `crm-data criteria`")):
        code, stdout, stderr = run(capsys, "stats", path)
        assert code == 2 and stdout == "" and len(stderr.strip().splitlines()) == 1
        assert stderr.startswith(f"crm-data stats: {path}:1: ") and why in stderr, stderr


# ---------------------------------------------------------------------------------------------
# the installed entry point


# ---------------------------------------------------------------------------------------------
# flip


def test_flip_swaps_every_records_criteria_keeps_the_vote_and_rejects_exactly_the_bad(tmp_path, mixed,
                                                                                     capsys):
    path, expected = mixed
    out = tmp_path / "flipped.jsonl"
    code, stdout, _ = run(capsys, "flip", path, out)
    good, bad = expected["good"], expected["bad"]
    assert code == 1  # rejects: exit 1, as validate
    assert f"{len(good) + len(bad)} read = {len(good)} written to {out} (criteria swapped) + {len(bad)} " \
           f"rejected" in stdout
    flipped = [json.loads(x) for x in out.read_text().splitlines()]
    for before, after in zip((json.loads(t) for t in good.values()), flipped, strict=True):
        assert (after["a_criteria"], after["b_criteria"]) == (before["b_criteria"], before["a_criteria"])
        assert (after["a_broad_criteria_topic"], after["b_broad_criteria_topic"]) == \
            (before["b_broad_criteria_topic"], before["a_broad_criteria_topic"])
        rest = lambda r: {k: v for k, v in r.items() if "criteria" not in k}  # noqa: E731
        assert rest(after) == rest(before)  # the vote, the conversations and the id as they were
    rejects = [json.loads(x) for x in (tmp_path / "flipped.jsonl.rejects.jsonl").read_text().splitlines()]
    assert [(r["line"], r["field"]) for r in rejects] == [(n, field) for n, (_, field, _) in bad.items()]

    twice = tmp_path / "twice.jsonl"
    assert run(capsys, "flip", out, twice)[0] == 0
    assert [json.loads(x) for x in twice.read_text().splitlines()] == [json.loads(t) for t in good.values()]


def test_flip_refuses_readme_format_and_its_own_input(tmp_path, capsys):
    readme = tmp_path / "readme.jsonl"
    readme.write_text(dumps(make_test_obj(1)) + "\n")
    code, _, err = run(capsys, "flip", readme, tmp_path / "out.jsonl")
    assert code == 2 and "a test-format record where train-format records are wanted" in err
    assert not list(tmp_path.glob("out.jsonl*"))  # nothing half-written
    code, _, err = run(capsys, "flip", readme, readme)
    assert code == 2 and "the output would overwrite the input it reads" in err

    # `flip A B` meant as two inputs: B, the user's data, is not replaced without --overwrite
    src, theirs = tmp_path / "train.jsonl", tmp_path / "theirs.jsonl"
    src.write_text(dumps(train_obj(1)) + "\n")
    theirs.write_text(dumps(train_obj(2)) + "\n")
    code, stdout, err = run(capsys, "flip", src, theirs)
    assert code == 2 and stdout == "" and err.strip().splitlines() == [
        f"crm-data flip: {theirs} exists and is not an output of crm-data flip (no "
        f"{theirs}.rejects.jsonl): give a new OUT.jsonl, or --overwrite to replace it"]
    assert theirs.read_text() == dumps(train_obj(2)) + "\n"
    assert run(capsys, "flip", src, theirs, "--overwrite")[0] == 0
    assert json.loads(theirs.read_text())["b_criteria"] == train_obj(1)["a_criteria"]
    assert run(capsys, "flip", src, theirs)[0] == 0  # its own output now: a re-run replaces it


def test_installed_crm_data_script(mixed):
    src, expect = mixed
    script = Path(sys.executable).with_name("crm-data")
    assert script.exists(), script
    proc = subprocess.run([str(script), "validate", str(src)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert len(proc.stdout.splitlines()) == len(expect["bad"])
    assert "Traceback" not in proc.stderr
    assert f"{len(expect['good'])} valid, {len(expect['bad'])} rejected" in proc.stderr


def test_demo_writes_voted_and_user_pairs(tmp_path, capsys):
    code, out, _ = run(capsys, "demo", tmp_path, "--n-train", 30, "--n-user", 20, "--n-test", 4,
                       "--n-bench", 2)
    assert code == 0 and f"{tmp_path}/train.jsonl: 50 lines" in out
    shapes = [json.loads(line).get("shape", "decides") for line in open(tmp_path / "train.jsonl")]
    assert shapes.count("user") == 20
