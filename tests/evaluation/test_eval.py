"""Evaluation (crm.evaluation.accuracy) and crm-eval (crm.cli.eval): the accuracy arithmetic on hand-made
predictions, then the command on a tiny exported model and demo-format test files."""
from __future__ import annotations

import json
import math

import pytest
import torch
from scorers import export_tiny, run_cli, tiny_scorer

from crm.cli.eval import evaluate, summary
from crm.core.records import load_records
from crm.core.examples import LABEL_A, LABEL_B, LABEL_TIE
from crm.core.examples import verdict
from crm.evaluation.accuracy import accuracy_metrics, evaluate_files, evaluate_records, verdict_name

NAN = float("nan")


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_verdict_is_strict_about_score_ties_and_unscorable_pairs():
    assert verdict([0.7, 0.3, 0.0]) == LABEL_A
    assert verdict([0.3, 0.7, 0.0]) == LABEL_B
    assert verdict([0.2, 0.3, 0.5]) == LABEL_TIE
    assert verdict([0.5, 0.5, 0.0]) is None  # a score tie is no verdict: wrong whatever the label
    assert verdict([0.4, 0.2, 0.4]) is None
    assert verdict([NAN, NAN, NAN]) is None


def test_accuracy_arithmetic_on_hand_made_predictions():
    labels = [LABEL_A, LABEL_B, LABEL_A, LABEL_B, LABEL_TIE, LABEL_A]
    # P(A), P(B), P(tie) in the file's A/B order, for the given and for the swapped run.
    given = torch.tensor([[0.7, 0.3, 0.0],   # A  right
                          [0.5, 0.5, 0.0],   # score tie: wrong
                          [0.9, 0.1, 0.0],   # A  right
                          [0.4, 0.6, 0.0],   # B  right
                          [0.2, 0.3, 0.5],   # tie right
                          [NAN, NAN, NAN]])  # unscorable: wrong
    swapped = torch.tensor([[0.6, 0.4, 0.0],    # A  right
                            [0.2, 0.8, 0.0],    # B  right        (flip: no verdict -> B)
                            [0.3, 0.7, 0.0],    # B  wrong        (flip: A -> B)
                            [0.45, 0.55, 0.0],  # B  right
                            [0.5, 0.3, 0.2],    # A  wrong        (flip: tie -> A)
                            [NAN, NAN, NAN]])   # wrong, no verdict either way: no flip
    m = accuracy_metrics(labels, given, swapped, ["x", "x", "x", "y", "y", "y"])
    assert m["n"] == 6 and m["gold_ties"] == 1 and m["unscorable"] == 1
    assert m["accuracy"] == round(4 / 6, 4)
    assert m["accuracy_swapped"] == round(3 / 6, 4)
    assert m["accuracy_mean"] == round(7 / 12, 4)
    assert m["flip_rate"] == round(3 / 6, 4)
    # score ties and tie verdicts (given rows 1, 4) over the 10 verdicts of the scorable rows:
    # the unscorable row 5 is no tie (crm-eval once showed its two verdicts as ties)
    assert m["tie_rate"] == round(2 / 10, 4)
    # averaged orders: rows 0-3 right; row 4 averages to (0.35, 0.3, 0.35), a score tie; row 5 NaN
    assert m["accuracy_both_orders"] == round(4 / 6, 4)
    assert m["by_topic"] == {
        "x": {"n": 3, "accuracy": round(2 / 3, 4), "accuracy_swapped": round(2 / 3, 4),
              "accuracy_mean": round(4 / 6, 4)},
        "y": {"n": 3, "accuracy": round(2 / 3, 4), "accuracy_swapped": round(1 / 3, 4),
              "accuracy_mean": 0.5}}


def test_no_topic_breakdown_without_topics():
    m = accuracy_metrics([LABEL_A], torch.tensor([[0.9, 0.1, 0.0]]), torch.tensor([[0.9, 0.1, 0.0]]),
                         [None])
    assert "by_topic" not in m and m["accuracy"] == 1.0 and m["flip_rate"] == 0.0


def test_an_unscorable_pair_is_no_tie():
    nan = torch.tensor([[NAN, NAN, NAN]])
    m = accuracy_metrics([LABEL_A], nan, nan, [None])
    assert m["unscorable"] == 1 and m["accuracy"] == 0.0 and m["tie_rate"] is None
    assert verdict_name([NAN, NAN, NAN]) == "unscorable" and verdict_name([0.5, 0.5, 0]) == "score_tie"


def write_test_file(tmp_path, name="test.jsonl", n=6):
    """A test-format file: alternating preferences, two topics, one multi-turn pair."""
    lines = []
    for i in range(n):
        query = f"question {i}"
        a = [{"role": "user", "content": query}, {"role": "assistant", "content": f"alpha reply {i}"}]
        b = [{"role": "user", "content": query}, {"role": "assistant", "content": "beta " * (i + 1)}]
        if i == 2:
            a += [{"role": "user", "content": "follow up"}, {"role": "assistant", "content": "more"}]
            b += [{"role": "user", "content": "follow up"}, {"role": "assistant", "content": "less"}]
        lines.append({"idx": i, "prompt": query, "model_a": a, "model_b": b,
                      "criteria": ["concise answer", "is friendly"][: 1 + i % 2],
                      "preference": ("model_a", "model_b")[i % 2], "topic": ("x", "y")[i % 3 == 0]})
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def test_pairwise_evaluation_scores_both_orders(tmp_path):
    scorer = tiny_scorer()
    records = load_records(write_test_file(tmp_path), "test")
    metrics, predictions = evaluate_records(scorer, records)
    assert len(predictions) == metrics["n"] == 6
    for p in predictions:
        assert p["verdict"] in ("model_a", "model_b", "score_tie")
        assert math.isclose(sum(p["p_given"]), 1.0, abs_tol=1e-5)
    # the swapped order is really scored (a random model is position-biased in its own way)
    assert any(p["p_given"] != p["p_swapped"] for p in predictions)
    assert set(metrics["by_topic"]) == {"x", "y"}


def test_pointwise_evaluation_needs_one_order_only(tmp_path):
    scorer = tiny_scorer("pointwise")
    records = load_records(write_test_file(tmp_path), "test")
    metrics, predictions = evaluate_records(scorer, records)
    assert scorer.counts["sequences"] == 12  # A and B of 6 records, once
    assert metrics["flip_rate"] == 0.0 and metrics["accuracy"] == metrics["accuracy_swapped"]
    assert all(p["p_given"] == p["p_swapped"] for p in predictions)


def test_evaluate_files_keeps_the_signature_crm_train_uses(tmp_path):
    paths = [write_test_file(tmp_path, "one.jsonl"), write_test_file(tmp_path, "two.jsonl", n=4)]
    metrics, predictions = evaluate_files(tiny_scorer(), paths)
    assert list(metrics) == [str(p) for p in paths]
    assert [m["n"] for m in metrics.values()] == [6, 4]
    assert [len(p) for p in predictions.values()] == [6, 4]


@pytest.mark.parametrize("kind", ["pairwise", "pointwise"])
def test_crm_eval_writes_metrics_and_predictions(kind, tmp_path):
    export = export_tiny(tmp_path / "export", kind)
    files = [write_test_file(tmp_path, "one.jsonl"), write_test_file(tmp_path, "two.jsonl", n=4)]
    run_dir = tmp_path / "run"
    result = run_cli("eval", evaluate, [f"checkpoint={export}", f"data.test=[{files[0]},{files[1]}]",
                                        "progress=false", "batch_size=3"], run_dir)
    assert result["kind"] == kind
    saved = json.loads((run_dir / "metrics.json").read_text())
    assert saved["files"] == result["files"] and list(saved["files"]) == [str(f) for f in files]
    lines = [json.loads(x) for x in (run_dir / "predictions.jsonl").read_text().splitlines()]
    assert len(lines) == 10 and {x["file"] for x in lines} == {str(f) for f in files}
    assert {"idx", "preference", "p_given", "p_swapped", "verdict", "verdict_swapped"} <= set(lines[0])
    table = summary(result["files"])
    assert "one" in table and "two" in table and "flip" in table


def test_crm_eval_refuses_no_files_and_missing_files(tmp_path):
    export = export_tiny(tmp_path / "export")
    with pytest.raises(ValueError, match="no test files"):
        run_cli("eval", evaluate, [f"checkpoint={export}"], tmp_path / "run")
    with pytest.raises(ValueError, match="nowhere.jsonl: no such file"):
        run_cli("eval", evaluate, [f"checkpoint={export}", f"data.test=[{tmp_path}/nowhere.jsonl]"],
                tmp_path / "run")


def test_eval_run_dir_is_deterministic(tmp_path):
    from hydra import compose, initialize_config_module

    with initialize_config_module(version_base="1.3", config_module="crm_configs"):
        cfg = compose("eval", overrides=[f"paths.root_dir={tmp_path}", "name=mine", "checkpoint=x"],
                      return_hydra_config=True)
    assert cfg.hydra.run.dir == f"{tmp_path}/outputs/eval/mine"


def test_main_takes_checkpoint_and_the_deprecated_model(tmp_path, monkeypatch, capsys):
    from crm.cli.scorer import checkpoint_argument
    from crm.cli.eval import main

    assert checkpoint_argument(["crm-eval", "model=a/b", "models=x", "++model.path=c",
                                "name=model=d", "checkpoint=e"]) == \
        ["crm-eval", "checkpoint=a/b", "models=x", "checkpoint=c", "name=model=d", "checkpoint=e"]
    assert capsys.readouterr().err.count("is deprecated, use checkpoint=") == 2
    export = export_tiny(tmp_path / "export")
    path = write_test_file(tmp_path)
    for argument in ("checkpoint", "model"):
        run_dir = tmp_path / argument
        monkeypatch.setattr("sys.argv", ["crm-eval", f"{argument}={export}", f"data.test=[{path}]",
                                         "progress=false", f"hydra.run.dir={run_dir}"])
        main()
        out, err = capsys.readouterr()
        assert "test" in out and f"metrics: {run_dir}/metrics.json" in out
        assert ("model= is deprecated" in err) == (argument == "model")
        assert json.loads((run_dir / "metrics.json").read_text())["files"][str(path)]["n"] == 6


@pytest.mark.parametrize("kind", ["pairwise", "pointwise"])
def test_responses_shortened_to_fit_are_counted(kind):
    from crm.core.records import parse_test

    def record(idx, words):
        return parse_test({"idx": idx, "prompt": "q", "criteria": ["concise answer"],
                           "preference": "model_a",
                           "model_a": [{"role": "user", "content": "q"},
                                       {"role": "assistant", "content": "alpha reply " * words}],
                           "model_b": [{"role": "user", "content": "q"},
                                       {"role": "assistant", "content": "beta reply"}]})

    scorer = tiny_scorer(kind, num_labels=1 if kind == "pointwise" else 2, max_tokens=300)
    metrics, _ = evaluate_records(scorer, [record(0, 400), record(1, 2), record(2, 401)])
    assert metrics["shortened"] == 2 and metrics["unscorable"] == 0
    assert "(2 shortened to fit)" in summary({"f.jsonl": metrics})
