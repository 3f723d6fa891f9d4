"""From the data people hold to a trained CRM, through the installed commands (DATA_PIPELINE.md).

1. README-format records ({idx, prompt, model_a, model_b, criteria, preference}) shard and train;
   a direction that needs the losing side's criteria is refused before training.
2. Votes with ties -> crm-data criteria (tie criteria become tie records) -> topics -> shard ->
   crm-train keeping ties -> an export whose head can say tie, every count checked on the way.
3. End to end (slow): synthetic votes with known criteria, written as the 55k CSV -> crm-data
   criteria (the stub endpoint answers each vote's true criteria) -> topics -> crm-data shard ->
   crm-train (a pointwise CRM), which scores the contradictory test file with its export as crm-eval
   does (one process less), where a model that ignores the criteria scores 0.5 by construction.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from openai_stub import StubLLM
from scorers import run_cli
from vote_files import arena_55k_row, write_csv

import crm.cli.eval
import crm.cli.leaderboard
from crm.cli.train import train
from crm.core.errors import ConfigError
from crm.core.records import Message
from crm.data.demo import write_demo
from data_tools.cli import main as crm_data
from data_tools.criteria import render_response

BIN = Path(sys.executable).parent
# The tiny demo model, small and quick: a few optimizer steps of a few records, no validation.
QUICK = ["model.arch.hidden_size=32", "model.arch.num_hidden_layers=1", "model.arch.head_dim=16",
         "model.arch.intermediate_size=64", "model.vocab_size=512", "micro_batch_size=4",
         "global_batch_size=4", "torch_threads=1", "stream.max_tokens=384", "trainer.max_steps=2",
         "val_every_n_steps=100", "save_every_n_steps=100", "optim.warmup_steps=0", "logger=none",
         "trainer.enable_progress_bar=false", "export=false", "evaluate=false"]


def command(*args, root: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "CRM_ROOT": str(root), "OMP_NUM_THREADS": "1"}
    cmd = [str(BIN / args[0]), *map(str, args[1:])]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.usefixtures("one_thread")  # tests/conftest.py: the in-process refusal sets torch_threads=1
def test_readme_format_shards_and_trains(tmp_path):
    raw = tmp_path / "raw"
    write_demo(raw, n_train=10, n_test=40, n_bench=1)
    readme = raw / "test" / "in_distribution.jsonl"  # the README's format: criteria + preference
    done = command("crm-data", "shard", readme, tmp_path / "shards", "--val-fraction", "0.2", root=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "40 read = 40 written + 0 rejected" in done.stdout
    data = ["data=shards", f"data.path={tmp_path / 'shards'}"]
    # The default direction (the curriculum: then random) needs the losing side's criteria: refused
    # before training (in process; a ConfigError's one-line exit is tests/training/test_train.py's).
    with pytest.raises(ConfigError, match="transform direction='random' shows the losing side's "
                                          "criteria, but the data holds README-format records"):
        run_cli("train", train, [*data, *QUICK, f"paths.root_dir={tmp_path}"], tmp_path / "refused")
    done = command("crm-train", *data, *QUICK, "direction=original", "noise=random", "name=readme",
                   root=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads((tmp_path / "outputs" / "readme" / "metrics.json").read_text())
    assert metrics["train"]["global_step"] == 2


@pytest.mark.usefixtures("one_thread")
def test_tie_votes_go_from_votes_to_an_export_that_can_say_tie(tmp_path, capsys):
    # 24 votes, winners cycling a, b, tie; the stub's tie criteria are the words both answers hold,
    # so every vote has some but the last, a tie vote whose answers share no word: rejected.
    rows = [arena_55k_row(i, [f"How long for egg {i}?"], [f"Boil it for {i} minutes."],
                          ["Ask a chef." if i == 23 else f"Steam it for {i} minutes."],
                          ("model_a", "model_b", "tie")[i % 3]) for i in range(24)]
    data, shards = tmp_path / "data", tmp_path / "shards"
    with StubLLM() as stub:
        assert crm_data(["criteria", str(write_csv(tmp_path / "votes.csv", rows)), str(data),
                         "--base-url", stub.url, "--model", "stub", "--k", "4", "--no-progress"]) == 0
    summary = json.loads((data / "summary.json").read_text())
    # 16 decisive votes, each with its tie record; 7 of the 8 tie votes, each as its tie record
    assert (summary["read"], summary["written"], summary["rejected"]) == (24, 23, 1)
    assert (summary["tie_records"], summary["shapes"]) == (16, {"decides": 16, "tie": 23})
    assert "+ 16 tie records beside them" in capsys.readouterr().out

    assert crm_data(["shard", str(data / "train.jsonl"), str(shards), "--val-fraction", "0.2",
                     "--strict"]) == 0
    manifest = json.loads((shards / "manifest.json").read_text())
    assert manifest["counts"]["written"] == 39
    assert sum(sh["ties"] for split in manifest["splits"].values() for sh in split["shards"]) == 23
    capsys.readouterr()
    assert crm_data(["stats", str(shards)]) == 0
    by_shape = Counter()
    for split in json.loads(capsys.readouterr().out).values():
        by_shape.update({(shape, label): n for shape, labels in split["shapes"].items()
                         for label, n in labels.items()})
    assert by_shape == {("decides", "model_a"): 8, ("decides", "model_b"): 8, ("tie", "tie"): 23}

    exported = [o if o != "export=false" else "export=true" for o in QUICK]
    done = command("crm-train", "data=shards", f"data.path={shards}", *exported, "loss=cls",
                   "transform.ties=keep",
                   "name=ties", root=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "are ties" not in done.stderr  # kept: no warning that they are left out
    export = tmp_path / "outputs" / "ties" / "export"
    assert json.loads((export / "crm.json").read_text())["labels"] == ["model_a", "model_b", "tie"]
    assert json.loads((export / "config.json").read_text())["id2label"] == {
        "0": "model_a", "1": "model_b", "2": "tie"}


def arena_csv_from_demo(records: list[dict], path: Path) -> dict[tuple, tuple]:
    """The demo's training pairs as arena-55k votes; {(query, response A, response B) as the
    criteria prompt shows them: (a_criteria, b_criteria, tie_criteria)}, the answers the stub
    gives: a tie's criteria are its record's (criteria on which the two are equally good), a
    decisive pair has none."""
    rows, truth = [], {}
    for r in records:
        turns = [(m["content"], a["content"], b["content"])
                 for m, a, b in zip(r["model_a"][0::2], r["model_a"][1::2], r["model_b"][1::2])]
        rows.append(arena_55k_row(r["idx"], [t[0] for t in turns], [t[1] for t in turns],
                                  [t[2] for t in turns], r["human_winner"]))
        convs = [tuple(Message(m["role"], m["content"]) for m in r[side]) for side in ("model_a", "model_b")]
        key = (convs[0][0].content, render_response(convs[0]), render_response(convs[1]))
        tie = r["a_criteria"] if r["human_winner"] == "tie" else []
        truth[key] = (r["a_criteria"], r["b_criteria"], tie)
    write_csv(path, rows)
    return truth


@pytest.mark.slow
def test_votes_to_a_crm_that_reads_criteria(tmp_path, monkeypatch, capsys):
    """Also a newcomer's walk (README, "Bring your own data"): validate, shard, train, then crm-eval
    and crm-leaderboard on the export (in process: the console scripts' one-line errors are
    tests/cli/test_first_hour.py's)."""
    raw = tmp_path / "raw"
    write_demo(raw, n_train=1500, n_test=200, n_bench=1)
    records = [json.loads(x) for x in (raw / "train.jsonl").read_text().splitlines()]
    truth = arena_csv_from_demo(records, tmp_path / "votes.csv")
    data, shards = tmp_path / "data", tmp_path / "shards"
    with StubLLM(criteria=lambda q, a, b: truth[(q, a, b)]) as stub:
        done = command("crm-data", "criteria", tmp_path / "votes.csv", data, "--base-url", stub.url,
                       "--model", "stub", "--concurrency", "16", "--k", "12", "--no-progress", root=tmp_path)
    assert done.returncode == 0, done.stderr
    summary = json.loads((data / "summary.json").read_text())
    assert (summary["read"], summary["written"], summary["rejected"]) == (1500, 1500, 0)
    rows = {r["idx"]: r for r in map(json.loads, (data / "train.jsonl").read_text().splitlines())}
    for r in records:  # the criteria exactly as the model answered them, the vote as it was
        row = rows[r["idx"]]
        # a tie vote's record holds its tie criteria on both sides
        a, b = (r["a_criteria"],) * 2 if r["human_winner"] == "tie" else (r["a_criteria"], r["b_criteria"])
        assert (row["a_criteria"], row["b_criteria"], row["human_winner"]) == (a, b, r["human_winner"])
        assert (row["model_a"], row["model_b"]) == (r["model_a"], r["model_b"])
    assert summary["topics"]["topics"] == 12
    assert crm_data(["validate", str(data / "train.jsonl")]) == 0

    done = command("crm-data", "shard", data / "train.jsonl", shards, "--strict", root=tmp_path)
    assert done.returncode == 0, done.stderr
    contradictory = raw / "test" / "contradictory.jsonl"
    # A pointwise CRM (L_ranking), direction random: each record shows the winner's or the loser's
    # criteria and the label follows them, so both sides' extracted criteria must be right. The
    # demo's Qwen3 at half width and depth (model=tiny-xs), 300 steps of 32 at lr 2e-3 on one core
    # (the other runs the other xdist worker's tests). Measured on the 2-core AMD EPYC: 0.725 /
    # 0.725 / 0.73 on this contradictory file (seeds 0 / 1 / 2), 22 s of training; the demo's tiny
    # model took 45 s for 200 steps (0.77 at seed 0, 0.715 at seed 2). The pairwise CRM from random
    # init first sits on a criteria-blind plateau (docs/RESULTS.md) and needs 500 steps of 64 for
    # 0.82-0.87 (230 s); its learning is make demo's and benchmarks/demo_quality.py's.
    done = command("crm-train", "data=shards", f"data.path={shards}", "name=arena", "torch_threads=1",
                   "model=tiny-xs", "loss=ranking", "direction=random", "global_batch_size=32",
                   "optim.lr=2e-3", "trainer.max_steps=300", "val_every_n_steps=1000",
                   "logger=none", "trainer.enable_progress_bar=false", f"data.test_files=[{contradictory}]",
                   root=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads((tmp_path / "outputs" / "arena" / "metrics.json").read_text())
    m = metrics["eval"][str(contradictory)]
    # A criteria-blind model scores exactly 0.5 here: every pair twice, opposite criteria and labels.
    assert m["n"] == 200 and m["accuracy_mean"] >= 0.7, m

    export = tmp_path / "outputs" / "arena" / "export"
    monkeypatch.setenv("CRM_ROOT", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["crm-eval", f"checkpoint={export}", f"data.test=[{contradictory}]",
                                      "name=arena", "progress=false"])
    crm.cli.eval.main()
    evaluated = json.loads((tmp_path / "outputs" / "eval" / "arena" / "metrics.json").read_text())
    assert evaluated["files"][str(contradictory)]["accuracy_mean"] == m["accuracy_mean"]
    monkeypatch.setattr(sys, "argv", ["crm-leaderboard", f"checkpoint={export}",
                                      f"bench={raw / 'bench.jsonl'}", "baseline=baseline",
                                      "criteria=[I prefer short answers.]", "name=arena",
                                      "progress=false", "interval.resamples=100"])
    crm.cli.leaderboard.main()
    board = json.loads((tmp_path / "outputs" / "leaderboard" / "arena" / "leaderboard.json").read_text())
    assert len(board["boards"][0]["rows"]) == len(board["models"]) > 1
    assert "leaderboard: " in capsys.readouterr().out
