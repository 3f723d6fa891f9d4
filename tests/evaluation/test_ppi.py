"""Prediction-powered win rates (crm.evaluation.ppi): the arithmetic against hand transcriptions of
the formulas, coverage simulations (each model's interval and the rank sets, on scenarios the
estimator was not tuned on), Wilson's interval and rank sets. Pure numpy."""
from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
from scipy.stats import chi2

from crm.evaluation.ppi import (CellData, Estimate, ppi_pooled, ppi_separate, ppi_topics, rank_sets,
                                wilson)

Z95 = 1.959963984540054


def test_one_cell_is_ppi_plus_plus_over_a_fully_judged_cell():
    """A group of one cell has no spread to estimate: PPI++'s mean (Angelopoulos et al. 2023)
    with the predictions' mean exact, since the CRM judged every pair of the cell: lambda =
    cov(Y, f) / var(f_all), theta = lambda mean(f_all) + mean(Y - lambda f), var = var(Y - lambda
    f) / n; written out here with the statistics module."""
    f_all = [1, 1, 1, 0, 0, 1, 0, 1, 1, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1, 1]
    f = [1, 1, 0, 0, 1, 1, 0, 1, 1, 0, 1, 1]
    y = [1, 1, 0, 1, 1, 0, 0, 1, 1, 0, 1, 0]
    n = len(y)
    lam = statistics.covariance(y, f) / statistics.variance(f_all)
    assert 0 < lam < 1  # not clipped: the case exercises the tuning
    r = [a - lam * b for a, b in zip(y, f)]
    theta = lam * statistics.mean(f_all) + statistics.mean(r)
    sd = math.sqrt(statistics.variance(r) / n)
    (estimate,) = ppi_pooled([CellData(f_all, f, y)], min_votes=10)
    assert estimate.win_rate == pytest.approx(theta, abs=1e-12)
    assert estimate.sd == pytest.approx(sd, abs=1e-12)
    assert estimate.votes == n
    assert estimate.interval(0.95) == pytest.approx((theta - Z95 * sd, theta + Z95 * sd))
    # by hand: sum(y f) = 6 and 7 wins, 8 CRM wins among the votes, 13 of 20 pairs: cov = (6 -
    # 12 * 7/12 * 8/12) / 11 = 4/33, var(f_all) = 13 * 7 / 20 / 19 = 91/380, lambda = 1520/3003,
    # theta = lambda * 13/20 + (7 - 8 lambda) / 12
    assert lam == pytest.approx(1520 / 3003)
    assert theta == pytest.approx(1520 / 3003 * 13 / 20 + (7 - 8 * 1520 / 3003) / 12)
    assert estimate.win_rate == pytest.approx(0.5749, abs=1e-4)


def test_cells_pool_their_rectifiers_by_empirical_bayes():
    """Three cells of 10 votes each, the CRM wrong on one, two and four of them: the within-cell
    variance, tau^2's Q-profile upper bound and the shrinkage, step by step."""
    a = CellData([1] * 10 + [0] * 10, [1] * 5 + [0] * 5, [1] * 4 + [0] * 6)
    b = CellData([1] * 6 + [0] * 14, [1] * 3 + [0] * 7, [1] * 4 + [0] * 5 + [1])
    c = CellData([1] * 4 + [0] * 16, [1, 1] + [0] * 8, [1] * 5 + [0] * 4 + [1])
    cells = (a, b, c)
    ys = [y for x in cells for y in x.votes]
    fs = [f for x in cells for f in x.voted_predictions]
    lam = statistics.covariance(ys, fs) / statistics.variance([f for x in cells
                                                               for f in x.predictions])
    assert 0 < lam < 1
    rs = [[y - lam * f for y, f in zip(x.votes, x.voted_predictions)] for x in cells]
    ds = [statistics.mean(r) for r in rs]
    s2 = sum((v - d) ** 2 for r, d in zip(rs, ds) for v in r) / (30 - 3)
    # equal counts, so equal weights 1 / (s2 / 10 + tau2) and the plain mean: the Q-profile's
    # equation sum (d - mean)^2 / (s2 / 10 + tau2) = chi2(2) at 5% solves in closed form
    mean = statistics.mean(ds)
    tau2 = sum((d - mean) ** 2 for d in ds) / chi2.ppf(0.05, 2) - s2 / 10
    assert 0 < tau2 < 1  # the cells' errors may differ: each keeps part of its own rectifier
    shrink = (s2 / 10) / (s2 / 10 + tau2)
    total = 3 / (s2 / 10 + tau2)
    expected = []
    for cell, d in zip(cells, ds):
        rectifier = shrink * mean + (1 - shrink) * d
        var = (1 - shrink) * s2 / 10 + shrink ** 2 / total
        expected.append((lam * statistics.mean(cell.predictions) + rectifier, math.sqrt(var)))
    got = ppi_pooled(cells, min_votes=10)
    assert [(e.win_rate, e.sd) for e in got] == [pytest.approx(x, abs=1e-9) for x in expected]
    # a cell with no votes gets the pooled rectifier and the spread as its own variance
    *_, lone = ppi_pooled([*cells, CellData([1, 0, 1, 0])], min_votes=10)
    assert lone.votes == 0 and lone.sd > max(e.sd for e in got)


def test_too_few_votes_give_no_interval():
    cells = [CellData([1, 0] * 10, [1, 0] * 4, [1, 1] * 4)]  # 8 votes
    assert ppi_pooled(cells) == [None]  # MIN_VOTES = 20
    assert ppi_pooled(cells, min_votes=8)[0] is not None


def test_a_perfect_crm_is_not_taken_for_certainty():
    """Every vote agrees with the CRM (lambda is 1): the residuals' variance is 0; it is floored
    at 1 / n, about a rule of three's worth of unseen disagreement."""
    f = [1, 0] * 15
    (estimate,) = ppi_pooled([CellData(f, f[:20], f[:20])])
    assert estimate.win_rate == pytest.approx(0.5) and estimate.sd == pytest.approx(1 / 20)


def test_wilson_interval_by_hand():
    # 5 of 10: centre 0.5, half-width 1.96 / (1 + 1.96^2 / 10) * sqrt(.025 + 1.96^2 / 400)
    low, high = wilson([1, 0] * 5, 0.95)
    assert (low, high) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    assert wilson([], 0.95) is None
    low, high = wilson([0] * 6, 0.95)  # all lost: not the point 0 a normal interval claims
    assert low == 0.0 and high == pytest.approx(0.3903, abs=1e-4)


def test_rank_sets_from_simultaneous_intervals():
    # a [.6, .8] and b [.5, .7] overlap: ranks 1-2; c [.1, .3] lies below both and overlaps d
    # [.25, .4]: 3-4 each
    spans = [(.6, .8), (.5, .7), (.1, .3), (.25, .4)]
    assert rank_sets(spans) == [(1, 2), (1, 2), (3, 4), (3, 4)]
    assert rank_sets([(0.0, 1.0)] * 3) == [(1, 3)] * 3
    assert Estimate(0.9, 0.1, 5).interval(0.95)[1] == 1.0  # clipped to [0, 1]


def test_a_known_spread_replaces_its_upper_bound():
    """`spread` (a study's oracle tau^2): 0 pools every cell's rectifier into the group's mean,
    each cell then as sure as all n votes make it, sd = sqrt(s^2 / n); a huge spread leaves each
    cell its own rectifier, sd = sqrt(s^2 / n_c)."""
    a = CellData([1] * 10 + [0] * 10, [1] * 5 + [0] * 5, [1] * 4 + [0] * 6)
    b = CellData([1] * 6 + [0] * 14, [1] * 3 + [0] * 7, [1] * 4 + [0] * 5 + [1])
    ys = [y for x in (a, b) for y in x.votes]
    fs = [f for x in (a, b) for f in x.voted_predictions]
    lam = statistics.covariance(ys, fs) / statistics.variance(a.predictions + b.predictions)
    rs = [[y - lam * f for y, f in zip(x.votes, x.voted_predictions)] for x in (a, b)]
    s2 = sum((v - statistics.mean(r)) ** 2 for r in rs for v in r) / (20 - 2)
    pooled = statistics.mean(rs[0] + rs[1])
    got = ppi_pooled([a, b], min_votes=10, spread=0.0)
    assert [e.sd for e in got] == pytest.approx([math.sqrt(s2 / 20)] * 2)
    assert got[0].win_rate == pytest.approx(lam * 0.5 + pooled)
    apart = ppi_pooled([a, b], min_votes=10, spread=1e9)
    assert [e.sd for e in apart] == pytest.approx([math.sqrt(s2 / 10)] * 2, rel=1e-6)
    assert apart[0].win_rate == pytest.approx(lam * 0.5 + statistics.mean(rs[0]), rel=1e-6)


def test_a_separate_cell_is_its_own_ppi_with_the_larger_of_its_variance_and_the_pooled_one():
    """Two cells: lambda from all votes, each cell's rectifier its own mean residual; its
    variance the larger of its own residuals' and the within-cell variance pooled over both,
    over its votes; Student t at the pooled degrees of freedom (n - cells)."""
    from scipy.stats import t

    a = CellData([1] * 10 + [0] * 10, [1] * 5 + [0] * 5, [1] * 4 + [0] * 6)  # agrees but once
    b = CellData([1] * 6 + [0] * 14, [1] * 3 + [0] * 7, [0, 1, 1] + [1] * 3 + [0] * 4)
    ys = list(a.votes) + list(b.votes)
    fs = list(a.voted_predictions) + list(b.voted_predictions)
    lam = statistics.covariance(ys, fs) / statistics.variance(list(a.predictions)
                                                              + list(b.predictions))
    rs = [[y - lam * f for y, f in zip(x.votes, x.voted_predictions)] for x in (a, b)]
    pooled = sum((v - statistics.mean(r)) ** 2 for r in rs for v in r) / (20 - 2)
    got = ppi_separate([a, b], min_votes=10)
    for cell, r, estimate in zip((a, b), rs, got):
        var = max(statistics.variance(r), pooled) / 10
        assert estimate.win_rate == pytest.approx(lam * statistics.mean(cell.predictions)
                                                  + statistics.mean(r))
        assert estimate.sd == pytest.approx(math.sqrt(var)) and estimate.df == 18
        half = t.ppf(0.975, 18) * math.sqrt(var)
        assert estimate.interval(0.95) == pytest.approx(
            (estimate.win_rate - half, estimate.win_rate + half))
    assert statistics.variance(rs[0]) < pooled < statistics.variance(rs[1])  # both branches
    # a cell without votes borrows nothing: no estimate
    assert ppi_separate([a, b, CellData([1, 0])], min_votes=10)[2] is None


def test_weights_make_the_rectifier_a_hajek_mean():
    """Votes weighted by their inverse inclusion probability: the rectifier is sum w r / sum w,
    the cell worth (sum w)^2 / sum w^2 votes; equal weights are the unweighted cell."""
    cell = CellData([1, 0] * 10, [1, 0, 1, 0, 1, 0], [1, 1, 0, 0, 1, 0])
    heavy = CellData(cell.predictions, cell.voted_predictions, cell.votes, [1, 3, 1, 1, 1, 1])
    same = CellData(cell.predictions, cell.voted_predictions, cell.votes, [2] * 6)
    (plain,), (weighted,), (equal,) = (ppi_separate([c], min_votes=2) for c in (cell, heavy, same))
    assert (equal.win_rate, equal.sd) == pytest.approx((plain.win_rate, plain.sd))
    lam = statistics.covariance(cell.votes, cell.voted_predictions) / statistics.variance(
        cell.predictions)
    r = [y - lam * f for y, f in zip(cell.votes, cell.voted_predictions)]
    w = heavy.weights
    assert weighted.win_rate == pytest.approx(
        lam * 0.5 + sum(a * b for a, b in zip(w, r)) / sum(w))


def simulate_boards(scenario: str, votes: int, boards: int, rng) -> tuple[np.ndarray, float]:
    """Per-model coverage at 0.95 and the share of boards whose rank-set intervals (each at 1 -
    0.05 / M) all hold, for `ppi_separate` on Overall cells. 8 models x 150 pairs over topics of
    80/30/20/10/10 pairs; votes spread evenly over models, uniform within each; the user's win
    rate per model drawn in [0.1, 0.9]. Scenarios: `spread`, the CRM errs on 5-30% of a model's
    pairs, more on the small topics; `biased`, as spread, and it favours model 0 (P(win) + 0.35
    on every pair); `confident`, it errs on 10-25% and says 0.98 / 0.02 whatever it does."""
    models, pairs = 8, 150
    topic = np.repeat(np.arange(5), [80, 30, 20, 10, 10])
    level, wide = 0.95, 1 - 0.05 / models
    covered, joint = np.zeros(models), 0
    for _ in range(boards):
        truth = (rng.random((models, pairs)) < rng.uniform(0.1, 0.9, (models, 1))).astype(float)
        low, high = (0.10, 0.25) if scenario == "confident" else (0.05, 0.30)
        error = np.linspace(low, high, models)[:, None] * np.where(topic == 0, 0.6, 1.6)
        said = np.where(rng.random((models, pairs)) < error, 1 - truth, truth)
        if scenario == "confident":
            f = np.where(said == 1, 0.98, 0.02)
        else:
            f = np.clip(np.where(said == 1, 0.8, 0.2) + rng.normal(0, 0.1, said.shape), 0, 1)
        if scenario == "biased":
            f[0] = np.clip(f[0] + 0.35, 0, 1)
        cells = []
        for m in range(models):
            voted = rng.choice(pairs, votes // models + (m < votes % models), replace=False)
            cells.append(CellData(f[m], f[m, voted], truth[m, voted]))
        estimates = ppi_separate(cells)
        rates = truth.mean(axis=1)
        holds = [e.interval(level)[0] <= x <= e.interval(level)[1]
                 for e, x in zip(estimates, rates)]
        together = [e.interval(wide)[0] <= x <= e.interval(wide)[1]
                    for e, x in zip(estimates, rates)]
        covered += holds
        joint += all(together)
    return covered / boards, joint / boards


@pytest.mark.parametrize("scenario", ["spread", "biased", "confident"])
def test_each_models_interval_and_the_rank_sets_hold_at_their_level(scenario):
    """800 boards per scenario, 50 votes each: every model's coverage at least 0.93 (800 boards
    give a model at 0.95 a standard error of 0.008) and the simultaneous intervals all hold on
    at least 0.93 of boards. The empirical-Bayes pooling these Overall intervals used before
    fails it: its worst model holds 0.905-0.909 of the time here."""
    per_model, joint = simulate_boards(scenario, 50, 800, np.random.default_rng(7))
    assert per_model.min() >= 0.93, per_model
    assert joint >= 0.93


def test_topic_cells_add_up_to_their_models_overall():
    """Three models over topics of 12, 6 and 2 pairs; the CRM errs on one topic of model 0 only.
    Each model's topic estimates, weighted by their pairs, average to its Overall estimate; the
    topic where the CRM errs moves away from the others; a topic without votes gets its model's
    correction and the spread as extra variance."""
    rng = np.random.default_rng(3)
    sizes = (12, 6, 2)
    models, topics, truths = [], [], {}
    for m in range(3):
        cells = []
        for t, size in enumerate(sizes):
            truth = (rng.random(size) < 0.5).astype(float)
            truths[m, t] = float(truth.mean())
            crm = truth.copy() if (m, t) != (0, 1) else 1 - truth
            voted = np.arange(min(size, 8)) if t < 2 else np.arange(0)
            cells.append(CellData(crm, crm[voted], truth[voted]))
        topics.append(cells)
        models.append(CellData(np.concatenate([c.predictions for c in cells]),
                               np.concatenate([c.voted_predictions for c in cells]),
                               np.concatenate([c.votes for c in cells])))
    overall = ppi_separate(models)
    nested = ppi_topics(models, topics)
    for m in range(3):
        mean = sum(n * e.win_rate for n, e in zip(sizes, nested[m])) / sum(sizes)
        assert mean == pytest.approx(overall[m].win_rate, abs=1e-9)
        assert nested[m][2].votes == 0 and nested[m][2].sd > overall[m].sd
    # the CRM said the opposite of the user on model 0's second topic: its votes there move the
    # cell toward the user's rate, away from the CRM's
    crm_rate = float(np.mean(topics[0][1].predictions))
    assert abs(nested[0][1].win_rate - truths[0, 1]) < abs(crm_rate - truths[0, 1])
    assert ppi_topics(models, topics, min_votes=100) == [[None] * 3] * 3
