"""A researcher's first hour with their own data: nothing of theirs overwritten, one clear line for
every mistake, settings that do not fit the data said at start (docs/DESIGN.md sections 6, 7).

The commands run in process (their `main()` with sys.argv set): each mistake must exit 2 with one
line on stderr naming the command, and no traceback. One test runs the real console scripts, for
what only a process of its own shows.
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import free_port, make_records, refused, train_dict, write_shard_dir
from vote_files import arena_55k_row, write_csv, write_parquet

import crm.cli.eval
import crm.cli.leaderboard
import crm.cli.train
from data_tools.cli import main as crm_data
from crm.models.backbone import is_flash_attn_2_available

BIN = Path(sys.executable).parent
BENCH = [{"idx": str(i), "topic": ("cooking", "travel")[i % 2], "prompt": f"q{i}",
          "responses": {"base": f"b{i}", "other": f"o{i}"}} for i in range(4)]


@pytest.fixture
def root(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("CRM_ROOT", str(tmp_path))
    return tmp_path


def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*"))
            if p.is_file()}


def test_data_path_without_data_shards_is_refused_and_the_users_shards_stay_as_they_were(
        root, capsys, monkeypatch):
    mine = root / "my" / "shards"
    write_shard_dir(mine, [make_records(5)])
    before = snapshot(mine)
    line = refused(capsys, monkeypatch, crm.cli.train.main, "crm-train", f"data.path={mine}", "name=x")
    assert f"data.path={mine} with data=demo" in line and "add data=shards" in line
    assert snapshot(mine) == before
    assert not (root / ".cache").exists()  # nothing generated: refused before the data step


@pytest.mark.parametrize("overrides, message", [
    (["trainer.max_steps=ten"], "trainer.max_steps='ten': expected int"),
    (["trainer.max_step=10"], "trainer.max_step: no such key (did you mean trainer.max_steps?)"),
    (["trainer.detect_anomali=true"], "trainer.detect_anomali: no such key (did you mean "
                                      "+trainer.detect_anomaly=...? a Trainer argument the group "
                                      "does not set)"),
    (["+trainer.max_step=10"], "trainer.max_step: not an argument of Lightning's Trainer (did you "
                               "mean trainer.max_steps?)"),
    (["optim.lrr=1"], "optim.lrr: no such key (did you mean optim.lr?)"),
    (["data.test=[a.jsonl]"], "data.test: no such key (did you mean data.test_files?)"),
    (["optim.lr=fast"], "optim.lr: Value 'fast' of type 'str' could not be converted to Float"),
    (["model=tinyy"], "Could not find 'model/tinyy' (options: "),
    (["data.test_files=a.jsonl"], "data.test_files: a list: write data.test_files=[...], e.g. "
                                  "data.test_files=[a.jsonl,b.jsonl]"),
    (["name=my run 🚀"], "name=my run 🚀: not an override Hydra can read; quote a value holding "
                        "spaces, emoji or punctuation: 'key=\"value\"'"),
    pytest.param(["trainer=gpu"], "trainer.accelerator=gpu: no CUDA device on this machine",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine")),
    pytest.param(["model.attention=flash_attention_2"],
                 "model.attention=flash_attention_2 but flash-attn is not installed",
                 marks=pytest.mark.skipif(is_flash_attn_2_available(), reason="flash-attn installed")),
])
def test_a_crm_train_mistake_is_one_line_before_any_work(root, capsys, monkeypatch, overrides,
                                                         message):
    line = refused(capsys, monkeypatch, crm.cli.train.main, "crm-train", *overrides)
    assert message in line
    assert not (root / ".cache").exists()  # before the data is generated or the tokenizer trained


def test_shards_without_a_training_record_are_refused_in_one_line(root, capsys, monkeypatch):
    write_shard_dir(root / "shards", [])  # crm-data shard itself refuses to write these
    line = refused(capsys, monkeypatch, crm.cli.train.main, "crm-train", "data=shards",
                   f"data.path={root / 'shards'}")
    assert "0 training records" in line and "rejects.jsonl" in line
    tar = root / "cut" / "train-000000.tar"
    write_shard_dir(tar.parent, [make_records(8)])
    tar.write_bytes(tar.read_bytes()[:1500])  # a copy cut short
    # found by the stream once training started (its log lines before it): a ShardError, exit 2,
    # no traceback (the cut lands mid-record: fewer records than the manifest's)
    monkeypatch.setattr(sys, "argv", ["crm-train", "data=shards", f"data.path={tar.parent}",
                                      "+trainer.limit_val_batches=0", "name=cut"])
    with pytest.raises(SystemExit) as exit_info:
        crm.cli.train.main()
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == (f"crm-train: {tar}: 1 eligible records, the manifest "
                                            "promised 8 or more")


@pytest.mark.parametrize("noise", ["add", "random"])
def test_noise_that_draws_from_a_criteria_pool_the_manifest_lacks_is_one_line(root, capsys,
                                                                               monkeypatch, noise):
    shards = root / "shards"
    write_shard_dir(shards, [make_records(8)])  # a manifest written by hand: no criteria_pool
    line = refused(capsys, monkeypatch, crm.cli.train.main, "crm-train", "data=shards",
                   f"data.path={shards}", f"noise={noise}", "+trainer.limit_val_batches=0", "name=x")
    assert line == (f"crm-train: noise={noise} draws criteria from the manifest's criteria_pool, "
                    f"which {shards / 'manifest.json'} lacks (a manifest not written by `crm-data "
                    "shard`): re-shard the data, or train with noise=none or remove")
    assert not (root / "outputs" / "x" / "tokenizer").exists()  # refused before the tokenizer


def test_replace_noise_of_readme_format_records_needs_the_pool_too(root, capsys, monkeypatch):
    from crm.data.shard import shard

    rows = [{"idx": str(i), "prompt": f"q{i}", "criteria": ["short", "plain", "warm"],
             "preference": "model_a",
             "model_a": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}],
             "model_b": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "b"}]}
            for i in range(8)]
    (root / "readme.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    shards = root / "shards"
    shard([str(root / "readme.jsonl")], shards, val_fraction=0.0)
    manifest = json.loads((shards / "manifest.json").read_text())
    del manifest["criteria_pool"]  # as a manifest from elsewhere
    (shards / "manifest.json").write_text(json.dumps(manifest))
    line = refused(capsys, monkeypatch, crm.cli.train.main, "crm-train", "data=shards",
                   f"data.path={shards}", "direction=original", "noise=replace",
                   "+trainer.limit_val_batches=0", "name=x")
    assert f"noise=replace draws criteria from the manifest's criteria_pool, which {shards}" in line


def test_crm_eval_lists_every_bad_record_before_loading_the_model(root, capsys, monkeypatch):
    good = {"idx": "0", "prompt": "q", "criteria": ["short"], "preference": "model_a",
            "model_a": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
            "model_b": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "b"}]}
    rows = [good] + [{k: v for k, v in good.items() if k != "preference"} for _ in range(5)]
    path = root / "test.jsonl"
    path.write_text("".join(json.dumps({**r, "idx": str(i)}) + "\n" for i, r in enumerate(rows)))
    line = refused(capsys, monkeypatch, crm.cli.eval.main, "crm-eval", f"checkpoint={root}/none",
                   f"data.test=[{path}]")
    assert line.count("preference: missing field") == 3  # a short list, then the count
    assert f"{path}:2: preference" in line and f"{path}:4: preference" in line
    assert f"and 2 more (5 bad records: `crm-data validate {path}`" in line


@pytest.mark.parametrize("overrides, message", [
    (["baseline=nobody"], "baseline 'nobody' has no response in any line (models: base, other)"),
    (["baseline=base", "topics=[sailing]"], "topics=['sailing'] not in the benchmark (topics: "
                                            "cooking, travel)"),
    (["baseline=base", "bench=/nowhere.jsonl"], "bench=/nowhere.jsonl: no such file"),
])
def test_crm_leaderboard_names_an_unknown_baseline_or_topic(root, capsys, monkeypatch, overrides,
                                                            message):
    bench = root / "bench.jsonl"
    bench.write_text("".join(json.dumps(r) + "\n" for r in BENCH))
    line = refused(capsys, monkeypatch, crm.cli.leaderboard.main, "crm-leaderboard",
                   f"checkpoint={root}", f"bench={bench}", "criteria=[short]", *overrides)
    assert message in line


def test_the_console_script_prints_one_line_and_exits_2(tmp_path):
    """In a process of its own: Hydra's composition error, which crm.cli.errors patches in for
    every Hydra command (crm-plan: the quickest to start; a command's own refusal:
    tests/training/test_train.py)."""
    done = subprocess.run([str(BIN / "crm-plan"), "modle=qwen3-8b"], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "CRM_ROOT": str(tmp_path)})
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == ["crm-plan: modle: no such key (did you mean model?)"]


# -- the data tools say why -----------------------------------------------------------------------

def test_crm_data_criteria_against_an_unreachable_endpoint_says_why_and_writes_its_summary(
        tmp_path, capsys):
    votes = write_csv(tmp_path / "votes.csv", [arena_55k_row(f"v{i}", [f"q{i}"], [f"a{i}"], [f"b{i}"],
                                                             "model_a") for i in range(4)])
    out = tmp_path / "data"
    code = crm_data(["criteria", str(votes), str(out), "--base-url", f"http://127.0.0.1:{free_port()}/v1",
                     "--model", "m", "--no-progress", "--max-retries", "0"])
    stdout, stderr = capsys.readouterr()
    assert code == 2
    (line,) = stderr.strip().splitlines()
    assert line.startswith("crm-data criteria: no vote got criteria: ") and "x4: check --base-url" in line
    assert "APIConnectionError" in line and "Connection error." not in line  # the cause, not the wrapper's
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["read"], summary["written"], summary["rejected"], summary["topics"]) == (4, 0, 4, None)
    assert summary["top_reasons"][0]["count"] == 4 and "x4" in stdout


def test_crm_data_shard_refuses_a_parquet_file_and_an_input_with_nothing_to_write(tmp_path, capsys):
    parquet = write_parquet(tmp_path / "votes.parquet", [train_dict(f"k{i}") for i in range(3)])
    assert crm_data(["shard", str(parquet), str(tmp_path / "shards")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (f"crm-data shard: {parquet}: a Parquet file, not JSONL (votes in Parquet go to "
                    "`crm-data criteria`; records: write them as JSON lines)")
    assert not (tmp_path / "shards").exists()
    binary = tmp_path / "latin1.jsonl"
    binary.write_bytes("{\"idx\": \"caf\xe9\"}\n".encode("latin-1") * 3)
    assert crm_data(["shard", str(binary), str(tmp_path / "shards")]) == 2
    assert "not UTF-8 text (byte 12)" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"idx": 1}\n' * 3)
    assert crm_data(["shard", str(bad), str(tmp_path / "shards")]) == 2
    assert "nothing written: every line was rejected" in capsys.readouterr().err.splitlines()[-1]


def test_crm_data_validate_says_each_defect_once_and_counts_topic_ids(tmp_path, capsys):
    path = tmp_path / "train.jsonl"
    rows = [{k: v for k, v in train_dict(f"k{i}").items() if not k.endswith("_topic")} for i in range(6)]
    rows.append({**train_dict("k6"), "a_broad_criteria_topic": [1, 2, 3]})  # 3 ids, 2 criteria
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert crm_data(["validate", str(path)]) == 1
    assert capsys.readouterr().out.splitlines() == [
        f"{path}:1: a_broad_criteria_topic: missing field: no topic ids yet (`crm-data topics "
        "IN.jsonl OUT.jsonl` fills them) (and 5 more lines: 2, 3, 4, 5, 6)",
        f"{path}:7: a_broad_criteria_topic: 3 topic ids for 2 criteria: one per criterion "
        "(`crm-data topics` fills them)"]


# -- settings that do not fit the data or the run, said at start ----------------------------------

def test_settings_that_do_not_fit_a_small_set_are_one_warning_each(tmp_path, caplog):
    from hydra import compose, initialize_config_module

    from crm.training.checks import check_data_fits
    from crm.cli.schema import settings
    from crm.data.shard import shard

    records = tmp_path / "train.jsonl"
    records.write_text("".join(json.dumps(r) + "\n" for _, r in make_records(48)))
    counts = shard([str(records)], tmp_path / "shards", val_fraction=0.05)["splits"]
    n_train, n_val = (counts[split]["counts"]["written"] for split in ("train", "val"))
    with initialize_config_module(version_base="1.3", config_module="crm_configs"):
        cfg = compose("train", overrides=["data=shards", f"data.path={tmp_path / 'shards'}",
                                          "trainer.max_steps=40", "name=mine"])
    run_dir = tmp_path / "outputs" / "mine"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "checkpoints" / "last.ckpt").write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="crm.training.checks"):
        check_data_fits(settings(cfg), tmp_path / "shards", run_dir, world=1)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 6 and all("\n" not in w for w in warnings)
    assert f"global_batch_size=64 is larger than the {n_train} training records" in warnings[0]
    assert f"the validation split holds {n_val} record(s)" in warnings[1] and n_val < 5  # 5% of 48
    assert "warmup_steps=300 is not shorter than trainer.max_steps=40" in warnings[2]
    assert warnings[3].startswith("val_every_n_steps=200 is past trainer.max_steps=40: the run "
                                  "never validates")
    assert warnings[4].startswith("save_every_n_steps=200 is past trainer.max_steps=40")
    assert "name=mine" in warnings[5] and "this run resumes it" in warnings[5]


def test_ties_a_run_drops_are_counted_at_start_and_all_ties_are_refused(root, caplog, capsys,
                                                                        monkeypatch):
    """A user who made tie records (crm-data criteria's tie criteria) learns that a run drops
    them, and which setting keeps them, before the tokenizer is trained."""
    from hydra import compose, initialize_config_module

    from crm.cli.schema import settings
    from crm.data.shard import shard
    from crm.training.checks import check_data_fits

    records = root / "train.jsonl"
    records.write_text("".join(json.dumps(r) + "\n" for _, r in make_records(40, tie_every=4)))
    manifest = shard([str(records)], root / "shards", val_fraction=0.2)
    ties = sum(s["ties"] for s in manifest["splits"]["train"]["shards"])
    val_ties = sum(s["ties"] for s in manifest["splits"]["val"]["shards"])
    n_train = manifest["splits"]["train"]["counts"]["written"]
    where = f"data.path={root / 'shards'}"

    def tie_warnings(*overrides) -> list[str]:
        with initialize_config_module(version_base="1.3", config_module="crm_configs"):
            cfg = compose("train", overrides=["data=shards", f"data.path={root / 'shards'}",
                                              "global_batch_size=4", *overrides])
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="crm.training.checks"):
            check_data_fits(settings(cfg), root / "shards", root / "run", world=1)
        return [r.getMessage() for r in caplog.records if "ties" in r.getMessage()]

    assert 0 < ties < n_train
    assert tie_warnings("loss=cls", "transform.ties=drop") == [
        f"{where}: {ties} of the {n_train} training records are ties: transform.ties=drop leaves "
        f"out the {ties} ties; transform.ties=keep trains them (a 3-way head that can say tie)"]
    assert tie_warnings("loss=cls", "transform.ties=keep") == []
    assert tie_warnings() == []  # ties=auto and the default CRM, which says tie: kept
    pointwise = tie_warnings("loss=ranking", "transform.ties=drop")
    assert len(pointwise) == 1 and "loss.ties=davidson transform.ties=keep trains them" in pointwise[0]
    assert tie_warnings("loss=ranking") == pointwise  # ties=auto: a Bradley-Terry CRM drops them
    assert tie_warnings("loss=ranking", "loss.ties=davidson") == []  # ties=auto keeps them

    only_ties = root / "ties.jsonl"
    only_ties.write_text("".join(json.dumps(r) + "\n" for _, r in make_records(8, tie_every=1)))
    shard([str(only_ties)], root / "tie-shards", val_fraction=0.25)
    capsys.readouterr()  # what the warnings above left there: the handler of an earlier test's crm-train
    line = refused(capsys, monkeypatch, crm.cli.train.main, "crm-train", "data=shards",
                   f"data.path={root / 'tie-shards'}", "transform.ties=drop", "name=ties")
    assert "0 training records (manifest.json), fewer than the 1 rank(s); transform.ties=drop " \
           "leaves out the " in line and "transform.ties=keep trains them" in line
    assert [p.name for p in (root / "outputs" / "ties").iterdir()] == ["train.log"]  # nothing trained
    line = refused(capsys, monkeypatch, crm.cli.train.main, "crm-train", "data=shards",
                   f"data.path={root / 'shards'}", "loss=ranking", "transform.ties=keep", "name=pk")
    assert line == (f"crm-train: transform.ties=keep with a pointwise CRM (loss=ranking), whose pair "
                    f"needs a winner: it cannot learn the data's {ties + val_ties} ties; "
                    "keep them with loss.ties=davidson (Bradley-Terry with ties) or loss=cls (a "
                    "3-way head that can say tie), or set transform.ties=drop")
    assert [p.name for p in (root / "outputs" / "pk").iterdir()] == ["train.log"]


def test_crm_rl_says_how_many_prompts_to_hold_out_before_loading_the_crm(tmp_path, capsys,
                                                                          monkeypatch):
    import crm.cli.rl

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"idx": i, "topic": "t", "prompt": f"q{i}",
                                           "responses": {"m": "a"}}) + "\n" for i in range(16)))
    (tmp_path / "crm").mkdir()  # no CRM in it: the prompts are refused before it is read
    line = refused(capsys, monkeypatch, crm.cli.rl.main, "crm-rl", f"checkpoint={tmp_path / 'crm'}",
                   f"prompts={prompts}", f"hydra.run.dir={tmp_path / 'run'}")
    assert "16 distinct prompts, all held out" in line and "(measure.prompts=4)" in line


@pytest.mark.parametrize("command", ["leaderboard", "rl"])  # usl and plan: the same help config
def test_help_lists_the_commands_own_keys_not_crm_trains_groups(command, capsys, monkeypatch):
    main = __import__(f"crm.cli.{command}", fromlist=["main"]).main
    monkeypatch.setattr(sys, "argv", [f"crm-{command}", "--help"])
    with pytest.raises(SystemExit) as exit_info:
        main()
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and out.startswith(f"crm-{command}: key=value overrides")
    assert "== Configuration groups ==" not in out and "trainer: cpu, ddp" not in out


# -- the logs say what ran ------------------------------------------------------------------------

def test_the_training_bar_counts_micro_batches_and_shows_no_epoch_bound():
    from types import SimpleNamespace

    from crm.training.progress import StepRichBar, StepTQDMBar

    trainer = SimpleNamespace(max_epochs=-1, max_steps=5, global_step=2, accumulate_grad_batches=2,
                              num_training_batches=12)
    for bar in (StepRichBar(), StepTQDMBar()):
        bar._trainer = trainer
        assert bar.total_train_batches == 6  # 3 optimizer steps left of 2 micro batches
    rich = StepRichBar()
    rich._trainer = trainer
    assert rich._get_train_description(6).strip() == "Epoch 6"  # not "Epoch 6/-2"


def test_lightnings_advert_is_dropped_and_one_cpu_device_logs_no_sharding(caplog):
    import crm.training.loggers  # noqa: F401  (installs the filter)
    from lightning.pytorch.utilities.rank_zero import rank_zero_info

    from crm.training.config import DeviceSettings
    from crm.training.resolve import resolve_sharding

    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    logger.addHandler(handler)
    try:
        rank_zero_info("💡 Tip: For seamless cloud logging, try installing litlogger")
        rank_zero_info("GPU available: False")
    finally:
        logger.removeHandler(handler)
    assert seen == ["GPU available: False"]
    with caplog.at_level(logging.INFO, logger="crm.training.resolve"):
        chosen = resolve_sharding("auto", DeviceSettings(accelerator="cpu", devices=1), 1,
                                  lambda nodes, ranks: "hsdp")
    assert chosen == "fsdp" and "parallel.sharding" not in caplog.text


def test_crm_rls_grpo_config_raises_no_gradient_checkpointing_future_warning(tmp_path):
    import warnings

    from crm.rl.grpo import grpo_config

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grpo_config(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    assert not [w for w in caught if "gradient_checkpointing" in str(w.message)]


def test_crm_eval_keeps_another_runs_results_and_its_bars_off_a_log(root, capsys, monkeypatch):
    from crm.cli.scorer import ScorerSettings, load_scorer
    from crm.inference.scorer import CRMScorer

    test = root / "test.jsonl"
    test.write_text("")
    taken = root / "outputs" / "eval" / "default"
    taken.mkdir(parents=True)
    (taken / "metrics.json").write_text(json.dumps({"model": "outputs/a/export", "files": {}}))
    line = refused(capsys, monkeypatch, crm.cli.eval.main, "crm-eval", f"checkpoint={root}",
                   f"data.test=[{test}]")
    assert line == (f"crm-eval: {taken} holds the results of checkpoint=outputs/a/export, "
                    f"data.test=[] (this run: checkpoint={root}, data.test=[{test}]): give this "
                    "evaluation its own name= (name=default is taken)")
    asked = {}
    monkeypatch.setattr(CRMScorer, "load", lambda path, **kwargs: asked.update(kwargs))
    (root / "crm.json").write_text("{}")  # an export dir, as far as the check before loading goes
    load_scorer(ScorerSettings(checkpoint=str(root), batch_size=1, device="cpu", dtype="auto",
                               compile=False, prefix_reuse=True, progress=True))
    assert asked["progress"] is False  # stderr is no terminal here: a bar would garble the table
