"""A researcher's second day (issue 44): nothing of theirs replaced silently, and every common
mistake answered in one line with what to do (docs/DESIGN.md section 7).

Most commands run in process (their `main()` with sys.argv set, `helpers.refused`); a command
whose own start is what is tested runs as its console script, one process each.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import refused, train_dict

import crm.cli.eval
import crm.cli.leaderboard
import crm.cli.train
from crm.cli.train import keep_earlier_figures
from crm.evaluation.leaderboard import select
from data_tools.cli import main as crm_data

BIN = Path(sys.executable).parent
BENCH = [{"idx": str(i), "topic": "cooking", "prompt": f"q{i}",
          "responses": {"base": f"b{i}", "other": f"o{i}"}} for i in range(3)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture
def root(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("CRM_ROOT", str(tmp_path))
    return tmp_path


# -- item 2: nothing replaced silently ------------------------------------------------------------

def earlier_record(run_dir: Path) -> dict[str, bytes]:
    """An earlier run's record (.hydra/, crm/cli/record.py) planted in `run_dir`: its files' bytes."""
    (run_dir / ".hydra").mkdir(parents=True)
    for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
        (run_dir / ".hydra" / name).write_text(f"# the earlier run's {name}\n")
    return record_of(run_dir)


def record_of(run_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((run_dir / ".hydra").iterdir())}


def test_crm_leaderboard_refuses_to_replace_another_checkpoints_board(root):
    """The console script: the refusal comes before any model loads, in one line naming name=;
    the earlier board's record (.hydra/) is not rewritten with the refused run's config."""
    bench = write_jsonl(root / "bench.jsonl", BENCH)
    board = root / "outputs" / "leaderboard" / "default"
    record = earlier_record(board)
    selection = select(bench, "base")  # the same board, another checkpoint's
    (board / "leaderboard.json").write_text(json.dumps({
        "model": "outputs/a/export", "bench": str(bench), "baseline": "base",
        "topics": list(selection.topics), "models": list(selection.models),
        "boards": [{"criteria": ["short"]}]}))
    before = (board / "leaderboard.json").read_bytes()
    done = subprocess.run([str(BIN / "crm-leaderboard"), f"checkpoint={root}", f"bench={bench}",
                           "baseline=base", "criteria=[short]"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "CRM_ROOT": str(root)})
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"crm-leaderboard: {board} holds the results of checkpoint=outputs/a/export (this run: "
        f"checkpoint={root}): give this board its own name= (name=default is taken)"]
    assert (board / "leaderboard.json").read_bytes() == before
    assert record_of(board) == record


def test_crm_data_shard_keeps_other_inputs_shards_and_criterias_rejects(tmp_path):
    """The console script: shards of other inputs, and `crm-data criteria`'s rejects.jsonl, are
    kept unless --overwrite; the same inputs re-shard in place."""
    first = write_jsonl(tmp_path / "first.jsonl", [train_dict(f"k{i}") for i in range(6)])
    second = write_jsonl(tmp_path / "second.jsonl", [train_dict(f"m{i}") for i in range(3)])
    out = tmp_path / "shards"
    criteria_out = tmp_path / "criteria"
    criteria_out.mkdir()
    (criteria_out / "rejects.jsonl").write_text('{"stage": "answer"}\n')
    script = (f"set -u; d={BIN / 'crm-data'}; $d shard {first} {out} >/dev/null || exit 10; "
              f"$d shard {first} {out} >/dev/null || exit 11; "
              f"$d shard {second} {out}; echo rc=$?; $d shard {second} {criteria_out}; echo rc=$?; "
              f"$d shard {second} {out} --overwrite >/dev/null || exit 12")
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["rc=2", "rc=2"]
    assert done.stderr.strip().splitlines() == [
        f"crm-data shard: {out} holds the results of inputs=[{first}] (this run: inputs=[{second}]): "
        "shard into another OUT_DIR, or --overwrite to replace them",
        f"crm-data shard: {criteria_out / 'rejects.jsonl'} exists and is not an output of crm-data "
        f"shard (no {criteria_out / 'manifest.json'}): shard into another OUT_DIR (`crm-data "
        "criteria` writes a rejects.jsonl beside its train.jsonl), or --overwrite to replace it"]
    assert (criteria_out / "rejects.jsonl").read_text() == '{"stage": "answer"}\n'
    assert json.loads((out / "manifest.json").read_text())["inputs"] == [str(second)]


def test_a_finished_run_rerun_keeps_the_figures_of_the_process_that_trained(tmp_path):
    earlier = tmp_path / "metrics.json"
    measured = {"global_step": 8, "throughput": {"tokens_per_s": 512.0, "step": 8},
                "per_rank_memory": [{"rank": 0, "param_bytes": 10, "optimizer_bytes": 20}]}
    earlier.write_text(json.dumps({"train": measured}))
    rerun = {"global_step": 8, "throughput": {}, "per_rank_memory": []}
    keep_earlier_figures(rerun, earlier)
    assert rerun["throughput"] == measured["throughput"]
    assert rerun["per_rank_memory"] == measured["per_rank_memory"]
    assert rerun["figures_from"].startswith("an earlier process")
    longer = {"global_step": 12, "throughput": {}, "per_rank_memory": []}
    keep_earlier_figures(longer, earlier)  # a run extended past the earlier one measured anew
    assert longer == {"global_step": 12, "throughput": {}, "per_rank_memory": []}


# -- item 3: each mistake one line saying what to do ----------------------------------------------

def test_crm_data_shard_names_what_it_was_given_instead_of_json_lines(tmp_path, capsys):
    records = [train_dict(f"k{i}") for i in range(4)]
    votes = write_jsonl(tmp_path / "votes.jsonl", [
        {"prompt": "q", "chosen": [{"role": "user", "content": "q"}], "rejected": []}] * 3)
    pretty = tmp_path / "pretty.json"
    pretty.write_text(json.dumps(records, indent=2))
    folder = tmp_path / "data"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", records)
    (folder / "README.md").write_text("# my data\n\nfour records\n")
    out = str(tmp_path / "shards")
    expected = {
        str(votes): f"crm-data shard: {votes}:1: votes (chosen-rejected format), not training "
                    f"records: `crm-data criteria {votes} OUT_DIR --base-url URL --model NAME` "
                    "writes the criteria under which each side wins (docs/DATA_PIPELINE.md)",
        str(pretty): f"crm-data shard: {pretty}:1: a JSON array, not JSON lines: write one JSON "
                     "object per line (`jq -c '.[]' FILE > FILE.jsonl` converts an array)",
        str(folder): f"crm-data shard: {folder}: a directory, not a JSONL file: give its data "
                     f"files (a.jsonl: {folder / '*.jsonl'})",
        str(folder / "README.md"): f"crm-data shard: {folder / 'README.md'}:1: not JSON lines (the "
                                   "line reads '# my data'): crm-data reads JSONL files (a "
                                   "README or notes caught by a glob? give the .jsonl files only)",
    }
    for given, line in expected.items():
        assert crm_data(["shard", given, out]) == 2, given
        assert capsys.readouterr().err.strip().splitlines() == [line]
    assert not Path(out).exists()


def test_a_gzip_file_is_read_as_its_lines(tmp_path, capsys):
    import gzip

    packed = tmp_path / "mine.jsonl.gz"
    with gzip.open(packed, "wt", encoding="utf-8") as handle:
        handle.writelines(json.dumps(train_dict(f"k{i}")) + "\n" for i in range(5))
    assert crm_data(["validate", str(packed)]) == 0
    assert crm_data(["shard", str(packed), str(tmp_path / "shards"), "--val-fraction", "0"]) == 0
    manifest = json.loads((tmp_path / "shards" / "manifest.json").read_text())
    assert manifest["counts"] == {"read": 5, "written": 5, "rejected": 0}


def test_crm_eval_says_which_path_to_give_and_what_a_test_file_holds(root, capsys, monkeypatch):
    run_dir = root / "outputs" / "mine"
    (run_dir / "export").mkdir(parents=True)
    (run_dir / "export" / "crm.json").write_text("{}")
    (run_dir / "checkpoints").mkdir()
    (run_dir / "checkpoints" / "last.ckpt").write_bytes(b"weights")
    test = write_jsonl(root / "test.jsonl", [{"idx": 0, "prompt": "q", "criteria": ["short"],
                                              "preference": "model_a",
                                              **{k: train_dict("k")[k] for k in ("model_a", "model_b")}}])
    for given, what in ((run_dir, "a run dir"), (run_dir / "checkpoints", "a run's checkpoints dir")):
        line = refused(capsys, monkeypatch, crm.cli.eval.main, "crm-eval", f"checkpoint={given}",
                       f"data.test=[{test}]", f"name=n{len(what)}")
        assert line == (f"crm-eval: checkpoint={given}: {what}, not a checkpoint: give "
                        f"checkpoint={run_dir / 'export'} (the export of the best checkpoint) or "
                        f"checkpoint={run_dir / 'checkpoints' / 'last.ckpt'}")
    (run_dir / "export" / "model.safetensors").write_bytes(b"weights")
    for given, what in ((test, "a file that is not a checkpoint crm-train wrote (a .ckpt, torch's zip "
                               "archive): give the export dir crm-train writes, outputs/<name>/export, "
                               "or one of its checkpoints"),
                        (run_dir / "export" / "model.safetensors",
                         "a file of an export directory: give the directory, "
                         f"checkpoint={run_dir / 'export'}")):
        line = refused(capsys, monkeypatch, crm.cli.eval.main, "crm-eval", f"checkpoint={given}",
                       f"data.test=[{test}]", f"name=f{len(what)}")  # unpickled, it was a traceback
        assert line == f"crm-eval: checkpoint={given}: {what}"
    training = write_jsonl(root / "train.jsonl", [train_dict("k0")])
    line = refused(capsys, monkeypatch, crm.cli.eval.main, "crm-eval",
                   f"checkpoint={run_dir / 'export'}", f"data.test=[{training}]")
    assert line == (f"crm-eval: {training}:1: a train-format record where test-format records "
                    "are wanted (the README format: idx, prompt, model_a, model_b, criteria, "
                    "preference; docs/DESIGN.md section 3.1): this file is not one")


def test_a_run_dir_that_cannot_be_made_under_crm_root_is_one_line(tmp_path, capsys, monkeypatch):
    """Hydra makes the run dir before the command starts: a CRM_ROOT under a file (as root in a
    container no directory is unwritable) is a setup error, not a traceback."""
    a_file = tmp_path / "notes.txt"
    a_file.write_text("")
    monkeypatch.setenv("CRM_ROOT", str(a_file / "runs"))
    line = refused(capsys, monkeypatch, crm.cli.leaderboard.main, "crm-leaderboard",
                   f"checkpoint={tmp_path}", f"bench={tmp_path}", "criteria=[short]")
    assert line.startswith(f"crm-leaderboard: {a_file / 'runs'}")
    assert line.endswith(f": the run dir cannot be made under CRM_ROOT={a_file / 'runs'}: set "
                         "CRM_ROOT (or hydra.run.dir=) to a directory you can write")


def test_validate_and_stats_count_exact_duplicates(tmp_path, capsys):
    one, other = train_dict("k0"), train_dict("k1")
    reordered = dict(reversed(list(one.items())))  # the same record, its keys in another order
    path = write_jsonl(tmp_path / "mine.jsonl", [one, other, reordered, one])
    assert crm_data(["validate", str(path)]) == 0  # a duplicate is said, not a defect
    out, err = capsys.readouterr()
    assert out.strip().splitlines() == [f"{path}:3: an exact duplicate of line 1 (and 1 more "
                                        "lines: 4)"]
    assert err.strip() == (f"{path}: 4 lines, 4 valid, 0 rejected; 2 valid lines repeat an "
                           "earlier line exactly")
    assert crm_data(["stats", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["mine.jsonl"]["duplicates"] == 2
    shards = tmp_path / "shards"
    assert crm_data(["shard", str(path), str(shards), "--val-fraction", "0.5"]) == 0
    capsys.readouterr()
    assert crm_data(["stats", str(shards)]) == 0
    per_split = json.loads(capsys.readouterr().out)
    assert sum(s["duplicates"] for s in per_split.values()) == 2  # across splits too


def test_a_sweep_value_that_cannot_work_stops_the_sweep_before_job_0_trains(root, capsys,
                                                                              monkeypatch):
    line = refused(capsys, monkeypatch, crm.cli.train.main, "crm-train", "-m",
                   "transform.ties=drop,kepp", "trainer.max_steps=1")
    assert line.startswith("crm-train: sweep job 1 (transform.ties=kepp trainer.max_steps=1), "
                           "checked before job 0 trains: ")
    assert "kepp" in line.split("trains: ", 1)[1]
    assert not list(root.rglob("*.ckpt")) and not (root / ".cache").exists()  # nothing trained


def test_a_sweep_job_the_data_refuses_stops_the_sweep_before_job_0_trains(root, capsys,
                                                                         monkeypatch):
    """README-format shards (criteria + preference) with direction=random in job 1: refused from
    the manifest in job 0's checks, naming job 1, before any tokenizer or step."""
    rows = []
    for i in range(10):
        record = train_dict(f"k{i}")
        rows.append({"idx": i, "prompt": f"question k{i}", "model_a": record["model_a"],
                     "model_b": record["model_b"], "criteria": [f"criterion {i}"],
                     "preference": "model_a"})
    shards = root / "shards"
    assert crm_data(["shard", str(write_jsonl(root / "readme.jsonl", rows)), str(shards),
                     "--val-fraction", "0.2"]) == 0
    capsys.readouterr()
    line = refused(capsys, monkeypatch, crm.cli.train.main, "crm-train", "-m", "data=shards",
                   f"data.path={shards}", "direction=original,random", "trainer.max_steps=1")
    assert line.startswith(f"crm-train: sweep job 1 (data=shards data.path={shards} "
                           "direction=random trainer.max_steps=1), checked before job 0 trains: "
                           "transform direction='random' shows the losing side's criteria")
    assert not list(root.rglob("tokenizer*")) and not list(root.rglob("*.ckpt"))


def test_files_of_different_topic_tables_are_not_sharded_together(tmp_path, capsys):
    from data_tools.topics import topics

    raw = [write_jsonl(tmp_path / f"{name}.jsonl", [train_dict(f"{name}{i}") for i in range(6)])
           for name in ("one", "two")]
    for path, words in zip(raw, (["short", "formal"], ["formal", "short"])):
        rows = [json.loads(x) for x in path.read_text().splitlines()]
        for i, row in enumerate(rows):  # the same criteria, met in another order in each file
            row["a_criteria"], row["b_criteria"] = [words[i % 2]], [words[1 - i % 2]]
        write_jsonl(path, rows)
        topics(path, path, k=2)
    assert crm_data(["shard", str(raw[0]), str(raw[1]), str(tmp_path / "shards")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"crm-data shard: {raw[0]} and {raw[1]} carry topic ids of different "
                           f"tables ({tmp_path / 'one.topics.json'}, {tmp_path / 'two.topics.json'}): "
                           "topic 0 is ")
    assert line.endswith("give them one table: `cat FILES > all.jsonl && crm-data topics all.jsonl "
                         "all.jsonl`, then shard all.jsonl")


def test_crm_train_refuses_at_start_what_would_stop_it_after_training(root, capsys, monkeypatch):
    """Each refused before a tokenizer is trained into the run dir, let alone a step: test files
    that crm-eval would refuse (a training-format file, a missing one), shards without a
    validation record, and a run dir whose checkpoint another data set trained (resume=auto).
    All before `resolve`, which imports the model's libraries (2 s of a refusal's 3.5-5.5:
    benchmarks/results/cli_start_data_checks_*.json)."""
    import torch

    import crm.training.resolve
    from crm.training.resume import resolve_resume

    def not_yet(run, environment=None):
        raise AssertionError("resolve ran before the user's files were read")

    monkeypatch.setattr(crm.training.resolve, "resolve", not_yet)

    mine = write_jsonl(root / "mine.jsonl", [train_dict(f"k{i}") for i in range(8)])
    for out, fraction in (("shards", "0.5"), ("no_val", "0")):
        assert crm_data(["shard", str(mine), str(root / out), "--val-fraction", fraction]) == 0
    capsys.readouterr()
    shards = ["data=shards", f"data.path={root / 'shards'}"]

    def crm_train(*overrides: str) -> str:
        return refused(capsys, monkeypatch, crm.cli.train.main, "crm-train", *overrides)

    assert crm_train(*shards, f"data.test_files=[{mine}]") == (
        f"crm-train: {mine}:1: a train-format record where test-format records are wanted (the "
        "README format: idx, prompt, model_a, model_b, criteria, preference; docs/DESIGN.md "
        "section 3.1): this file is not one")
    assert crm_train(*shards, f"data.test_files=[{root / 'nope.jsonl'}]") == (
        f"crm-train: data.test_files: {root / 'nope.jsonl'}: no such file (test-format JSONL "
        "files, the README format: docs/DESIGN.md section 3.1)")
    line = crm_train("data=shards", f"data.path={root / 'no_val'}")
    assert line.startswith(f"crm-train: data.path={root / 'no_val'}: 0 validation records "
                           "(manifest.json), fewer than the 1 rank(s): re-shard with --val-fraction")
    assert line.endswith("or train without validation: +trainer.limit_val_batches=0 (no val/loss, "
                         "no best checkpoint, no early stopping: the export is the final weights)")

    run_dir = root / "outputs" / "mine"
    record = earlier_record(run_dir)
    last = run_dir / "checkpoints" / "last.ckpt"
    last.parent.mkdir(parents=True)
    torch.save({"crm_config": {"data": {"path": str(root / "other")}}}, last)
    assert crm_train(*shards, "name=mine") == (
        f"crm-train: {last}: trained on data.path={root / 'other'}, and this run's is "
        f"data.path={root / 'shards'}: resume=auto would continue it on other data; give this run "
        f"another name= (a run dir of its own), or resume=false to start over in {run_dir}")
    assert record_of(run_dir) == record  # the earlier run's config, not the refused run's
    assert resolve_resume("auto", run_dir, str(root / "other")) == str(last)  # its own data resumes
    assert not list((root / "outputs").rglob("tokenizer"))  # no run got as far as its tokenizer
