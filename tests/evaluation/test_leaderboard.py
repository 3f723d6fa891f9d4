"""The USL (crm.evaluation.leaderboard) and crm-leaderboard (crm.cli.leaderboard): selection of
benchmark lines, win-rate and micro-averaged Overall arithmetic, Kendall tau, the rendered
outputs, the command."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import glyphs_the_font_lacks, refused
from scorers import export_tiny, run_cli, tiny_scorer

from crm.cli.leaderboard import run
from crm.evaluation.leaderboard import (CRM_IS_USER, DEFAULT_CRITERIA, LOSS, TIE, WIN, Bootstrap,
                                       Outcome, bench_fingerprint, bootstrap_intervals, judge,
                                       kendall_tau, leaderboard, rank_upper_bounds, select,
                                       win_rates)
from crm.evaluation.render import (_LABEL_WIDTH, bar_label_place, interval, markdown, plot,
                                   slope_positions)
from crm.evaluation.user_votes import Votes
from crm.core.errors import ConfigError
from crm.core.examples import LABEL_B


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def bench_line(idx, topic, responses: dict) -> dict:
    return {"idx": idx, "topic": topic, "prompt": f"question {idx}", "responses": responses}


def write_bench(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


class StubScorer:
    """P(A), P(B), P(tie) read from the slot-B response's text: 'win', 'lose', 'even' (a score tie)
    or 'tie' (the tie class). Records the examples it was given."""

    kind = "pairwise"
    TABLE = {"win": [0.2, 0.8, 0.0], "lose": [0.8, 0.2, 0.0], "even": [0.5, 0.5, 0.0],
             "tie": [0.2, 0.2, 0.6]}

    def __init__(self):
        self.examples = []
        self.counts = {}

    def pair_probabilities(self, examples, unfit="raise", both_orders=False):
        self.examples += examples
        return torch.tensor([self.TABLE[e.conv_b[-1].content.split()[0]] for e in examples])


# -- the arithmetic -------------------------------------------------------------------------------

def test_win_rates_are_micro_averaged_with_ties_apart():
    outcomes = [Outcome("m1", "small", WIN, 0.9)]                                   # 1 / 1
    outcomes += [Outcome("m1", "big", r, 0.4) for r in (WIN, LOSS, LOSS)]           # 1 / 3
    outcomes += [Outcome("m2", "small", LOSS, 0.1)]                                 # 0 / 1
    outcomes += [Outcome("m2", "big", r, 0.6) for r in (WIN, WIN, TIE)]             # 2 / 3
    rows = win_rates(outcomes, ["m1", "m2"], ["small", "big"])
    by = {r["model"]: r for r in rows}
    assert by["m1"]["overall"] == {"n": 4, "wins": 2, "ties": 0, "losses": 2, "win_rate": 0.5,
                                   "ci_low": 0.0, "ci_high": 1.0,
                                   "tie_rate": 0.0, "mean_p_win": 0.525, "votes": 0}
    # micro: (0 + 2) / 4, not the mean of the topic rates (0 + 0.667) / 2
    assert by["m2"]["overall"] == {"n": 4, "wins": 2, "ties": 1, "losses": 1, "win_rate": 0.5,
                                   "ci_low": 0.0, "ci_high": 1.0,
                                   "tie_rate": 0.25, "mean_p_win": 0.475, "votes": 0}
    assert by["m1"]["topics"]["small"]["win_rate"] == 1.0
    assert by["m1"]["topics"]["big"]["win_rate"] == round(1 / 3, 4)
    assert by["m2"]["topics"]["big"] == {"n": 3, "wins": 2, "ties": 1, "losses": 0,
                                         "win_rate": round(2 / 3, 4), "ci_low": 0.0,
                                         "ci_high": 1.0, "tie_rate": round(1 / 3, 4),
                                         "mean_p_win": 0.6, "votes": 0}
    # one example: no interval
    assert by["m1"]["topics"]["small"]["ci_low"] is None
    # equal win rates share a rank, listed by mean P(win); the intervals cannot tell them apart
    assert [(r["rank"], r["rank_ub"], r["model"]) for r in rows] == [(1, 1, "m1"), (1, 1, "m2")]
    assert [r["rank_set"] for r in rows] == [[1, 2], [1, 2]]


def test_a_tie_is_worth_tie_value_in_the_crms_rates_and_the_users_votes_alike():
    """interval.tie_value 0.5: a tie is half a win in the win rate, the bootstrap's samples, the
    CRM's prediction PPI corrects (P(win) + 0.5 P(tie)) and the user's votes; 0 (the default) is
    no win; the board says which."""
    outcomes = [Outcome(m, "t", TIE, 0.05, f"q{i}", 0.9) for m in ("m1", "m2") for i in range(30)]
    half, none = Bootstrap(tie_value=0.5), Bootstrap()
    by = {r["model"]: r["overall"] for r in win_rates(outcomes, ["m1", "m2"], ["t"], half)}
    assert by["m1"]["win_rate"] == 0.5 and by["m1"]["ci_low"] == by["m1"]["ci_high"] == 0.5
    assert win_rates(outcomes, ["m1", "m2"], ["t"], none)[0]["overall"]["win_rate"] == 0.0
    votes = {(f"q{i}", m): TIE for m in ("m1", "m2") for i in range(12)}  # the user agrees
    for spec, expected in ((half, 0.5), (none, 0.0)):
        ppi = win_rates(outcomes, ["m1", "m2"], ["t"], replace(spec, method="ppi"), votes)
        assert ppi[0]["overall"]["win_rate"] == pytest.approx(expected, abs=1e-9)
        assert ppi[0]["overall"]["ci_low"] <= expected <= ppi[0]["overall"]["ci_high"]
    with pytest.raises(ValueError, match="interval.tie_value=2: what a tie is worth"):
        win_rates(outcomes, ["m1"], ["t"], Bootstrap(tie_value=2))
    result = {"baseline": "b", "topics": ["t"], "both_orders": False, "votes": None,
              "examples": {"used": 30, "rejected": 0, "outside_topics": 0, "read": 30},
              "interval": {"level": 0.95, "tie_value": 0.5}, "boards": [], "rejects": []}
    assert "a tie counting as half a win" in markdown(result)
    assert "a tie counting as no win" in markdown({**result, "interval": {"tie_value": 0}})


def test_bootstrap_intervals_by_hand():
    # two examples, one won: a resample of 2 draws holds 0, 1 or 2 wins with probability 1/4,
    # 1/2, 1/4, so the 2.5th and 97.5th percentiles of the resampled rates are 0 and 1; all won:
    # every resample is all won; one example: no interval
    assert bootstrap_intervals([[1, 0], [1, 1, 1], [1]]) == [(0.0, 1.0), (1.0, 1.0), None]
    # 100 examples, half won: the rate's standard error is sqrt(.5 * .5 / 100) = 0.05, so the
    # interval is about 0.5 -/+ 1.96 * 0.05 (resampling noise at 1000 resamples: about 0.01)
    half = [1.0, 0.0] * 50
    (low, high), = bootstrap_intervals([half])
    assert low == pytest.approx(0.5 - 1.96 * 0.05, abs=0.015)
    assert high == pytest.approx(0.5 + 1.96 * 0.05, abs=0.015)
    # seeded: the same again; a 50% level is narrower
    assert bootstrap_intervals([half]) == [(low, high)]
    (low50, high50), = bootstrap_intervals([half], Bootstrap(level=0.5))
    assert low < low50 < 0.5 < high50 < high
    # Arena-Hard's notation, in points of %
    assert interval({"win_rate": 0.5, "ci_low": low, "ci_high": high}) == (
        f"(-{100 * (0.5 - low):.1f} / +{100 * (high - 0.5):.1f})")
    assert interval({"win_rate": 1.0, "ci_low": None, "ci_high": None}) == ""


def test_rank_upper_bound_counts_the_models_wholly_above():
    def row(low, high):
        return {"overall": {"win_rate": (low + high) / 2, "ci_low": low, "ci_high": high}}

    # a [.6, .8] and b [.5, .7] overlap: both may be first; c [.1, .3] is below both; d [.25, .4]
    # overlaps c only: c's bound counts a and b, d's too
    rows = [row(.6, .8), row(.5, .7), row(.1, .3), row(.25, .4)]
    assert rank_upper_bounds(rows) == [1, 1, 3, 3]


def test_judge_puts_the_baseline_in_slot_a_and_counts_wins_ties_losses(tmp_path):
    path = write_bench(tmp_path / "bench.jsonl", [
        bench_line(0, "t1", {"base": "b0", "m1": "win", "m2": "lose"}),
        bench_line(1, "t1", {"base": "b1", "m1": "even", "m2": "win"}),
        bench_line(2, "t2", {"base": "b2", "m1": "tie", "m2": "win"}),
        bench_line(3, "t2", {"base": "b3", "m1": "win", "m2": "win"}),
        bench_line(4, "t2", {"base": "b4", "m1": "lose", "m2": "win"}),
    ])
    selection = select(path, "base")
    assert selection.models == ("m1", "m2") and selection.topics == ("t1", "t2")
    scorer = StubScorer()
    outcomes = judge(scorer, selection, ["be brief"])
    first = scorer.examples[0]
    assert first.conv_a[-1].content == "b0" and first.conv_b[-1].content == "win"
    assert first.criteria == ("be brief",) and first.query == "question 0"
    assert [o.result for o in outcomes if o.model == "m1"] == [WIN, TIE, TIE, WIN, LOSS]
    assert outcomes[0].p_win == pytest.approx(StubScorer.TABLE["win"][LABEL_B])
    # the tie class's probability kept; P(loss) is the baseline's slot, A
    tie = [o for o in outcomes if o.model == "m1"][2]  # StubScorer's "tie": [0.2, 0.2, 0.6]
    assert (tie.p_win, tie.p_tie, tie.p_loss) == pytest.approx((0.2, 0.6, 0.2))
    rows = win_rates(outcomes, selection.models, selection.topics)
    by = {r["model"]: r for r in rows}
    assert by["m2"]["overall"]["win_rate"] == 0.8 and by["m2"]["rank"] == 1
    assert by["m1"]["overall"]["win_rate"] == 0.4 and by["m1"]["overall"]["ties"] == 2
    assert by["m1"]["topics"]["t1"]["win_rate"] == 0.5
    assert by["m1"]["topics"]["t2"]["win_rate"] == round(1 / 3, 4)


def test_kendall_tau_of_identical_and_reversed_rankings():
    rows = [{"model": m, "rank": i + 1} for i, m in enumerate("abcd")]
    reversed_rows = [{"model": m, "rank": 4 - i} for i, m in enumerate("abcd")]
    assert kendall_tau(rows, rows)["tau"] == 1.0
    assert kendall_tau(rows, reversed_rows)["tau"] == -1.0
    one_swap = [{"model": m, "rank": r} for m, r in zip("abcd", (2, 1, 3, 4))]
    assert kendall_tau(rows, one_swap)["tau"] == round(4 / 6, 4)  # (5 - 1) / 6 pairs
    # tau-b with a shared rank: a-b tied in one ranking; 5 pairs concordant, none discordant,
    # sqrt(5 x 6) in the denominator
    tied = [{"model": m, "rank": r} for m, r in zip("abcd", (1, 1, 3, 4))]
    assert kendall_tau(rows, tied)["tau"] == round(5 / (5 * 6) ** 0.5, 4)


def test_a_bars_label_is_never_struck_through_by_its_interval():
    """leaderboard.png's "NN%" labels: wherever the interval lies, the label on the bar's centre
    line keeps clear of the interval's line, and stays on the axis; an interval over nearly the
    whole axis moves the label above the line. (Inside at the bar's base, as before, struck a
    wide PPI interval through.)"""
    import itertools

    for value, low, high in itertools.product(range(0, 101, 5), repeat=3):
        if not low <= value <= high:
            continue
        x, ha, dy = bar_label_place(value, low, high)
        start, end = (x, x + _LABEL_WIDTH) if ha == "left" else (x - _LABEL_WIDTH, x)
        assert 0 <= start and end <= 100
        if dy == 0:
            assert end < low or start > high, (value, low, high)
    assert bar_label_place(60, 5, 95)[2] != 0  # no room either side: above the line
    assert bar_label_place(60, 40, 80) == (2.0, "left", 0.0)  # clear: at the base as before
    assert bar_label_place(60, None, None) == (2.0, "left", 0.0)


def test_models_sharing_a_rank_stand_around_it_on_the_slope_chart_and_say_so():
    rows = [{"model": m, "rank": r} for m, r in zip("abcde", (1, 2, 2, 2, 5))]
    heights, labels = slope_positions(rows)
    assert heights["a"] == 1 and heights["e"] == 5
    assert heights["b"] < heights["c"] == 2 < heights["d"] and heights["d"] - heights["b"] <= 0.8
    assert labels == {"a": "a", "b": "b (=2)", "c": "c (=2)", "d": "d (=2)", "e": "e"}


def test_an_undefined_kendall_tau_is_null_with_its_reason_and_json_holds_no_nan(tmp_path):
    """One model (or a ranking all ties) has no order: scipy's NaN would make leaderboard.json
    invalid JSON for most parsers."""
    from crm.core.files import write_json

    alone = kendall_tau([{"model": "a", "rank": 1}], [{"model": "a", "rank": 1}])
    assert alone == {"tau": None, "p_value": None, "models": 1,
                     "reason": "one model: no order to compare"}
    tied = [{"model": m, "rank": 1} for m in "ab"]
    assert kendall_tau(tied, [{"model": "a", "rank": 1}, {"model": "b", "rank": 2}])["tau"] is None
    written = write_json(tmp_path / "doc.json", {"tau": float("nan"), "rows": [float("inf"), 0.5]})
    assert json.loads(written.read_text()) == {"tau": None, "rows": [None, 0.5]}
    assert "NaN" not in written.read_text() and "Infinity" not in written.read_text()


# -- selecting benchmark lines --------------------------------------------------------------------

def test_topic_selection_counts_the_lines_left_out(tmp_path):
    path = write_bench(tmp_path / "bench.jsonl", [
        bench_line(i, ("a", "b", "c")[i % 3], {"base": "x", "m": "win"}) for i in range(7)])
    selection = select(path, "base", topics=["c", "a"])
    assert selection.topics == ("a", "c")  # the benchmark's order
    assert {r.topic for r in selection.records} == {"a", "c"}
    assert selection.counts == {"read": 7, "used": 5, "rejected": 0, "outside_topics": 2}
    with pytest.raises(ValueError, match=r"topics=\['d'\] not in the benchmark \(topics: a, b, c\)"):
        select(path, "base", topics=["a", "d"])


def test_a_line_missing_the_baseline_or_a_model_is_reported_not_skipped(tmp_path):
    path = write_bench(tmp_path / "bench.jsonl", [
        bench_line(0, "t", {"base": "x", "m1": "win", "m2": "win"}),
        bench_line(1, "t", {"m1": "win", "m2": "win"}),              # no baseline
        bench_line(2, "t", {"base": "x", "m1": "win"}),              # no m2
        '{"idx": 3, "topic": "t", "prompt": "q", "responses": ',     # broken JSON
        bench_line(4, "t", {"base": "x", "m1": "lose", "m2": "win"}),
        bench_line(0, "t", {"base": "y", "m1": "win", "m2": "win"}),  # line 1's idx again
    ])
    selection = select(path, "base")
    assert selection.counts == {"read": 6, "used": 2, "rejected": 4, "outside_topics": 0}
    rejects = sorted(selection.rejects, key=lambda r: r["line"])
    assert [(r["file"], r["line"], r["field"]) for r in rejects] == [
        (str(path), 2, "responses.base"), (str(path), 3, "responses.m2"), (str(path), 4, ""),
        (str(path), 6, "idx")]
    assert "baseline 'base'" in rejects[0]["reason"] and "bad JSON" in rejects[2]["reason"]
    assert rejects[3]["reason"] == "idx '0' is line 1's too: each query once"
    # ranking only m1: the line without m2 is usable again
    assert select(path, "base", models=["m1"]).counts["used"] == 3
    # and the outputs say so
    result = leaderboard(StubScorer(), selection, ["be brief"])
    assert result["examples"]["rejected"] == 4 and len(result["rejects"]) == 4
    text = markdown(result)
    assert f"{path}:2: responses.base: no response from the baseline" in text
    assert "2 examples used (4 rejected, 0 outside the selected topics, 6 read)" in text


def test_a_baseline_or_model_absent_everywhere_is_an_error(tmp_path):
    path = write_bench(tmp_path / "bench.jsonl", [bench_line(0, "t", {"base": "x", "m": "win"})])
    with pytest.raises(ValueError, match="baseline 'gpt' has no response in any line"):
        select(path, "gpt")
    with pytest.raises(ValueError, match=r"models=\['nope'\] have no response"):
        select(path, "base", models=["nope"])


# -- outputs --------------------------------------------------------------------------------------

def test_markdown_and_png_with_a_contrast_set(tmp_path):
    lines = [bench_line(i, ("t1", "t2")[i % 2], {"base": "x", "m1": ("win", "lose")[i % 2],
                                                  "m2": "win", "m3": "lose"}) for i in range(4)]
    selection = select(write_bench(tmp_path / "bench.jsonl", lines), "base")

    class Flipping(StubScorer):
        """Under the contrast criteria every verdict reverses."""

        def pair_probabilities(self, examples, unfit="raise", both_orders=False):
            p = super().pair_probabilities(examples)
            return p[:, [1, 0, 2]] if examples[0].criteria == ("long",) else p

    result = leaderboard(Flipping(), selection, ["short"], contrast=["long"],
                         labels=("concise", "detailed"))
    assert [b["label"] for b in result["boards"]] == ["concise", "detailed"]
    assert [r["model"] for r in result["boards"][0]["rows"]] == ["m2", "m1", "m3"]
    assert [r["model"] for r in result["boards"][1]["rows"]] == ["m3", "m1", "m2"]
    assert result["kendall_tau"]["tau"] == -1.0
    text = markdown(result)
    assert "| Rank | Rank (UB) | Rank set | Model | Overall | 95% CI | t1 | t2 |" in text
    # m2 won all 4, m3 lost all 4, m1 half: at the simultaneous level (1 - 0.05 / 3) a resample
    # of m1's 4 outcomes can be all won or all lost, so m1 may hold any rank; m2 and m3 only
    # trade places with m1
    assert [r["rank_set"] for r in result["boards"][0]["rows"]] == [[1, 2], [1, 3], [2, 3]]
    assert ("| 1 | 1 | 1-2 | m2 | **100.0** | (-0.0 / +0.0) | 100.0 (-0.0 / +0.0) | "
            "100.0 (-0.0 / +0.0) |" in text)
    m1 = next(r for r in result["boards"][0]["rows"] if r["model"] == "m1")["overall"]
    assert m1["win_rate"] == 0.5 and m1["ci_low"] < 0.5 < m1["ci_high"]
    assert (f"| 2 | 1 | 1-3 | m1 | **50.0** | {interval(m1)} | 100.0 (-0.0 / +0.0) | "
            f"0.0 (-0.0 / +0.0) |") in text
    assert result["interval"] == {"level": 0.95, "resamples": 1000, "seed": 0,
                                  "method": "bootstrap", "min_votes": 20, "tie_value": 0.0,
                                  "assumes": CRM_IS_USER}
    # without votes every output says whom the intervals trust
    assert text.count(CRM_IS_USER) == 2  # one line per board
    assert all(b["assumes"] == CRM_IS_USER for b in result["boards"])
    assert "Kendall tau between the two rankings: **-1.000**" in text
    png = plot(result, tmp_path / "leaderboard.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_a_long_criteria_title_stays_clear_of_the_heatmaps_label(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    # Tied models with long names (an emoji drawn as its name, "(=1)"), three criteria a set, a
    # long board label: what ran into the heatmap, hid criteria and reached the image's edge.
    models = {"base": "x", "terse-🤖": "win", "verbose-assistant-v2": "win", "m2": "lose"}
    lines = [bench_line(i, ("t1", "t2")[i % 2], models) for i in range(4)]
    selection = select(write_bench(tmp_path / "bench.jsonl", lines), "base")
    result = leaderboard(StubScorer(), selection,
                         ["be concise and direct, never pad an answer with restatements",
                          "no filler words or pleasantries of any kind", "answer first"],
                         contrast=["long " * 40, "and two", "more"],
                         labels=("short", "detailed and thorough explanations of every step"))
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to measure its texts
    plot(result, tmp_path / "leaderboard.png")
    (fig,) = figures
    renderer = fig.canvas.get_renderer()
    bars, heats = fig.axes[0:4:2], fig.axes[1:4:2]
    for bar, heat in zip(bars, heats):
        title = bar._left_title.get_window_extent(renderer)  # matplotlib keeps loc="left" titles here
        label = heat._right_title.get_window_extent(renderer)
        assert not title.overlaps(label) and title.y0 > label.y0
        assert title.x1 <= heat.get_window_extent(renderer).x1  # wrapped within bars + heatmap
    # A title too long for its two lines says how many criteria it leaves out (it showed the
    # first, cut, as if there were no other): whole criteria as far as they fit, else the first
    # shortened.
    assert [bar._left_title.get_text() for bar in bars] == [
        "short: \u201cbe concise and direct, never pad an answer with\nrestatements\u201d "
        "(+2 more in leaderboard.md)",
        "detailed and thorough explanations of every step: \u201clong long\nlong long long long long "
        "long lo\u2026 (+2 more in leaderboard.md)"]
    # The slope chart's labels stand in its own axes, clear of the heatmaps on their left (a long
    # tied name ran into them).
    slope = fig.axes[4]
    labels = [text.get_window_extent(renderer) for text in slope.texts]
    assert "terse-:robot face: (=1)" in [text.get_text() for text in slope.texts]
    edge = slope.get_window_extent(renderer)
    assert all(edge.x0 <= label.x0 and label.x1 <= edge.x1 for label in labels)
    assert all(label.x0 > heat.get_tightbbox(renderer).x1 for label in labels for heat in heats)
    # The figure's title clears the first board's (it overprinted it), no wider than the panels
    # (its third line reached the image's edge), and says which orders were judged: one order
    # lets a slot-biased CRM decide the board.
    main = fig._suptitle.get_window_extent(renderer)
    assert not main.overlaps(bars[0]._left_title.get_window_extent(renderer))
    assert main.x1 <= max(ax.get_tightbbox(renderer).x1 for ax in fig.axes)
    assert "baseline in slot A only" in fig._suptitle.get_text()
    lower_title = bars[1]._left_title.get_window_extent(renderer)
    assert not lower_title.overlaps(bars[0].xaxis.label.get_window_extent(renderer))


def test_emoji_and_scripts_the_font_lacks_are_drawn_as_stand_ins_and_kept_in_md_and_json(
        tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from crm.core.files import write_json

    models = {"base": "x", "m🚀": "win", "模型": "lose"}
    lines = [bench_line(i, ("t🌮", "t2")[i % 2], models) for i in range(4)]
    selection = select(write_bench(tmp_path / "bench.jsonl", lines), "base")
    criteria = ["be kind 🙏", "costs $5 not $50"]  # two `$`: mathtext, unless escaped
    result = leaderboard(StubScorer(), selection, criteria, contrast=["slow 🐢"],
                         labels=("kind 🙏", "slow 🐢"))
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to read its texts
    plot(result, tmp_path / "leaderboard.png")
    (fig,) = figures
    drawn = [t.get_text() for t in fig.findobj(plt.Text)]
    assert glyphs_the_font_lacks(fig) == []
    assert "m:rocket:  [1]" in drawn and "??  [2]" in drawn  # the bars' model names
    assert "t:taco:" in drawn  # a topic of the heatmap
    assert any(r"“costs \$5 not \$50”" in t for t in drawn)  # a board's title: drawn as written
    assert {"kind :person\nwith folded\nhands:", "slow :turtle:", "m:rocket:"} <= set(drawn)  # slopes
    # the text files keep the user's text exactly
    text = markdown(result)
    assert '"be kind 🙏" / "costs $5 not $50"' in text and "| m🚀 |" in text and "t🌮" in text
    saved = json.loads(write_json(tmp_path / "leaderboard.json", result).read_text(encoding="utf-8"))
    assert saved["models"] == ["m🚀", "模型"] and saved["boards"][0]["criteria"] == criteria
    assert saved["boards"][1]["label"] == "slow 🐢" and saved["topics"] == ["t🌮", "t2"]


def test_prefix_reuse_gives_the_same_leaderboard(tmp_path):
    lines = [bench_line(i, "t", {"base": "alpha reply " * (2 + i), "m1": "beta reply",
                                 "m2": "beta reply answer " * 3, "m3": "the answer"})
             for i in range(3)]
    selection = select(write_bench(tmp_path / "bench.jsonl", lines), "base")
    plain = tiny_scorer(prefix_reuse=False)
    reused = tiny_scorer(prefix_reuse=True, batch_size=2)
    p_plain = [o.p_win for o in judge(plain, selection, ["concise answer"])]
    p_reused = [o.p_win for o in judge(reused, selection, ["concise answer"])]
    assert p_reused == pytest.approx(p_plain, abs=1e-4)
    assert reused.counts["prefix_sequences"] == 9 and plain.counts["prefix_sequences"] == 0


def test_a_pair_too_long_to_fit_is_an_error_that_names_it(tmp_path):
    # m2 answers in 40 turns: even shortened to 16 tokens a message, too long for 300 tokens
    turns = [{"role": "user", "content": "question 0"}]
    turns += [{"role": r, "content": "beta reply " * 20} for _ in range(20)
              for r in ("assistant", "user")][:-1]
    path = write_bench(tmp_path / "bench.jsonl", [
        bench_line(0, "t", {"base": "alpha", "m1": "beta", "m2": turns})])
    with pytest.raises(ValueError, match="1 pairs .* cannot fit in 300 tokens .*: 0/m2$"):
        judge(tiny_scorer(max_tokens=300), select(path, "base"), ["concise answer"])


def test_a_board_leaves_out_a_query_too_long_to_fit_for_every_model_and_counts_it(tmp_path):
    """crm-leaderboard's board: counted unscorable (as crm-eval counts a test pair), the query
    left out for every model so all are ranked on the same examples; none fitting is one line."""
    turns = [{"role": "user", "content": "question 0"}]
    turns += [{"role": r, "content": "beta reply " * 20} for _ in range(20)
              for r in ("assistant", "user")][:-1]
    path = write_bench(tmp_path / "bench.jsonl", [
        bench_line(0, "t", {"base": "alpha", "m1": "beta", "m2": turns}),
        bench_line(1, "t", {"base": "alpha", "m1": "beta", "m2": "beta two"})])
    scorer = tiny_scorer(max_tokens=300)
    judgments = []
    doc = leaderboard(scorer, select(path, "base"), ["concise answer"], judgments=judgments)
    (board,) = doc["boards"]
    assert board["unscorable"] == {"pairs": 1, "queries": 1, "first": ["0/m2"]}
    # a query left out is judged for no model: judgments.jsonl has no line of it
    assert [(j["idx"], j["model"]) for j in judgments] == [("1", "m1"), ("1", "m2")]
    assert [r["overall"]["n"] for r in board["rows"]] == [1, 1]
    assert ("1 queries left out for every model: 1 pairs cannot fit the CRM's tokens (first: 0/m2)"
            in markdown(doc))
    # votes on the left-out query never reach the estimator: counted apart, not as used
    votes = Votes("votes.jsonl", {("0", "m1"): "win", ("1", "m1"): "loss", ("1", "m2"): "win"})
    voted = leaderboard(scorer, select(path, "base"), ["concise answer"], votes=votes)
    assert voted["votes"] == {"file": "votes.jsonl", "read": 3, "used": 2, "outside_topics": 0,
                              "on_rejected_lines": 0, "unscorable": 1}
    assert "Votes: 2 used of 3 read" in markdown(voted)
    assert "1 on pairs the CRM could not score" in markdown(voted)
    # counts in = counts out: the header's used is the rows' n, the left-out query counted beside
    counts = doc["examples"]
    assert counts == {"read": 2, "used": 1, "left_out": 1, "rejected": 0, "outside_topics": 0}
    assert board["used"] == 1
    assert ("1 examples used (1 left out: too long for the CRM's tokens, 0 rejected, 0 outside the "
            "selected topics, 2 read)" in markdown(doc))
    # prompts shortened to fit are said where the user reads (crm-leaderboard prints the markdown)
    doc["sequences"] = {"shortened": 3}
    assert "3 prompt(s) had responses shortened to fit the CRM's tokens" in markdown(doc)
    only_long = write_bench(tmp_path / "long.jsonl", [
        bench_line(0, "t", {"base": "alpha", "m1": turns, "m2": turns})])
    with pytest.raises(ConfigError, match="no benchmark query fits in 300 tokens under the "
                                          "criteria criteria.*: shorten the criteria$"):
        leaderboard(scorer, select(only_long, "base"), ["concise answer"])


def test_a_pointwise_model_scores_each_baseline_response_once(tmp_path):
    selection = select(demo_like_bench(tmp_path), "base")
    scorer = tiny_scorer("pointwise")
    outcomes = judge(scorer, selection, ["concise answer"])
    assert len(outcomes) == 6 * 3
    assert scorer.counts["sequences"] == 6 * (3 + 1)  # each query: the baseline once, 3 models
    assert all(o.result in (WIN, LOSS, TIE) and 0.0 < o.p_win < 1.0 for o in outcomes)


def test_the_demo_benchmark_reverses_under_contradictory_length_criteria(tmp_path):
    """With a judge that follows the criteria (here: word counts), "detailed" and "concise" rank
    the demo's models in opposite orders: what a trained CRM should reproduce in `make demo`."""
    from crm.data.demo import BENCH_BASELINE, BENCH_MODELS, write_demo

    class LengthJudge(StubScorer):
        def pair_probabilities(self, examples, unfit="raise", both_orders=False):
            rows = []
            for e in examples:
                words = [sum(len(m.content.split()) for m in c) for c in (e.conv_a, e.conv_b)]
                sign = 1.0 if e.criteria == ("detailed",) else -1.0
                p_b = float(torch.sigmoid(torch.tensor(sign * (words[1] - words[0]) / 5)))
                rows.append([1 - p_b, p_b, 0.0])
            return torch.tensor(rows)

    write_demo(tmp_path, n_train=0, n_test=2, n_bench=60)
    selection = select(tmp_path / "bench.jsonl", BENCH_BASELINE)
    assert set(selection.models) == set(BENCH_MODELS) and selection.counts["used"] == 60
    result = leaderboard(LengthJudge(), selection, ["detailed"], contrast=["concise"])
    assert result["kendall_tau"]["tau"] <= -0.8
    assert result["boards"][0]["rows"][0]["model"] == max(BENCH_MODELS,
                                                         key=lambda m: BENCH_MODELS[m]["length"])


# -- the command ----------------------------------------------------------------------------------

def demo_like_bench(tmp_path) -> Path:
    return write_bench(tmp_path / "bench.jsonl", [
        bench_line(i, ("t1", "t2")[i % 2], {"base": "alpha reply " * (1 + i % 3),
                                            "m1": "beta reply", "m2": "the answer is alpha",
                                            "m3": "beta reply " * 4}) for i in range(6)])


def test_crm_leaderboard_writes_json_md_png(tmp_path):
    export = export_tiny(tmp_path / "export")
    bench = demo_like_bench(tmp_path)
    run_dir = tmp_path / "run"
    votes = tmp_path / "votes.jsonl"  # q1 is a t2 query, q0 a t1 one (outside the topics)
    board = {"criteria": ["concise answer, please", "is friendly"],
             "bench": bench_fingerprint(bench)}
    votes.write_text(json.dumps({"idx": "1", "model": "m1", "verdict": "tie", **board}) + "\n"
                     + json.dumps({"idx": "0", "model": "m2", "verdict": "win", **board}) + "\n")
    result = run_cli("leaderboard", run, [
        f"checkpoint={export}", f"bench={bench}", "baseline=base",
        'criteria=["concise answer, please","is friendly"]', 'contrast=["detailed answer"]',
        "topics=[t2]", "progress=false", "labels.criteria=concise", "labels.contrast=detailed",
        f"votes={votes}", "suggest_votes.pairs=4", "both_orders=false", "slot_sample=0"], run_dir)
    saved = json.loads((run_dir / "leaderboard.json").read_text())
    assert saved["votes"] == {"file": str(votes), "read": 2, "used": 1, "outside_topics": 1,
                              "on_rejected_lines": 0, "unscorable": 0}
    # auto, with votes; 1 vote: the bootstrap's intervals until PPI has 20, and each cell says so
    assert saved["interval"]["method"] == saved["boards"][0]["interval_method"] == "bootstrap"
    overall = saved["boards"][0]["rows"][0]["overall"]
    assert overall["ci_low"] is not None and overall["interval_note"] == (
        "bootstrap interval (the CRM taken as the user) until PPI has 20 votes: 1 so far")
    suggested = [json.loads(x) for x in (run_dir / "suggested_votes.jsonl").read_text().splitlines()]
    assert [(s["idx"], s["model"]) for s in suggested][:3] == [(s["idx"], m) for s, m in
                                                               zip(suggested, ("m1", "m2", "m3"))]
    assert len(suggested) == 4 and ("1", "m1") not in {(s["idx"], s["model"]) for s in suggested}
    assert suggested[0]["criteria"] == ["concise answer, please", "is friendly"]
    assert {"prompt", "baseline", "response", "topic"} <= set(suggested[0])
    assert suggested[0]["bench"] == board["bench"] and "p" not in suggested[0]  # uniform
    assert saved["suggested_votes"]["pairs"] == 4
    assert saved == json.loads(json.dumps(result))
    assert saved["boards"][0]["criteria"] == ["concise answer, please", "is friendly"]
    assert saved["topics"] == ["t2"] and saved["examples"]["used"] == 3
    assert saved["examples"]["outside_topics"] == 3
    # The random tiny CRM: under "detailed" every model wins all 3 examples, so the boards
    # share ranks (m2 and m3 at 2 under "concise", all three at 1 under "detailed") and a
    # ranking all ties has no order for Kendall tau (null, with its reason; the picture draws it)
    assert [[r["rank"] for r in b["rows"]] for b in saved["boards"]] == [[1, 2, 2], [1, 1, 1]]
    assert saved["kendall_tau"] == {"tau": None, "p_value": None, "models": 3,
                                    "reason": "every model tied in one ranking: no order to compare"}
    assert saved["sequences"]["prefix_sequences"] == saved["sequences"]["sequences"] == 2 * 9
    assert (run_dir / "leaderboard.md").read_text() == markdown(saved)
    assert (run_dir / "leaderboard.png").stat().st_size > 10_000
    # judgments.jsonl: a line per judged pair, board by board, whose verdicts are the boards' counts
    lines = [json.loads(x) for x in (run_dir / "judgments.jsonl").read_text().splitlines()]
    assert [j["board"] for j in lines] == ["concise"] * 9 + ["detailed"] * 9
    assert set(lines[0]) == {"board", "idx", "topic", "model", "verdict", "p_win", "p_tie",
                             "p_loss"}
    for board in saved["boards"]:
        for row in board["rows"]:
            verdicts = [j["verdict"] for j in lines
                        if j["board"] == board["label"] and j["model"] == row["model"]]
            counts = row["overall"]
            assert [verdicts.count(v) for v in (WIN, TIE, LOSS)] == [
                counts["wins"], counts["ties"], counts["losses"]]
    for j in lines:  # the two-way head: no tie class
        assert j["p_tie"] == 0 and j["p_win"] + j["p_loss"] == pytest.approx(1, abs=2e-6)
        assert j["verdict"] == (WIN if j["p_win"] > j["p_loss"] else LOSS)
        assert j["topic"] == "t2"


def test_a_judgments_file_that_cannot_be_written_replaces_no_output(tmp_path, capsys,
                                                                   monkeypatch):
    """One line, exit 2; an earlier run's outputs (of the same inputs, so the run may replace
    them) and what is in the way stay as they were."""
    from crm.cli.leaderboard import main

    export = export_tiny(tmp_path / "export")
    bench = demo_like_bench(tmp_path)
    run_dir = tmp_path / "run"
    (run_dir / "judgments.jsonl").mkdir(parents=True)
    (run_dir / "judgments.jsonl" / "notes.txt").write_text("mine")
    earlier = json.dumps({"model": str(export), "bench": str(bench), "baseline": "base",
                          "topics": ["t1", "t2"], "models": ["m1", "m2", "m3"],
                          "boards": [{"criteria": ["concise answer"]}]})
    (run_dir / "leaderboard.json").write_text(earlier)
    capsys.readouterr()  # the export's progress bar
    line = refused(capsys, monkeypatch, main, "crm-leaderboard", f"checkpoint={export}",
                   f"bench={bench}", "baseline=base", "criteria=[concise answer]",
                   "progress=false", f"hydra.run.dir={run_dir}")
    assert line == (
        f"crm-leaderboard: {run_dir / 'judgments.jsonl'} cannot be written (Is a directory); no output was "
        "replaced: move what is there or free disk space, or give this board its own name= "
        "(name=default)")
    assert (run_dir / "leaderboard.json").read_text() == earlier
    assert (run_dir / "judgments.jsonl" / "notes.txt").read_text() == "mine"
    # no other output, and no temporary file left
    assert {p.name for p in run_dir.iterdir()} == {".hydra", "leaderboard.log", "judgments.jsonl",
                                                   "leaderboard.json"}


def test_default_mode_ranks_under_the_generic_criterion(tmp_path):
    from hydra import compose, initialize_config_module

    with initialize_config_module(version_base="1.3", config_module="crm_configs"):
        cfg = compose("leaderboard", overrides=["checkpoint=x", "bench=y", "baseline=z"],
                      return_hydra_config=True)
    assert tuple(cfg.default_criteria) == DEFAULT_CRITERIA
    assert cfg.hydra.run.dir.endswith("/outputs/leaderboard/default")

    export = export_tiny(tmp_path / "export")
    common = [f"checkpoint={export}", f"bench={demo_like_bench(tmp_path)}", "baseline=base",
              "progress=false"]
    result = run_cli("leaderboard", run, [*common, "default=true"], tmp_path / "run")
    assert result["boards"][0]["criteria"] == list(DEFAULT_CRITERIA)
    assert result["boards"][0]["label"] == "default"
    # a name holds one board: under other criteria it is refused before any model loads
    with pytest.raises(ValueError, match=r"holds the results of criteria=\[General user "
                       r"preference\] \(this run: criteria=\[x\]\): give this board its own name="):
        run_cli("leaderboard", run, [*common, "criteria=[x]"], tmp_path / "run")
    with pytest.raises(ValueError, match="give criteria=\\[...\\] or default=true, not both"):
        run_cli("leaderboard", run, [*common, "default=true", "criteria=[x]"], tmp_path / "run")
    with pytest.raises(ValueError, match="no criteria"):
        run_cli("leaderboard", run, common, tmp_path / "run")
    with pytest.raises(ValueError, match="contrast: criterion 2 of 2 is blank: write each"):
        run_cli("leaderboard", run, [*common, "criteria=[x]", 'contrast=[y," "]'], tmp_path / "run")


def test_strict_refuses_rejected_lines(tmp_path):
    bench = write_bench(tmp_path / "bench.jsonl", [
        bench_line(0, "t", {"base": "x", "m": "y"}), bench_line(1, "t", {"m": "y"})])
    with pytest.raises(ValueError, match="1 benchmark lines rejected \\(strict=true\\)"):
        run_cli("leaderboard", run, [f"checkpoint={tmp_path}", f"bench={bench}", "baseline=base",
                                     "criteria=[x]", "strict=true"], tmp_path / "run")


def test_the_installed_command_and_the_documented_way_to_vote(tmp_path, monkeypatch, capsys):
    """As docs/EVALUATION.md says to vote: the installed script's board with suggested pairs, a
    verdict added to each suggested line, the same board again with those votes; the votes on a
    board under other criteria are refused in one line naming both criteria sets."""
    from crm.cli.leaderboard import main

    export = export_tiny(tmp_path / "export")
    bench = demo_like_bench(tmp_path)
    command = [str(Path(sys.executable).parent / "crm-leaderboard"), f"checkpoint={export}",
               f"bench={bench}", "baseline=base", "criteria=[concise answer]", "progress=false"]

    def installed(*args):
        proc = subprocess.run([*command, *args], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc

    proc = installed("suggest_votes.pairs=6", f"hydra.run.dir={tmp_path}/first")
    assert "| Rank | Rank (UB) | Rank set | Model | Overall | 95% CI | t1 | t2 |" in proc.stdout
    assert {p.name for p in (tmp_path / "first").iterdir()} >= {
        "leaderboard.json", "leaderboard.md", "leaderboard.png", "suggested_votes.jsonl"}
    votes = tmp_path / "votes.jsonl"
    votes.write_text("".join(json.dumps({**json.loads(line), "verdict": "win"}) + "\n"
                             for line in (tmp_path / "first" / "suggested_votes.jsonl")
                             .read_text().splitlines()))
    # the same board with those votes, in process (the script's wrapper is the first call's)
    monkeypatch.setattr("sys.argv", [*command, f"votes={votes}", f"hydra.run.dir={tmp_path}/voted"])
    main()
    saved = json.loads((tmp_path / "voted" / "leaderboard.json").read_text())
    assert saved["votes"]["used"] == 6  # each line, with its verdict, a vote of this board
    assert "until PPI has 20 votes: 6 so far" in saved["boards"][0]["rows"][0]["overall"][
        "interval_note"]
    monkeypatch.setattr("sys.argv", [*command[:4], "criteria=[long answer]", f"votes={votes}",
                                     f"hydra.run.dir={tmp_path}/other"])
    capsys.readouterr()  # export_tiny's progress
    with pytest.raises(SystemExit) as exit_info:
        main()
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1
    assert (f"{votes}:1: criteria: this vote was given under the criteria ['concise answer']; "
            "this board's are ['long answer']") in err[0]


def test_a_failing_run_exits_non_zero(tmp_path, monkeypatch, capsys):
    from crm.cli.leaderboard import main

    monkeypatch.setattr("sys.argv", ["crm-leaderboard", f"checkpoint={tmp_path}",
                                     f"bench={tmp_path}/none.jsonl", "baseline=base",
                                     "criteria=[x]", f"hydra.run.dir={tmp_path}/run"])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 2 and "none.jsonl: no such file" in capsys.readouterr().err


def test_a_group_given_one_value_is_one_line_naming_its_keys(tmp_path, capsys, monkeypatch):
    """suggest_votes is a group (pairs, strategy): `suggest_votes=4` names the keys to set."""
    from crm.cli.leaderboard import main

    line = refused(capsys, monkeypatch, main, "crm-leaderboard", f"checkpoint={tmp_path}",
                   f"bench={tmp_path}/b.jsonl", "baseline=base", "criteria=[x]",
                   "suggest_votes=4", f"hydra.run.dir={tmp_path}/run")
    assert line == ("crm-leaderboard: suggest_votes: a group of keys, not one value: set "
                    "suggest_votes.pairs or suggest_votes.strategy")
