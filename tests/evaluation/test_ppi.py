"""Prediction-powered win rates (crm.evaluation.ppi): the arithmetic against hand transcriptions of
the formulas, a small coverage simulation, Wilson's interval and rank sets. Pure numpy."""
from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
from scipy.stats import chi2

from crm.evaluation.ppi import CellData, Estimate, ppi_group, rank_sets, wilson

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
    (estimate,) = ppi_group([CellData(f_all, f, y)], min_votes=10)
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
    got = ppi_group(cells, min_votes=10)
    assert [(e.win_rate, e.sd) for e in got] == [pytest.approx(x, abs=1e-9) for x in expected]
    # a cell with no votes gets the pooled rectifier and the spread as its own variance
    *_, lone = ppi_group([*cells, CellData([1, 0, 1, 0])], min_votes=10)
    assert lone.votes == 0 and lone.sd > max(e.sd for e in got)


def test_too_few_votes_give_no_interval():
    cells = [CellData([1, 0] * 10, [1, 0] * 4, [1, 1] * 4)]  # 8 votes
    assert ppi_group(cells) == [None]  # MIN_VOTES = 20
    assert ppi_group(cells, min_votes=8)[0] is not None


def test_a_perfect_crm_is_not_taken_for_certainty():
    """Every vote agrees with the CRM (lambda is 1): the residuals' variance is 0; it is floored
    at 1 / n, about a rule of three's worth of unseen disagreement."""
    f = [1, 0] * 15
    (estimate,) = ppi_group([CellData(f, f[:20], f[:20])])
    assert estimate.win_rate == pytest.approx(0.5) and estimate.sd == pytest.approx(1 / 20)


def test_coverage_of_a_small_simulated_board():
    """8 models x 60 pairs, a CRM that errs at a different rate per model (5-30%), users that vote
    on 50 random pairs: PPI's Overall intervals hold the true win rate in at least 90% of (user,
    model) cases and are narrower than Wilson's from the same votes (by about a sixth here: the
    CRM's errors differ much by model, so little is pooled)."""
    rng = np.random.default_rng(0)
    models, pairs, votes, users = 8, 60, 50, 150
    error = np.linspace(0.05, 0.30, models)
    covered, width, wilson_width = [], [], []
    for _ in range(users):
        truth = rng.random((models, pairs)) < rng.uniform(0.1, 0.9, (models, 1))
        crm = np.where(rng.random((models, pairs)) < error[:, None], ~truth, truth)
        voted = rng.choice(models * pairs, size=votes, replace=False)
        cells = []
        for m in range(models):
            mine = [i % pairs for i in voted if i // pairs == m]
            cells.append(CellData(crm[m].astype(float), crm[m, mine].astype(float),
                                  truth[m, mine].astype(float)))
        for m, estimate in enumerate(ppi_group(cells)):
            low, high = estimate.interval(0.95)
            covered.append(low <= truth[m].mean() <= high)
            width.append(high - low)
            span = wilson(cells[m].votes, 0.95) or (0.0, 1.0)
            wilson_width.append(span[1] - span[0])
    assert np.mean(covered) >= 0.90
    assert np.mean(width) < 0.9 * np.mean(wilson_width)


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
    got = ppi_group([a, b], min_votes=10, spread=0.0)
    assert [e.sd for e in got] == pytest.approx([math.sqrt(s2 / 20)] * 2)
    assert got[0].win_rate == pytest.approx(lam * 0.5 + pooled)
    apart = ppi_group([a, b], min_votes=10, spread=1e9)
    assert [e.sd for e in apart] == pytest.approx([math.sqrt(s2 / 10)] * 2, rel=1e-6)
    assert apart[0].win_rate == pytest.approx(lam * 0.5 + statistics.mean(rs[0]), rel=1e-6)
