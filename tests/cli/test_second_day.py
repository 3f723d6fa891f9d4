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
from helpers import train_dict

from crm.cli.train import keep_earlier_figures

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

def test_crm_leaderboard_refuses_to_replace_another_checkpoints_board(root):
    """The console script: the refusal comes before any model loads, in one line naming name=."""
    bench = write_jsonl(root / "bench.jsonl", BENCH)
    board = root / "outputs" / "leaderboard" / "default"
    board.mkdir(parents=True)
    (board / "leaderboard.json").write_text(json.dumps({"model": "outputs/a/export",
                                                        "bench": str(bench)}))
    before = (board / "leaderboard.json").read_bytes()
    done = subprocess.run([str(BIN / "crm-leaderboard"), f"checkpoint={root}", f"bench={bench}",
                           "baseline=base", "criteria=[short]"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "CRM_ROOT": str(root)})
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"crm-leaderboard: {board} holds the results of checkpoint=outputs/a/export (this run: "
        f"checkpoint={root}): give this board its own name= (name=default is taken)"]
    assert (board / "leaderboard.json").read_bytes() == before


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
        f"crm-data shard: {criteria_out} holds another command's rejects.jsonl (`crm-data criteria` "
        "writes one beside its train.jsonl) and no shards: shard into another OUT_DIR, or "
        "--overwrite to replace them"]
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
