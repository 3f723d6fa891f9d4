"""benchmarks/usl_coverage.py's diagnostics of the CRM against a simulated user, in-process on
hand-made styles: the pair shapes and the within-model rho^2 behind its width bound."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from crm.data.demo import BENCH_BASELINE

_spec = importlib.util.spec_from_file_location(
    "usl_coverage", Path(__file__).parents[2] / "benchmarks" / "usl_coverage.py")
usl_coverage = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(usl_coverage)


def test_pair_shapes_against_the_training_pairs_shape():
    # attributes: length, structure, tone, examples, imagery, caution; criteria: detailed, bullets
    base = (0, 0, 0, 0, 0, 0)
    styles = {BENCH_BASELINE: [base] * 5,
              "m": [(1, 1, 0, 0, 0, 0),   # both named attributes differ, for m, nothing else
                    (1, 1, 1, 0, 0, 0),   # the same, and the tone differs too
                    (1, 0, 0, 0, 0, 0),   # only length differs
                    (0, 0, 1, 0, 0, 0),   # neither named attribute differs
                    (1, 0, 0, 0, 0, 0)]}
    styles[BENCH_BASELINE][4] = (0, 1, 0, 0, 0, 0)  # length for m, structure for the baseline
    records = [SimpleNamespace(idx=f"q{i}") for i in range(5)]
    shapes = usl_coverage.pair_shapes(styles, records, ["m"], ["detailed", "bullets"])
    assert [shapes[f"q{i}", "m"] for i in range(5)] == [
        "exact", "unanimous", "partial", "unseparated", "mixed"]


def test_within_model_rho2_ignores_what_differs_only_between_models():
    model_of = np.array(["a"] * 4 + ["b"] * 4)
    y = np.array([1, 0, 1, 0, 1, 1, 0, 0], dtype=float)
    assert usl_coverage.within_model_r2(y, y, model_of) == pytest.approx(1.0)
    # f tracks the models' win rates but not which of a model's pairs it wins
    f = np.array([0.2] * 4 + [0.8] * 4)
    assert usl_coverage.within_model_r2(y, f, model_of) == 0.0
    f = np.array([0.9, 0.1, 0.1, 0.9, 0.5, 0.5, 0.5, 0.5])  # half right in a, flat in b
    # within a: y - mean (.5, -.5, .5, -.5), f - mean (.4, -.4, -.4, .4): covariance 0
    assert usl_coverage.within_model_r2(y, f, model_of) == pytest.approx(0.0)
    f = np.array([0.9, 0.1, 0.9, 0.5, 0.5, 0.5, 0.5, 0.5])
    yc = np.array([.5, -.5, .5, -.5, .5, .5, -.5, -.5])
    fc = np.array([.3, -.5, .3, -.1, 0, 0, 0, 0])
    expected = (yc @ fc) ** 2 / ((yc @ yc) * (fc @ fc))
    assert usl_coverage.within_model_r2(y, f, model_of) == pytest.approx(expected)


def test_the_users_rule_is_the_demos_training_label():
    # criteria: detailed, bullets; the model against the baseline
    base = (0, 0, 0, 0, 0, 0)
    styles = {BENCH_BASELINE: [base, base, base, (0, 1, 0, 0, 0, 0), base],
              "m": [(1, 1, 0, 0, 0, 0),   # both named poles for m: a win
                    (0, 0, 1, 1, 1, 1),   # no named attribute differs: a tie, or taste's verdict
                    (1, 0, 0, 0, 0, 0),   # one named pole for m, none against: a win
                    (1, 0, 0, 0, 0, 0),   # length for m, bullets for the baseline: a tie
                    (0, 0, 0, 0, 0, 0)]}  # the same style: a tie whatever the user
    records = [SimpleNamespace(idx=f"q{i}") for i in range(5)]
    even = usl_coverage.rule_verdicts(styles, records, ["m"], ["detailed", "bullets"], taste=False)
    taste = usl_coverage.rule_verdicts(styles, records, ["m"], ["detailed", "bullets"], taste=True)
    assert [even[f"q{i}", "m"] for i in range(5)] == ["win", "tie", "win", "tie", "tie"]
    # the crowd's taste favours examples, casual tone, caution and detail; disfavours imagery
    assert [taste[f"q{i}", "m"] for i in range(5)] == ["win", "win", "win", "win", "tie"]
