"""leaderboard.md and leaderboard.png from a leaderboard.json document (crm.evaluation.leaderboard)."""
from __future__ import annotations

import collections
import textwrap
from pathlib import Path

from crm.core.glyphs import drawable


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def interval(cell: dict) -> str:
    """A cell's interval as Arena-Hard writes it, "(-x / +y)" in points of %; "" without one."""
    if cell.get("ci_low") is None:
        return ""
    rate = cell["win_rate"]
    return f"(-{100 * (rate - cell['ci_low']):.1f} / +{100 * (cell['ci_high'] - rate):.1f})"


def tau_sentence(k: dict) -> str:
    """leaderboard.kendall_tau's result in words; null (one model, or a ranking all ties) says why."""
    if k["tau"] is None:
        return f"Kendall tau between the two rankings: none ({k['reason']})"
    return (f"Kendall tau between the two rankings: **{k['tau']:+.3f}** (p = {k['p_value']:.2g}, "
            f"{k['models']} models; -1: one reverses the other)")


def slope_positions(rows: list[dict]) -> tuple[dict[str, float], dict[str, str]]:
    """Per model, its height on the slope chart's rank axis and its label. Models sharing a rank
    stand around it, a row apart at most, in the board's listing order, and their labels say
    "=N": drawn at distinct ranks they would claim an order the board does not."""
    sharing = collections.Counter(r["rank"] for r in rows)
    seen: collections.Counter = collections.Counter()
    heights, labels = {}, {}
    for row in rows:
        rank, k = row["rank"], sharing[row["rank"]]
        step = min(0.3, 0.8 / (k - 1)) if k > 1 else 0.0
        heights[row["model"]] = rank + (seen[rank] - (k - 1) / 2) * step
        labels[row["model"]] = f"{row['model']} (={rank})" if k > 1 else row["model"]
        seen[rank] += 1
    return heights, labels


def rank_set(row: dict) -> str:
    best, worst = row.get("rank_set") or (row["rank"], row["rank"])
    return str(best) if best == worst else f"{best}-{worst}"


def method_note(board: dict) -> str:
    """How a board's intervals were made and what they assume, in one line."""
    notes = [r["overall"]["interval_note"] for r in board["rows"]
             if r["overall"].get("interval_note")]
    if board.get("interval_method") == "ppi":
        note = f"prediction-powered (PPI++, the CRM's verdicts corrected by the user's votes); " \
               f"assumes {board['assumes']}"
        return note + (f". {notes[0]}" if notes else "")
    note = f"percentile bootstrap over the queries; {board.get('assumes', '')}".rstrip("; ")
    return note + (f". {notes[0]}" if notes else "")


def slot_note(board: dict) -> str:
    """A warning when the board's verdicts follow the slot rather than the response; "" else."""
    bias = board.get("slot_bias")
    if not bias or not bias["biased"]:
        return ""
    return (f"Slot bias: {bias['follow_slot']} of {bias['pairs']} sampled pairs got the same slot's "
            f"verdict in both orders, mostly slot {bias['slot']} ({100 * bias['rate']:.0f}% > "
            f"{100 * bias['threshold']:.0f}%): the CRM reads the slot, not the response; "
            + ("this board averages both orders" if board.get("both_orders")
               else "its win rates are not to be trusted (both_orders=true averages them out)"))


def tie_words(tie_value: float) -> str:
    """How the board counts a tie, in words (interval.tie_value)."""
    if tie_value == 0:
        return "a tie counting as no win"
    return "a tie counting as half a win" if tie_value == 0.5 else f"a tie worth {tie_value:g} win"


def rate_with_interval(cell: dict) -> str:
    return f"{_pct(cell['win_rate'])} {interval(cell)}".rstrip()


def left_out_words(counts: dict) -> str:
    """The first board's queries left out as too long, as the header's first count; "" for none."""
    n = counts.get("left_out", 0)
    return f"{n} left out: too long for the CRM's tokens, " if n else ""


def markdown(result: dict) -> str:
    """Tables like the reference leaderboard: model, Overall, one column per topic (win rate %),
    each with its interval, and LMArena's rank upper bound beside the rank."""
    topics = result["topics"]
    counts = result["examples"]
    level = result.get("interval", {}).get("level", 0.95)
    tie_value = result.get("interval", {}).get("tie_value", 0.0)
    shortened = result.get("sequences", {}).get("shortened", 0)
    lines = [f"Baseline: `{result['baseline']}` · {counts['used']} examples used "
             f"({left_out_words(counts)}{counts['rejected']} rejected, {counts['outside_topics']} "
             f"outside the selected topics, {counts['read']} read)"
             + (f" · {shortened} prompt(s) had responses shortened to fit the CRM's tokens "
                "(judged on their start and end)" if shortened else "")
             + f" · win rate (%) against the baseline, {tie_words(tie_value)}, with its "
             f"{100 * level:.0f}% interval (-x / +y); Overall is micro-averaged over "
             f"the examples; Rank (UB): 1 + the models whose interval lies wholly above; Rank set: "
             f"the ranks a model can hold at {100 * level:.0f}% (simultaneous intervals)"
             + (" · both orders averaged" if result["both_orders"] is True else "")]
    if result.get("votes"):
        v = result["votes"]
        lines.append(f"Votes: {v['used']} used of {v['read']} read from {v['file']} "
                     f"({v['outside_topics']} outside the selected topics, "
                     f"{v['on_rejected_lines']} on rejected benchmark lines"
                     + (f", {v['unscorable']} on pairs the CRM could not score"
                        if v.get("unscorable") else "")
                     + (f"; {v['weighted']}" if v.get("weighted") else "") + ")")
    for board in result["boards"]:
        with_ties = any(r["overall"]["ties"] for r in board["rows"])
        lines += ["", f"### {board['label']}: " + " / ".join(f'"{c}"' for c in board["criteria"]),
                  "", f"Intervals: {method_note(board)}"
                  + ("; judged in both orders, averaged" if board.get("both_orders")
                     and result["both_orders"] is not True else "")]
        if slot_note(board):
            lines.append(f"**{slot_note(board)}**")
        if board.get("unscorable"):
            u = board["unscorable"]
            lines.append(f"**{u['queries']} queries left out for every model: {u['pairs']} pairs "
                         f"cannot fit the CRM's tokens (first: {', '.join(u['first'])}); "
                         f"{board['used']} examples used by this board**")
        lines.append("")
        head = (["Rank", "Rank (UB)", "Rank set", "Model", "Overall", f"{100 * level:.0f}% CI"]
                + (["Votes"] if board.get("interval_method") == "ppi" else [])
                + (["Ties"] if with_ties else []) + topics)
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "|".join(["---:", "---:", "---:", ":---"] + ["---:"] * (len(head) - 4))
                     + "|")
        for row in board["rows"]:
            overall = row["overall"]
            cells = [str(row["rank"]), str(row["rank_ub"]), rank_set(row), row["model"],
                     f"**{_pct(overall['win_rate'])}**", interval(overall) or "-"]
            if board.get("interval_method") == "ppi":
                cells.append(str(overall.get("votes", 0)))
            if with_ties:
                cells.append(_pct(overall["tie_rate"]))
            cells += [rate_with_interval(row["topics"][t]) for t in topics]
            lines.append("| " + " | ".join(cells) + " |")
    if "kendall_tau" in result:
        lines += ["", tau_sentence(result["kendall_tau"])]
    if result["rejects"]:
        lines += ["", f"Rejected benchmark lines ({len(result['rejects'])}):"]
        lines += [f"- {r['file']}:{r['line']}: {r['field']}: {r['reason']}"
                  for r in result["rejects"][:20]]
        if len(result["rejects"]) > 20:
            lines.append(f"- ... and {len(result['rejects']) - 20} more (leaderboard.json)")
    return "\n".join(lines) + "\n"


# A bar label's width in the bars' units (% of the axis), "100%" at 8.5 pt bold, with room.
_LABEL_WIDTH = 11.0


def bar_label_place(value: float, low: float | None, high: float | None
                    ) -> tuple[float, str, float]:
    """(x, horizontal alignment, offset from the bar's centre line) for a bar's "NN%" label, on
    the 0-100 axis, clear of the interval's line [low, high] drawn on that centre line: after
    the interval, else before it, else (an interval over nearly the whole axis) inside the bar
    above the line."""
    low = value if low is None else low
    high = value if high is None else high
    if value > 2 * _LABEL_WIDTH and low >= 2 + _LABEL_WIDTH + 2:
        return 2.0, "left", 0.0  # inside, at the bar's base, ahead of the interval
    if high + 2 + _LABEL_WIDTH <= 100:
        return high + 2, "left", 0.0
    if low - 2 - _LABEL_WIDTH >= 0:
        return low - 2, "right", 0.0
    return 2.0, "left", -0.26


def plot(result: dict, path: str | Path) -> Path:
    """leaderboard.png: per board, overall win rates as sorted bars with their intervals and a
    model x topic heatmap; with a contrast set, a slope chart of the two rankings with their
    Kendall tau. Names, criteria and topics are drawn as `drawable` makes them (no empty box for
    a character the font lacks); leaderboard.md and leaderboard.json keep them exactly."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.gridspec import GridSpec

    boards, topics = result["boards"], result["topics"]
    n_models = len(result["models"])
    height = max(2.6, 0.42 * n_models + 1.4)
    slope = len(boards) == 2
    widths = [3.2, max(2.4, 0.62 * len(topics))]  # inches
    wspace = 0.12 + 0.08 * slope
    fig = plt.figure(figsize=(sum(widths) + 1.5, height * len(boards)), dpi=110)
    if slope:
        # The slope chart is as wide as its labels (a long name, an emoji's name, "(=N)") on either
        # side of the two ranks' axes, so that none runs into the heatmap on its left.
        (y_a, label_a), (y_b, label_b) = (slope_positions(b["rows"]) for b in boards)
        left, right = (_width_inches(fig, [drawable(t) for t in labels.values()], fontsize=8)
                       + _SLOPE_GAP + 0.1 for labels in (label_a, label_b))
        # A column's share of the figure's width is less than its ratio's (margins, spaces):
        # widened until the axes drawn hold the labels and the ranks' distance.
        needed = left + _SLOPE_APART + right
        widths.append(needed)
        for _ in range(6):  # converges within a hundredth of an inch
            widths[2] *= needed / _column_inches(fig, widths, 2, wspace)
    # A lower board's title (two lines when its criteria wrap) clears the upper one's x label.
    grid = GridSpec(len(boards), len(widths), figure=fig, width_ratios=widths, wspace=wspace,
                    hspace=0.55 + 1.1 / height)
    cmap = plt.get_cmap("RdYlGn")
    for b, board in enumerate(boards):
        rows = board["rows"]
        names = [r["model"] for r in rows]
        overall = [100 * r["overall"]["win_rate"] for r in rows]
        ax = fig.add_subplot(grid[b, 0])
        y = range(len(rows))
        errors = None
        if all(r["overall"]["ci_low"] is not None for r in rows):
            errors = [[100 * (r["overall"]["win_rate"] - r["overall"]["ci_low"]) for r in rows],
                      [100 * (r["overall"]["ci_high"] - r["overall"]["win_rate"]) for r in rows]]
        ax.barh(y, overall, color=[cmap(v / 100) for v in overall], edgecolor="#555", lw=0.5,
                xerr=errors, error_kw={"ecolor": "#333", "elinewidth": 0.9, "capsize": 2.5})
        for i, (v, row) in enumerate(zip(overall, rows)):
            low, high = row["overall"]["ci_low"], row["overall"]["ci_high"]
            x, ha, dy = bar_label_place(v, None if low is None else 100 * low,
                                        None if high is None else 100 * high)
            ax.text(x, i + dy, f"{v:.0f}%", va="center", ha=ha, fontsize=8.5, fontweight="bold")
        ax.axvline(50, color="#444", ls="--", lw=0.8, zorder=0)
        ax.set_xlim(0, 100)
        ax.set_yticks(list(y), [f"{drawable(name)}  [{rank_set(r)}]" for name, r in zip(names, rows)],
                      fontsize=9)
        ax.set_ylim(len(rows) - 0.5, -0.5)  # best on top, rows level with the heatmap's
        ax.set_xlabel(f"Overall win rate vs {drawable(result['baseline'])} (%)", fontsize=8.5)
        ax.spines[["top", "right"]].set_visible(False)
        # Above the heatmap's own label, not beside it: wrapped to the bars and the heatmap's
        # width (about 11 bold characters an inch), at most two lines.
        title = board_title(board["label"], board["criteria"], int(11 * sum(widths[:2])))
        ax.set_title("\n".join(title), loc="left", fontsize=10, fontweight="bold", pad=20)

        heat = fig.add_subplot(grid[b, 1])
        values = [[100 * (r["topics"][t]["win_rate"] or 0) for t in topics] for r in rows]
        heat.imshow(values, cmap=cmap, vmin=0, vmax=100, aspect="auto")
        for i, line in enumerate(values):
            for j, v in enumerate(line):
                heat.text(j, i, f"{v:.0f}", ha="center", va="center", fontsize=8,
                          color="white" if v < 18 or v > 85 else "black")
        heat.set_xticks(range(len(topics)), [drawable(t) for t in topics], rotation=30, ha="right",
                        fontsize=8.5)
        heat.set_yticks([])
        heat.set_title("win rate per topic (%)", fontsize=8.5, loc="right", color="#555")
        for s in heat.spines.values():
            s.set_visible(False)

    if slope:
        ax = fig.add_subplot(grid[:, 2])
        colors = plt.get_cmap("tab10")
        # In the axis' units the two ranks stand at 0 and 1, `apart` inches apart.
        apart = ax.get_position().width * fig.get_figwidth() - left - right
        gap = _SLOPE_GAP / apart
        for i, model in enumerate(y_a):
            color = colors(i % 10)
            ax.plot([0, 1], [y_a[model], y_b[model]], "-o", color=color, lw=1.8, ms=5)
            ax.text(-gap, y_a[model], drawable(label_a[model]), ha="right", va="center", fontsize=8,
                    color=color)
            ax.text(1 + gap, y_b[model], drawable(label_b[model]), ha="left", va="center",
                    fontsize=8, color=color)
        ax.set_xlim(-left / apart, 1 + right / apart)
        ax.set_ylim(n_models + 0.6, 0.4)
        # Wrapped: the two labels stand an inch apart (a long label, or an emoji's name, ran into
        # the other).
        ax.set_xticks([0, 1], [textwrap.fill(drawable(b["label"]), 14) for b in boards], fontsize=9)
        ax.set_yticks([])
        ax.spines[["top", "right", "left"]].set_visible(False)
        tau = result["kendall_tau"]["tau"]
        ax.set_title("rank under each criteria set\nKendall tau = "
                     + (f"{tau:+.2f}" if tau is not None else "none"), fontsize=10,
                     fontweight="bold")
    counts = result["examples"]
    # Above everything drawn, boards' titles included (at Matplotlib's default place it
    # overprinted the first, more so when criteria wrap); the tight bounding box keeps it.
    renderer = fig.canvas.get_renderer()
    top = max(a.get_tightbbox(renderer).y1 for a in fig.axes) + 8  # pixels
    # No wider than the panels below (a long board label drew it to the image's edge): its
    # lines are wrapped, narrower each time, until it fits.
    right = max(a.get_tightbbox(renderer).x1 for a in fig.axes)
    lines = [drawable(f"User-centric leaderboard: win rate against {result['baseline']} "
                      f"({counts['used']} examples, {len(topics)} topics) [rank set]")]
    lines += [drawable(_plot_note(b)) for b in boards]
    main = fig.suptitle("\n".join(lines), x=0.01, ha="left", va="bottom",
                        y=fig.transFigure.inverted().transform((0, top))[1], fontsize=12,
                        fontweight="bold")
    chars = max(map(len, lines))
    while main.get_window_extent(renderer).x1 > right and chars > 30:
        chars = int(chars * 0.9)
        main.set_text("\n".join(wrapped for line in lines
                                for wrapped in textwrap.wrap(line, chars, subsequent_indent="  ")))
    path = Path(path)
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return path


def _plot_note(board: dict) -> str:
    bias = board.get("slot_bias")
    slot = "; verdicts follow the slot" if bias and bias["biased"] else ""
    # Which orders were judged: one order lets a slot-biased CRM decide the board.
    slot += "; both orders averaged" if board.get("both_orders") else "; baseline in slot A only"
    if board.get("unscorable"):
        slot += (f"; {board['unscorable']['queries']} queries left out (too long), "
                 f"{board['used']} used")
    if board.get("interval_method") == "ppi":
        votes = sum(r["overall"].get("votes", 0) for r in board["rows"])
        return f"{board['label']}: PPI intervals, {votes} of the user's votes{slot}"
    return f"{board['label']}: intervals assume the CRM's verdict is the user's{slot}"


# The slope chart, in inches: its two ranks' axes stand this far apart (their labels, wrapped to
# 14 characters, fit between), and a model's label this far from its point.
_SLOPE_APART, _SLOPE_GAP = 1.3, 0.07


def board_title(label: str, criteria: list[str], width: int, lines: int = 2) -> list[str]:
    """A board's title as drawn, in `lines` lines of `width` characters at most: its label and as
    many whole criteria as fit, then how many more there are (a cut title read as if it held
    them all); the first criterion shortened when even it alone does not fit."""
    quoted = [f"\u201c{c}\u201d" for c in criteria]
    for shown in range(len(quoted), 0, -1):
        more = _more(len(quoted) - shown)
        title = textwrap.wrap(drawable(f"{label}: " + " / ".join(quoted[:shown])) + more, width)
        if len(title) <= lines:
            return title
    more = _more(len(quoted) - 1)
    title = textwrap.wrap(drawable(f"{label}: {quoted[0]}"), width)
    return title[:lines - 1] + [_shorten(" ".join(title[lines - 1:]), width - len(more)) + more]


def _more(count: int) -> str:
    return f" (+{count} more in leaderboard.md)" if count else ""


def _column_inches(fig, widths: list[float], column: int, wspace: float) -> float:
    """How wide GridSpec draws `column` of `widths` (its ratios) in a figure `widths` + 1.5
    inches wide, with `fig`'s margins: `fig` is resized to that width."""
    fig.set_size_inches(sum(widths) + 1.5, fig.get_figheight())
    params = fig.subplotpars
    n = len(widths)
    cells = fig.get_figwidth() * (params.right - params.left) * n / (n + wspace * (n - 1))
    return cells * widths[column] / sum(widths)


def _width_inches(fig, texts: list[str], fontsize: float) -> float:
    """The widest of `texts` as `fig` draws them, in inches."""
    renderer = fig.canvas.get_renderer()
    widest = 0.0
    for text in texts:
        drawn = fig.text(0, 0, text, fontsize=fontsize)
        widest = max(widest, drawn.get_window_extent(renderer).width)
        drawn.remove()
    return widest / fig.dpi


def _shorten(text: str, n: int) -> str:
    return text if len(text) <= n else text[:n - 1] + "…"
