"""crm-report on a hand-made multirun dir, and every experiment config (composes, one step)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from helpers import glyphs_the_font_lacks
from test_train import compose_train, run_train

from crm.cli.report import main as report_main
from crm.training.sweeps import read_runs, table

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def fake_run(root: Path, num: int, overrides: list[str], eval_: dict, step: int, wall: float):
    run = root / str(num)
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (run / "metrics.json").write_text(json.dumps(
        {"train": {"global_step": step}, "eval": eval_, "wall_seconds": wall}))


def metrics(acc: float, flip: float) -> dict:
    return {"accuracy_mean": acc, "flip_rate": flip}


@pytest.fixture
def sweep(tmp_path) -> Path:
    root = tmp_path / "multirun" / "ablation-loss"
    fake_run(root, 0, ["experiment=cpu_loss", "loss=cls"],
             {"/d/test/contradictory.jsonl": metrics(0.98, 0.02),
              "/d/test/in_distribution.jsonl": metrics(0.99, 0.0)}, 700, 250.5)
    fake_run(root, 1, ["experiment=cpu_loss", "loss=ranking"],
             {"/d/test/contradictory.jsonl": metrics(0.9, 0.0),
              "/d/test/in_distribution.jsonl": metrics(0.95, 0.0)}, 700, 301.0)
    # Job 10 sorts after job 1 (numerically), and one run that failed has no metrics.json.
    fake_run(root, 10, ["experiment=cpu_loss", "loss=ranking", "seed=1"],
             {"/d/test/contradictory.jsonl": metrics(0.5, 0.1)}, 20, 9.0)
    (root / "2" / ".hydra").mkdir(parents=True)
    (root / "2" / ".hydra" / "overrides.yaml").write_text(
        yaml.safe_dump(["experiment=cpu_loss", "loss=cls", "seed=2"]))
    return root


def test_table_has_the_varied_axes_and_every_test_set(sweep):
    runs, skipped = read_runs(sweep)
    header, rows = table(runs)
    assert header == ["job", "loss", "seed", "acc/contradictory", "acc/in_distribution",
                      "flip/contradictory", "flip/in_distribution", "steps", "wall_s", "note"]
    # the job that failed is a row of its own, named, with its axes and no figures
    failed = "no metrics.json: failed or still running"
    assert rows == [["0", "cls", "", 0.98, 0.99, 0.02, 0.0, 700, 250.5, ""],
                    ["1", "ranking", "", 0.9, 0.95, 0.0, 0.0, 700, 301.0, ""],
                    ["2", "cls", "2", "", "", "", "", "", "", failed],
                    ["10", "ranking", "1", 0.5, "", 0.1, "", 20, 9.0, ""]]
    assert len(skipped) == 1 and "no metrics.json" in skipped[0]


def test_cli_writes_markdown_csv_and_plot(sweep, tmp_path, capsys, monkeypatch):
    import matplotlib.pyplot as plt

    notes = tmp_path / "notes.md"
    notes.write_text("mine\n")
    assert report_main([str(sweep), "--out", str(notes)]) == 2  # --out a file: what it wants said
    assert capsys.readouterr().err.strip().splitlines() == [
        f"crm-report: {notes} is a file, not a directory: --out is the folder report.md, report.csv "
        "and report.png go in; give a new directory or an existing one"]
    assert notes.read_text() == "mine\n"
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to measure its parts
    assert report_main([str(sweep)]) == 0
    assert (sweep / "report.md").read_text() == (
        "| job | loss | seed | acc/contradictory | acc/in_distribution | flip/contradictory "
        "| flip/in_distribution | steps | wall_s | note |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n"
        "| 0 | cls |  | 0.9800 | 0.9900 | 0.0200 | 0.0000 | 700 | 250.5 |  |\n"
        "| 1 | ranking |  | 0.9000 | 0.9500 | 0.0000 | 0.0000 | 700 | 301.0 |  |\n"
        "| 2 | cls | 2 |  |  |  |  |  |  | no metrics.json: failed or still running |\n"
        "| 10 | ranking | 1 | 0.5000 |  | 0.1000 |  | 20 | 9.0 |  |\n")
    assert (sweep / "report.csv").read_text().splitlines()[:2] == [
        "job,loss,seed,acc/contradictory,acc/in_distribution,flip/contradictory,"
        "flip/in_distribution,steps,wall_s,note", "0,cls,,0.98,0.99,0.02,0.0,700,250.5,"]
    assert (sweep / "report.png").stat().st_size > 5000
    assert "3 runs (1 more without metrics, named in the table)" in capsys.readouterr().out
    (fig,) = figures
    (ax,) = fig.axes
    renderer = fig.canvas.get_renderer()
    legend = ax.get_legend().get_window_extent(renderer)
    bars = [bar.get_window_extent(renderer) for bar in ax.patches] + [
        text.get_window_extent(renderer) for text in ax.texts if text.get_text()]  # the bars' figures
    assert len(ax.patches) == 2 * 4 and not any(legend.overlaps(bar) for bar in bars)  # it sat on them
    # which setting is which: the axis is named, an unset one is "-", a set a finished run did not
    # evaluate "n/a", a job without metrics named and drawn without bars or figures
    assert ax.get_xlabel() == "loss, seed (-: the config's value)"
    assert [t.get_text() for t in ax.get_xticklabels()] == [
        "cls, -", "ranking, -", "cls, 2\njob 2: no metrics\n(failed or still running)", "ranking, 1"]
    assert [t.get_text() for t in ax.texts] == ["0.98", "0.90", "", "0.50", "0.99", "0.95", "", "n/a"]


def test_cli_on_a_dir_without_runs_fails_cleanly(tmp_path, capsys):
    assert report_main([str(tmp_path)]) == 2
    assert "no run" in capsys.readouterr().err


def test_wandb_summary_run_offline(sweep, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    assert report_main([str(sweep), "--wandb", "--out", str(tmp_path / "rep")]) == 0
    assert list((tmp_path / "rep" / "wandb").glob("offline-run-*"))


# The ablations are the experiments that sweep (hydra.sweeper.params); experiment=lora is one run.
EXPERIMENTS = sorted(p.stem for p in (CONFIGS / "experiment").glob("*.yaml")
                     if "hydra" in yaml.safe_load(p.read_text()))


def test_every_ablation_has_a_gpu_and_a_cpu_experiment():
    gpu = {e for e in EXPERIMENTS if not e.startswith("cpu_")}
    assert gpu == {"size", "loss", "noise", "direction", "swap"}
    assert {f"cpu_{e}" for e in gpu} <= set(EXPERIMENTS)


def test_the_lora_experiment_trains_adapters_for_a_step(tmp_path, demo_root):
    """experiment=lora on the tiny model, on CPU: its settings compose and train."""
    metrics = run_train(demo_root, tmp_path / "run", "experiment=lora", "model=tiny", "trainer=cpu",
                        "data=demo", "logger=none", "stream.num_workers=0", "global_batch_size=4",
                        "stream.max_tokens=256", "trainer.max_steps=1")
    assert metrics["train"]["global_step"] == 1
    assert 0 < metrics["train"]["lora_trainable_parameters"]


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes_sweeps_its_axis_and_runs_one_step(experiment, tmp_path,
                                                                     demo_root):
    from omegaconf import OmegaConf

    cfg = compose_train([f"experiment={experiment}"], hydra_node=True)
    params = OmegaConf.to_container(cfg.hydra.sweeper.params)
    assert len(params) == 1 and len(next(iter(params.values())).split(",")) >= 2
    assert cfg.name == f"ablation-{experiment}"
    axis, values = next(iter(params.items()))
    # One step of the first sweep point on a tiny model: the GPU experiments run on CPU here, with
    # their activation checkpointing on.
    overrides = [f"experiment={experiment}", f"{axis}={values.split(',')[0]}"]
    if not experiment.startswith("cpu_"):
        overrides += ["model=tiny", "trainer=cpu", "data=demo", "logger=none",
                      "stream.num_workers=0", "global_batch_size=4", "stream.max_tokens=256"]
    metrics = run_train(demo_root, tmp_path / "run", *overrides, "trainer.max_steps=1")
    assert metrics["train"]["global_step"] == 1


def test_a_cpu_sweep_reports_the_benchmarks_its_runs_scored(demo_root, tmp_path):
    """crm-train's `benchmarks` scores the export at the end (metrics.json, the logger's
    benchmark/<name>/<figure>, scores.jsonl), and crm-report shows each figure as a column: a real
    2-step run of a CPU loss ablation beside a hand-made run of the other loss."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "pairs.jsonl").write_text("".join(json.dumps(
        {"id": f"p{i}", "prompt": f"question {i}", "chosen": "alpha reply", "rejected": "beta reply",
         "subset": subset}) + "\n" for i, subset in enumerate(["x", "y", "y"])))
    (data / "rm.json").write_text(json.dumps([
        {"id": i, "prompt": f"question {i}", "chosen": ["a", "a reply", "## a reply"],
         "rejected": ["b", "b reply", "## b reply"], "domain": domain}
        for i, domain in enumerate(["chat", "code", "math", "safety-refuse"])]))
    sweep = tmp_path / "multirun" / "ablation-loss"
    metrics = run_train(demo_root, sweep / "0", "loss=cls", "export=true", "evaluate=true",
                        "logger=csv", f"+benchmarks.pairs={data}/pairs.jsonl",
                        f"+benchmarks.rmbench={data}/rm.json")
    # The run wrote its record (.hydra/); the sweep's overrides as Hydra's sweeper gives them:
    (sweep / "0" / ".hydra" / "overrides.yaml").write_text(
        yaml.safe_dump(["experiment=cpu_loss", "loss=cls"]))
    pairs, rmbench = metrics["benchmarks"]["pairs"], metrics["benchmarks"]["rmbench"]
    assert (pairs["prompts"], pairs["forwards"], pairs["strategy"]) == (3, 3 * 2, "round_robin")
    assert sorted(pairs["summary"]) == ["accuracy", "x", "y"]
    assert rmbench["forwards"] == 4 * 6 * 5 and set(rmbench["domains"]) == {"chat", "math", "code",
                                                                            "safety"}
    assert len((sweep / "0" / "benchmarks" / "rmbench" / "scores.jsonl").read_text().splitlines()) == 24
    logged = (sweep / "0" / "csv" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"benchmark/pairs/accuracy", "benchmark/rmbench/hard_acc"} <= set(logged)

    fake_run(sweep, 1, ["experiment=cpu_loss", "loss=ranking"], {}, 2, 1.0)
    other = json.loads((sweep / "1" / "metrics.json").read_text())
    other["benchmarks"] = {"pairs": {"summary": {"accuracy": 0.25, "x": 0.0, "y": None}}}
    (sweep / "1" / "metrics.json").write_text(json.dumps(other))
    header, rows = table(read_runs(sweep)[0])
    start = header.index("pairs/accuracy")  # after the axis and the demo's test sets
    assert header[:2] == ["job", "loss"] and header[start - 1].startswith("acc/")
    assert header[start:start + 7] == ["pairs/accuracy", "pairs/x", "pairs/y",
                                       "rmbench/total_avg_acc", "rmbench/hard_acc",
                                       "rmbench/normal_acc", "rmbench/easy_acc"]
    assert rows[0][start] == round(pairs["accuracy"], 4)
    assert rows[1][:2] == ["1", "ranking"] and rows[1][start:start + 4] == [0.25, 0.0, "", ""]


def test_a_sweep_whose_other_job_failed_names_the_run_by_its_job_and_says_why_no_bars(
        tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    root = tmp_path / "multirun" / "ties"
    fake_run(root, 0, ["transform.ties=drop"], {}, 20, 9.0)  # no test files evaluated
    (root / "1" / ".hydra").mkdir(parents=True)  # job 1 failed: no metrics.json
    (root / "1" / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(["transform.ties=keep"]))
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to read its texts
    assert report_main([str(root)]) == 0
    (fig,) = figures
    (ax,) = fig.axes
    # the failed job is drawn too, named (it once drew as if only job 0 existed)
    assert [t.get_text() for t in ax.get_xticklabels()] == [
        "drop", "keep\njob 1: no metrics\n(failed or still running)"]
    assert [t.get_text() for t in ax.texts] == [
        "no test-set accuracy: these runs evaluated no data.test_files"]
    assert "| 1 | keep |" in (root / "report.md").read_text()


def test_a_job_the_sweep_never_started_is_named_from_its_multirun_yaml(tmp_path, monkeypatch):
    """Hydra's basic launcher stops at the first failed job: job 2 has no run dir, and only the
    sweep's multirun.yaml says it was asked for."""
    import matplotlib.pyplot as plt

    root = tmp_path / "multirun" / "seeds"
    fake_run(root, 0, ["seed=0"], {"/d/test/a.jsonl": metrics(0.75, 0.0)}, 20, 9.0)
    (root / "1" / ".hydra").mkdir(parents=True)  # job 1 failed: no metrics.json
    (root / "1" / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(["seed=1"]))
    (root / "multirun.yaml").write_text(yaml.safe_dump(
        {"hydra": {"overrides": {"hydra": ["hydra.mode=MULTIRUN"], "task": ["seed=0,1,2"]},
                   "sweeper": {"params": None}}}))
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to read its texts
    assert report_main([str(root)]) == 0
    assert (root / "report.md").read_text().splitlines()[2:] == [
        "| 0 | 0 | 0.7500 | 0.0000 | 20 | 9.0 |  |",
        "| 1 | 1 |  |  |  |  | no metrics.json: failed or still running |",
        "| 2 | 2 |  |  |  |  | not started: no run dir (the sweep stopped before it, or it "
        "waits) |"]
    (fig,) = figures
    labels = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert labels == ["0", "1\njob 1: no metrics\n(failed or still running)",
                      "2\njob 2: not started\n(no run dir)"]
    # one figure, job 0's: the jobs without metrics draw no bar at 0 and no "0.00"
    assert [t.get_text() for t in fig.axes[0].texts if t.get_text()] == ["0.75"]


def test_settings_and_test_sets_the_font_cannot_draw_are_stand_ins_in_the_picture(
        tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    root = tmp_path / "multirun" / "emoji"
    for num, name in enumerate(("🚀", "模型")):
        fake_run(root, num, [f"name={name}"], {"/d/test/taco🌮.jsonl": metrics(0.5, 0.0)}, 20, 9.0)
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to read its texts
    assert report_main([str(root)]) == 0
    (fig,) = figures
    assert glyphs_the_font_lacks(fig) == []
    (ax,) = fig.axes
    assert [t.get_text() for t in ax.get_xticklabels()] == [":rocket:", "??"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["taco:taco:"]
    assert "🚀" in (root / "report.md").read_text(encoding="utf-8")  # the text file keeps it
