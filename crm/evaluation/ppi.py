"""Win-rate intervals that carry the CRM's own error: prediction-powered inference (PPI++) from the
CRM's verdicts on every pair and the user's votes on a few (docs/DESIGN.md section 8.3,
docs/EVALUATION.md section 7).

Pure numpy and scipy's normal quantile. ppi-python (the PPI authors' package) is not used: it
imports numba, statsmodels and scikit-learn for what is, for a mean, a few lines, and it has no
estimator that pools the CRM's error across a board's models, which 30-100 votes over several
models need (a model gets a handful of votes).

One group is the cells that pool their evidence: a board's Overall cells (one per model), or its
(model, topic) cells. For each cell c: f = the CRM's prediction on each of its N_c pairs (the
leaderboard passes its P(win)), and on its n_c voted pairs the user's win indicator Y with the
CRM's f beside it.

- The estimand is the cell's win rate as the user would judge all its N_c pairs: the board's
  question, which model this user prefers on these queries. The CRM has judged every one of them,
  so mean(f) over the cell is known, not sampled: PPI++'s unlabeled term (lambda^2 var(f) / N) is
  zero, and its power tuning becomes lambda = cov(Y, f) / var(f) (the regression, or difference,
  estimator of survey sampling), one per group, over its votes and pairs, clipped to [0, 1]: 0
  ignores the CRM (votes only), 1 is plain PPI.
- Each cell's rectifier d_c = mean(Y - lambda f) over its votes. The rectifiers are pooled by
  empirical Bayes (Morris 1983): the within-cell variance s^2 of Y - lambda f pooled, their spread
  across cells tau^2 taken at its upper 95% confidence bound (the Q-profile, Viechtbauer 2007:
  the tau^2 at which the generalized Q statistic falls to its chi-square 5% quantile), and each
  cell's rectifier shrunk toward the group's precision-weighted mean by B_c = (s^2 / n_c) /
  (s^2 / n_c + tau^2). A CRM whose error is the same on every model lends every cell most of the
  group's votes; one whose error differs by model leaves each cell its own. The upper bound, not
  the point estimate: with eight models of about six votes each, a point estimate of tau^2 is
  often 0, and pooling on it undercovered (0.83 of cells in tests/evaluation/test_ppi.py's
  simulation; 0.93-0.95 with the bound).
- Estimate: lambda mean(f over the cell's pairs) + the shrunk rectifier. Variance: the
  rectifier's, (1 - B_c) s^2 / n_c + B_c^2 / sum_c w_c with w_c = 1 / (s^2 / n_c + tau^2)
  (tau^2 + 1 / sum_c w_c for a cell without votes); no finite-population correction (it would
  narrow it by sqrt(1 - n_c / N_c)). Interval: estimate +- z sd, clipped to [0, 1].

Assumption: the votes are a uniform random sample of the group's pairs, and the cells' errors
are exchangeable, so the intervals hold at their level on average over a board's cells (the
empirical-Bayes guarantee), not cell by cell.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# Below this many votes in a group, s^2 and tau^2 rest on too few residuals for a normal interval
# (a handful of binary residuals often has variance 0): the cells report no interval.
MIN_VOTES = 20
# The confidence level of tau^2's upper bound. At 0.5 (tau^2's median-unbiased estimate) the demo
# study pooled more and covered 0.83-0.86 (docs/EVALUATION.md section 7): the bound is what keeps
# the intervals at their level. benchmarks/usl_coverage.py --spread-level sets it for that study.
SPREAD_LEVEL = 0.95


@dataclass(frozen=True)
class CellData:
    """One cell's inputs: the CRM's prediction (P(win), or its 0/1 verdict) on all its pairs and
    on its voted pairs, and the user's win indicator on the voted pairs (same order)."""

    predictions: Sequence[float]
    voted_predictions: Sequence[float] = ()
    votes: Sequence[float] = ()


@dataclass(frozen=True)
class Estimate:
    win_rate: float
    sd: float  # the estimate's standard deviation: an interval at any level is win_rate +- z sd
    votes: int

    def interval(self, level: float) -> tuple[float, float]:
        from scipy.stats import norm

        half = float(norm.ppf(0.5 + level / 2)) * self.sd
        return max(0.0, self.win_rate - half), min(1.0, self.win_rate + half)


def power_tuning(votes: np.ndarray, voted: np.ndarray, predictions: np.ndarray) -> float:
    """PPI++'s lambda for a mean (Angelopoulos et al. 2023) when the predictions' mean is exact
    (every pair judged: its n / N term drops), cov(Y, f) / var(f), clipped to [0, 1]."""
    var_f = float(np.var(predictions, ddof=1)) if len(predictions) > 1 else 0.0
    if len(votes) < 2 or var_f == 0.0:
        return 0.0
    cov = float(np.cov(votes, voted, ddof=1)[0, 1])
    return float(np.clip(cov / var_f, 0.0, 1.0))


def ppi_group(cells: Sequence[CellData], min_votes: int = MIN_VOTES,
              spread: float | None = None) -> list[Estimate | None]:
    """One Estimate per cell, pooled as the module says; None for every cell when the group holds
    fewer than `min_votes` votes, and for a cell without pairs. `spread`: a known tau^2 instead of
    its upper bound from the votes, for studies only (benchmarks/usl_coverage.py's oracle: how
    narrow the intervals could be if the CRM's true spread of error across cells were known)."""
    preds = [np.asarray(c.predictions, dtype=float) for c in cells]
    voted = [np.asarray(c.voted_predictions, dtype=float) for c in cells]
    ys = [np.asarray(c.votes, dtype=float) for c in cells]
    n = sum(len(y) for y in ys)
    if n < max(min_votes, 2):
        return [None] * len(cells)
    lam = power_tuning(np.concatenate(ys), np.concatenate(voted), np.concatenate(preds))
    residuals = [y - lam * f for y, f in zip(ys, voted)]
    with_votes = [i for i, r in enumerate(residuals) if len(r)]
    rect = {i: float(residuals[i].mean()) for i in with_votes}
    counts = {i: len(residuals[i]) for i in with_votes}
    within_df = n - len(with_votes)
    if within_df >= 10:  # enough repeated votes within cells to separate noise from spread
        s2 = sum(float(((residuals[i] - rect[i]) ** 2).sum()) for i in with_votes) / within_df
    else:  # around the pooled mean: includes the cells' spread, so it errs wide
        s2 = float(np.var(np.concatenate(residuals), ddof=1))
    s2 = max(s2, 1.0 / n)  # all residuals equal: variance 0 would claim certainty from n votes
    tau2 = _spread_upper_bound(rect, counts, s2) if spread is None else spread
    weights = {i: 1.0 / (s2 / counts[i] + tau2) for i in with_votes}
    total = sum(weights.values())
    pooled = sum(weights[i] * rect[i] for i in with_votes) / total
    out: list[Estimate | None] = []
    for i, f in enumerate(preds):
        if not len(f):  # a cell without pairs (a topic this selection lacks) has no rate
            out.append(None)
            continue
        if i in rect:
            noise = s2 / counts[i]
            shrink = noise / (noise + tau2)
            rectifier = shrink * pooled + (1 - shrink) * rect[i]
            rect_var = (1 - shrink) * noise + shrink ** 2 / total
        else:
            rectifier, rect_var = pooled, tau2 + 1.0 / total
        estimate = lam * float(f.mean()) + rectifier
        out.append(Estimate(float(np.clip(estimate, 0.0, 1.0)),
                            float(np.sqrt(rect_var)), len(ys[i])))
    return out


def _spread_upper_bound(rect: dict, counts: dict, s2: float) -> float:
    """The Q-profile upper confidence bound of the rectifiers' variance across cells: the tau^2
    where Q(tau^2) = sum_c w_c (d_c - d)^2, w_c = 1 / (s^2 / n_c + tau^2), d their weighted mean,
    falls to the chi-square (K - 1) quantile at 1 - SPREAD_LEVEL (Q decreases in tau^2:
    bisection)."""
    from scipy.stats import chi2

    if len(rect) < 2:
        return 0.0
    target = float(chi2.ppf(1 - SPREAD_LEVEL, len(rect) - 1))
    d = np.array(list(rect.values()))
    noise = s2 / np.array([counts[i] for i in rect], dtype=float)

    def q(tau2: float) -> float:
        w = 1.0 / (noise + tau2)
        return float((w * (d - (w * d).sum() / w.sum()) ** 2).sum())

    if q(0.0) <= target:
        return 0.0
    low, high = 0.0, 1.0  # a rectifier lies in [-1, 1]: its variance is below 1
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if q(middle) > target else (low, middle)
    return high


def wilson(votes: Sequence[float], level: float) -> tuple[float, float] | None:
    """The Wilson score interval of a win rate from votes alone (the votes-only comparison): the
    classical interval that stays honest at a handful of votes, where the normal one collapses
    to a point when every vote agrees."""
    from scipy.stats import norm

    n = len(votes)
    if n == 0:
        return None
    p = float(np.mean(votes))
    z = float(norm.ppf(0.5 + level / 2))
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def rank_sets(spans: Sequence[tuple[float, float]]) -> list[tuple[int, int]]:
    """[best, worst] rank per model from simultaneous intervals (each at level 1 - alpha / M):
    best = 1 + the models whose lower bound exceeds this one's upper bound, worst = M - the models
    whose upper bound lies below this one's lower bound. When all M intervals hold, which
    Bonferroni makes at least 1 - alpha likely, every true rank lies in its set."""
    m = len(spans)
    return [(1 + sum(other_low > high for other_low, _ in spans),
             m - sum(other_high < low for _, other_high in spans))
            for low, high in spans]
