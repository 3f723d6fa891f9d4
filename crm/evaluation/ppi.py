"""Win-rate intervals that carry the CRM's own error: prediction-powered inference (PPI++) from the
CRM's verdicts on every pair and the user's votes on a few (docs/DESIGN.md section 8.3,
docs/EVALUATION.md section 7).

Pure numpy and scipy's quantiles. ppi-python (the PPI authors' package) is not used: it imports
numba, statsmodels and scikit-learn for what is, for a mean, a few lines, and it has neither the
votes' inclusion weights nor the pooling across cells used here.

A group is the cells one board estimates together: its Overall cells (one per model), or its
(model, topic) cells. For each cell c: f = the CRM's prediction on each of its N_c pairs (the
leaderboard passes P(win) + tie_value P(tie)), and on its n_c voted pairs the user's outcome Y
(1 a win, tie_value a tie, 0 a loss) with the CRM's f beside it and the vote's weight w (its
inverse inclusion probability, crm.evaluation.suggest; 1 for a uniform sample).

- The estimand is the cell's win rate as the user would judge all its N_c pairs. The CRM has
  judged every one of them, so mean(f) over the cell is known, not sampled: PPI++'s power tuning
  becomes lambda = cov(Y, f) / var(f) (the regression, or difference, estimator of survey
  sampling), one per group, clipped to [0, 1]: 0 ignores the CRM (votes only), 1 is plain PPI.
- Each cell's rectifier d_c is the weighted (Hajek) mean of Y - lambda f over its votes, and the
  estimate lambda mean(f over the cell's pairs) + d_c.
- `ppi_separate` (Overall cells): each cell's variance is its own residuals' or the group's
  pooled within-cell variance, whichever is larger, over its effective votes (sum w)^2 / sum w^2;
  the interval takes Student's t at the pooled degrees of freedom. No cell borrows another's
  rectifier, so a model's interval holds at its level for that model, whatever the CRM's error
  on the others; Bonferroni over the M models (level 1 - alpha / M) makes the rank sets hold
  together (tests/evaluation/test_ppi.py: the Monte Carlo). Pooling the variance alone only
  floors a cell whose few votes happen to agree with the CRM.
- `ppi_topics` ((model, topic) cells, mostly 0-2 votes each), nested in their model's Overall
  cell so that they add up: a topic cell's rectifier is its model's d_m plus the topic's
  deviation from it, the deviations pooled by empirical Bayes (Morris 1983) across the board's
  topic cells: their spread tau^2 at its upper 95% confidence bound (the Q-profile, Viechtbauer
  2007), each shrunk toward 0 by B_c = (s^2 / n_c) / (s^2 / n_c + tau^2) (a cell without votes:
  0), then centred so that the model's cells, weighted by their pairs, average to its Overall.
  Variance: the Overall's plus (1 - B_c) s^2 / n_c (tau^2 without votes). These intervals hold
  on average over a board's cells (the empirical-Bayes guarantee), not cell by cell: a cell of
  a handful of votes has no per-cell interval worth reading.
- `ppi_pooled`: every cell's rectifier pooled by empirical Bayes toward the group's mean (the
  same Q-profile bound); valid on average over the cells. benchmarks/usl_coverage.py compares
  the Overall intervals with it at the true tau^2 (`spread`): the most pooling could lend.
- No finite-population correction (it would narrow an interval by sqrt(1 - n_c / N_c)).

Assumption: within each model, the votes are a random sample of its pairs: uniform, or drawn
with the inclusion probabilities their weights invert.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# Below this many votes in a group, the variances rest on too few residuals for an interval (a
# handful of binary residuals often has variance 0): the cells report no interval.
MIN_VOTES = 20
# The confidence level of tau^2's upper bound. At 0.5 (tau^2's median-unbiased estimate) the demo
# study pooled more and undercovered (docs/EVALUATION.md section 7): the bound is what keeps the
# pooled intervals at their level. benchmarks/usl_coverage.py --spread-level sets it for that study.
SPREAD_LEVEL = 0.95


@dataclass(frozen=True)
class CellData:
    """One cell's inputs: the CRM's prediction on all its pairs and on its voted pairs, the user's
    outcome on the voted pairs (same order) and each vote's weight (() : all equal)."""

    predictions: Sequence[float]
    voted_predictions: Sequence[float] = ()
    votes: Sequence[float] = ()
    weights: Sequence[float] = ()


@dataclass(frozen=True)
class Estimate:
    win_rate: float
    sd: float  # the estimate's standard deviation
    votes: int
    df: float | None = None  # Student t's degrees of freedom for the interval; None: normal

    def interval(self, level: float) -> tuple[float, float]:
        from scipy.stats import norm, t

        tail = 0.5 + level / 2
        quantile = norm.ppf(tail) if self.df is None else t.ppf(tail, self.df)
        half = float(quantile) * self.sd
        return max(0.0, self.win_rate - half), min(1.0, self.win_rate + half)


def power_tuning(votes: np.ndarray, voted: np.ndarray, predictions: np.ndarray) -> float:
    """PPI++'s lambda for a mean (Angelopoulos et al. 2023) when the predictions' mean is exact
    (every pair judged: its n / N term drops), cov(Y, f) / var(f), clipped to [0, 1]."""
    var_f = float(np.var(predictions, ddof=1)) if len(predictions) > 1 else 0.0
    if len(votes) < 2 or var_f == 0.0:
        return 0.0
    cov = float(np.cov(votes, voted, ddof=1)[0, 1])
    return float(np.clip(cov / var_f, 0.0, 1.0))


@dataclass(frozen=True)
class _Residuals:
    """A group's tuned residuals: lambda, each voted cell's Hajek rectifier and effective votes,
    and the within-cell variance pooled over the group."""

    lam: float
    rect: dict[int, float]  # cell -> weighted mean of Y - lambda f over its votes
    own: dict[int, float | None]  # cell -> its residuals' variance (None below 2 votes)
    effective: dict[int, float]  # cell -> (sum w)^2 / sum w^2: its votes' worth
    pooled: float  # s^2 pooled within cells
    df: int  # s^2's degrees of freedom
    votes: int


def _residuals(cells: Sequence[CellData]) -> _Residuals:
    ys = [np.asarray(c.votes, dtype=float) for c in cells]
    fs = [np.asarray(c.voted_predictions, dtype=float) for c in cells]
    ws = [np.asarray(c.weights, dtype=float) if len(c.weights) else np.ones(len(y))
          for c, y in zip(cells, ys)]
    n = sum(len(y) for y in ys)
    lam = power_tuning(np.concatenate(ys), np.concatenate(fs),
                       np.concatenate([np.asarray(c.predictions, dtype=float) for c in cells]))
    rect, own, effective, squares = {}, {}, {}, {}
    for i, (y, f, w) in enumerate(zip(ys, fs, ws)):
        if not len(y):
            continue
        r = y - lam * f
        rect[i] = float((w * r).sum() / w.sum())
        effective[i] = float(w.sum() ** 2 / (w ** 2).sum())
        # Weighted so that equal weights give the plain sample variance: sum w^2 (r - d)^2 /
        # sum w^2, times n / (n - 1)
        squares[i] = float((w ** 2 * (r - rect[i]) ** 2).sum() / (w ** 2).sum()) * len(r)
        own[i] = squares[i] / (len(r) - 1) if len(r) > 1 else None
    df = n - len(rect)
    if df >= 10:  # enough repeated votes within cells to separate noise from spread
        pooled = sum(squares.values()) / df
    else:  # around the pooled mean: includes the cells' spread, so it errs wide
        everything = np.concatenate([y - lam * f for y, f in zip(ys, fs)])
        pooled, df = float(np.var(everything, ddof=1)), n - 1
    pooled = max(pooled, 1.0 / n)  # all residuals equal: variance 0 would claim certainty
    return _Residuals(lam, rect, own, effective, pooled, df, n)


def ppi_separate(cells: Sequence[CellData], min_votes: int = MIN_VOTES
                 ) -> list[Estimate | None]:
    """One Estimate per cell, each valid for its own cell (the module's `ppi_separate`); None for
    every cell below `min_votes` votes in the group, and for a cell without pairs or votes."""
    if sum(len(c.votes) for c in cells) < max(min_votes, 2):
        return [None] * len(cells)
    res = _residuals(cells)
    out: list[Estimate | None] = []
    for i, cell in enumerate(cells):
        if i not in res.rect or not len(cell.predictions):
            out.append(None)
            continue
        variance = max(res.own[i] or 0.0, res.pooled) / res.effective[i]
        estimate = res.lam * float(np.mean(cell.predictions)) + res.rect[i]
        out.append(Estimate(float(np.clip(estimate, 0.0, 1.0)), float(np.sqrt(variance)),
                            len(cell.votes), float(res.df)))
    return out


def ppi_topics(models: Sequence[CellData], topics: Sequence[Sequence[CellData]],
               min_votes: int = MIN_VOTES) -> list[list[Estimate | None]]:
    """Each model's topic cells (`topics[m]`, the cells of `models[m]`'s pairs by topic), nested
    in its Overall cell as the module's `ppi_topics` says; None where the model has no Overall
    estimate (below `min_votes` on the board, or no vote on it) and for a cell without pairs."""
    if sum(len(c.votes) for c in models) < max(min_votes, 2):
        return [[None] * len(cells) for cells in topics]
    res = _residuals(models)
    deviation, counts, squares, spread_of = {}, {}, 0.0, []
    for m, cells in enumerate(topics):
        for t, cell in enumerate(cells):
            if m not in res.rect or not len(cell.votes):
                continue
            y, f = np.asarray(cell.votes, float), np.asarray(cell.voted_predictions, float)
            w = np.asarray(cell.weights, float) if len(cell.weights) else np.ones(len(y))
            e = y - res.lam * f - res.rect[m]
            deviation[m, t] = float((w * e).sum() / w.sum())
            counts[m, t] = float(w.sum() ** 2 / (w ** 2).sum())
            squares += float((w ** 2 * (e - deviation[m, t]) ** 2).sum() / (w ** 2).sum()) * len(e)
            spread_of.extend(e)
    n = len(spread_of)
    df = n - len(deviation)
    s2 = squares / df if df >= 10 else float(np.var(spread_of, ddof=1)) if n > 1 else 1.0
    s2 = max(s2, 1.0 / max(n, 1))
    tau2 = _spread_upper_bound(deviation, counts, s2)
    out: list[list[Estimate | None]] = []
    for m, cells in enumerate(topics):
        if m not in res.rect:
            out.append([None] * len(cells))
            continue
        shrunk, extra = {}, {}
        for t, cell in enumerate(cells):
            if (m, t) in deviation:
                noise = s2 / counts[m, t]
                keep = tau2 / (noise + tau2) if noise + tau2 else 0.0
                shrunk[t], extra[t] = keep * deviation[m, t], keep * noise
            else:
                shrunk[t], extra[t] = 0.0, tau2
        sizes = {t: len(cell.predictions) for t, cell in enumerate(cells)}
        centre = sum(sizes[t] * shrunk[t] for t in shrunk) / max(sum(sizes.values()), 1)
        model_var = max(res.own[m] or 0.0, res.pooled) / res.effective[m]
        row: list[Estimate | None] = []
        for t, cell in enumerate(cells):
            if not sizes[t]:  # a topic this selection lacks
                row.append(None)
                continue
            estimate = (res.lam * float(np.mean(cell.predictions)) + res.rect[m] + shrunk[t]
                        - centre)
            row.append(Estimate(float(np.clip(estimate, 0.0, 1.0)),
                                float(np.sqrt(model_var + extra[t])), len(cell.votes),
                                float(res.df)))
        out.append(row)
    return out


def ppi_pooled(cells: Sequence[CellData], min_votes: int = MIN_VOTES,
               spread: float | None = None) -> list[Estimate | None]:
    """One Estimate per cell, pooled by empirical Bayes as the module says; None for every cell
    when the group holds fewer than `min_votes` votes, and for a cell without pairs. `spread`: a
    known tau^2 instead of its upper bound from the votes, for studies only
    (benchmarks/usl_coverage.py's oracle: how narrow the intervals could be if the CRM's true
    spread of error across cells were known)."""
    if sum(len(c.votes) for c in cells) < max(min_votes, 2):
        return [None] * len(cells)
    res = _residuals(cells)
    s2 = res.pooled
    counts = res.effective
    tau2 = _spread_upper_bound(res.rect, counts, s2) if spread is None else spread
    weights = {i: 1.0 / (s2 / counts[i] + tau2) for i in res.rect}
    total = sum(weights.values())
    pooled = sum(weights[i] * res.rect[i] for i in res.rect) / total
    out: list[Estimate | None] = []
    for i, cell in enumerate(cells):
        if not len(cell.predictions):  # a cell without pairs (a topic this selection lacks)
            out.append(None)
            continue
        if i in res.rect:
            noise = s2 / counts[i]
            shrink = noise / (noise + tau2)
            rectifier = shrink * pooled + (1 - shrink) * res.rect[i]
            rect_var = (1 - shrink) * noise + shrink ** 2 / total
        else:
            rectifier, rect_var = pooled, tau2 + 1.0 / total
        estimate = res.lam * float(np.mean(cell.predictions)) + rectifier
        out.append(Estimate(float(np.clip(estimate, 0.0, 1.0)), float(np.sqrt(rect_var)),
                            len(cell.votes)))
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
