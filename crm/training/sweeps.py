"""Sweeps (Hydra multiruns): a job's axes are its overrides (`parse_overrides`: what crm-train tags
a sweep's runs with), and one table across a sweep's runs: the job, the varied axes, each test
set's accuracy, each benchmark's figures (`benchmarks`: its headline, then per subset), flip
rate, steps, wall time, and, where a job has no metrics.json (failed or still running), a note
saying so on its row: a job that did not finish is named, not dropped. The table reads each
run's `.hydra/overrides.yaml` and `metrics.json`; nothing else.
"""
from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from crm.core.files import refuse_file_as_dir
from crm.core.glyphs import drawable


@dataclass(frozen=True)
class Run:
    path: Path
    overrides: dict  # key -> value, as given on the command line / by the sweeper
    metrics: dict  # {} for a job that did not finish
    note: str = ""  # why it has no metrics: UNFINISHED or NOT_STARTED; "" when it finished

    @property
    def finished(self) -> bool:
        return not self.note


UNFINISHED = "no metrics.json: failed or still running"
NOT_STARTED = "not started: no run dir (the sweep stopped before it, or it waits)"


def read_runs(sweep_dir: str | Path,
              planned: list[list[str]] | None = None) -> tuple[list[Run], list[str]]:
    """Runs under `sweep_dir`, those without metrics.json included (with their `note`), and, of
    the `planned` jobs (each one's overrides, in job order: crm.cli.multirun.planned_jobs), those
    that have no run dir yet; and the reason for each run without metrics."""
    runs, skipped = [], []
    for overrides_file in sorted(Path(sweep_dir).glob("**/.hydra/overrides.yaml")):
        run_dir = overrides_file.parent.parent
        metrics_file = run_dir / "metrics.json"
        items = yaml.safe_load(overrides_file.read_text()) or []
        if not metrics_file.is_file():
            skipped.append(f"{run_dir}: {UNFINISHED}")
            runs.append(Run(run_dir, parse_overrides(items), {}, UNFINISHED))
            continue
        runs.append(Run(run_dir, parse_overrides(items), json.loads(metrics_file.read_text())))
    # Hydra's basic launcher stops a sweep at its first failed job: the later ones never get a
    # run dir, and only the sweep's own record (multirun.yaml) says they were asked for.
    if runs and all(run.path.parent == Path(sweep_dir) and run.path.name.isdigit() for run in runs):
        present = {run.path.name for run in runs}
        for number, job in enumerate(planned or []):
            if str(number) not in present:
                run_dir = Path(sweep_dir) / str(number)
                skipped.append(f"{run_dir}: {NOT_STARTED}")
                runs.append(Run(run_dir, parse_overrides(job), {}, NOT_STARTED))
    runs.sort(key=lambda r: _job_number(r.path))
    return runs, skipped


def parse_overrides(items) -> dict:
    """Hydra override strings (`key=value`, `+key=value`, ...) as {key: value}."""
    return dict(item.lstrip("+~").split("=", 1) for item in items if "=" in item)


def _job_number(path: Path):
    return (0, int(path.name)) if path.name.isdigit() else (1, path.name)


def varied_axes(runs: list[Run]) -> list[str]:
    """Override keys whose value differs between runs (or is missing from some), in first-seen order."""
    keys: dict[str, None] = {}
    for run in runs:
        keys.update(dict.fromkeys(run.overrides))
    return [k for k in keys if len({run.overrides.get(k) for run in runs}) > 1]


def test_sets(runs: list[Run]) -> list[str]:
    names: dict[str, None] = {}
    for run in runs:
        names.update(dict.fromkeys(Path(p).stem for p in run.metrics.get("eval", {})))
    return list(names)


def benchmark_columns(runs: list[Run]) -> list[str]:
    """`<benchmark>/<figure>` for every figure of every benchmark a run scored, in first-seen order."""
    names: dict[str, None] = {}
    for run in runs:
        for name, result in run.metrics.get("benchmarks", {}).items():
            names.update(dict.fromkeys(f"{name}/{key}" for key in result.get("summary", {})))
    return list(names)


def _benchmark_figure(run: Run, column: str):
    name, key = column.split("/", 1)
    value = run.metrics.get("benchmarks", {}).get(name, {}).get("summary", {}).get(key)
    return "" if value is None else round(value, 4)


def table(runs: list[Run]) -> tuple[list[str], list[list]]:
    """(header, rows): the job (its run dir's name), axes, accuracy (mean of both orders) per
    test set, the benchmarks' figures, flip rate per test set (each column names its file:
    position bias differs by set), steps, wall seconds, and a `note` column where a job did not
    finish (its figures empty). A value a run lacks is empty."""
    axes, sets, benchmarks = varied_axes(runs), test_sets(runs), benchmark_columns(runs)
    notes = not all(run.finished for run in runs)
    header = (["job"] + axes + [f"acc/{s}" for s in sets] + benchmarks
              + [f"flip/{s}" for s in sets] + ["steps", "wall_s"] + (["note"] if notes else []))
    rows = []
    for run in runs:
        by_set = {Path(p).stem: m for p, m in run.metrics.get("eval", {}).items()}
        train = run.metrics.get("train", {})
        rows.append([run.path.name] + [run.overrides.get(a, "") for a in axes]
                    + [by_set.get(s, {}).get("accuracy_mean", "") for s in sets]
                    + [_benchmark_figure(run, column) for column in benchmarks]
                    + [_figure(by_set.get(s, {}).get("flip_rate")) for s in sets]
                    + [train.get("global_step", ""), run.metrics.get("wall_seconds", "")]
                    + ([run.note] if notes else []))
    return header, rows


def _figure(value) -> float | str:
    return "" if value is None else round(value, 4)


def markdown(header: list[str], rows: list[list]) -> str:
    def fmt(name: str, v) -> str:
        if name == "wall_s" and isinstance(v, (int, float)):
            return f"{v:.1f}"  # seconds, measured to a tenth: not a four-place rate
        return f"{v:.4f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(h, v) for h, v in zip(header, row)) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def csv_text(header: list[str], rows: list[list]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    return out.getvalue()


def plot(header: list[str], rows: list[list], path: Path, n_axes: int) -> None:
    """Grouped bars: one group per setting (`table`'s rows: the job, then `n_axes` axes), one bar
    per test set's accuracy; a value a run lacks has no bar and no figure (not a bar at 0). A
    setting with no varied axis is named by its job; a job that did not finish is drawn as one,
    with no bars. The settings and test sets are drawn as `drawable` makes them (report.md keeps
    them exactly)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = [h for h in header if h.startswith("acc/")]
    notes = [row[header.index("note")] if "note" in header else "" for row in rows]
    # An axis a run left unset (it kept the config's value) reads as "-", not as nothing.
    labels = [drawable(", ".join(str(v) if v != "" else "-" for v in row[1:1 + n_axes])
                       or f"job {row[0]}")
              + (f"\njob {row[0]}: {'no metrics' if note == UNFINISHED else 'not started'}"
                 f"\n({'failed or still running' if note == UNFINISHED else 'no run dir'})"
                 if note else "")
              for row, note in zip(rows, notes)]
    width = 0.8 / max(1, len(sets))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.4 * len(rows) * max(1, len(sets)) * 0.5), 4.2))
    for j, name in enumerate(sets):
        col = header.index(name)
        present = [isinstance(row[col], (int, float)) for row in rows]
        # a finished run's missing figure stands at the axis with its "n/a"; matplotlib draws no
        # label at all for a NaN bar, which is what a job without metrics gets
        values = [row[col] if ok else float("nan") if note else 0.0
                  for row, ok, note in zip(rows, present, notes)]
        xs = [i + (j - (len(sets) - 1) / 2) * width for i in range(len(rows))]
        bars = ax.bar(xs, values, width, label=drawable(name[4:]))
        # a set a finished run did not evaluate is "n/a", not a bar of 0.00; a job without
        # metrics has nothing to label
        ax.bar_label(bars, [f"{v:.2f}" if ok else "" if note else "n/a"
                            for v, ok, note in zip(values, present, notes)], fontsize=7, padding=1)
    if not sets:  # empty axes would look like a plotting failure
        ax.text(0.5, 0.5, "no test-set accuracy: these runs evaluated no data.test_files",
                ha="center", va="center", transform=ax.transAxes, color="#555")
    ax.axhline(0.5, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(rows)), labels, rotation=15 if len(rows) > 4 else 0)
    ax.set_xlabel(drawable(", ".join(header[1:1 + n_axes])) + (" (-: the config's value)" if any(
        v == "" for row in rows for v in row[1:1 + n_axes]) else "") if n_axes else "sweep job")
    ax.set_ylim(0, 1.08)
    ax.set_ylabel("accuracy (mean of both orders)")
    if sets:  # above the axes: inside, it covered the bars (they reach 1.0)
        ax.legend(fontsize=8, ncols=min(4, len(sets)), loc="lower left", bbox_to_anchor=(0, 1.01),
                  frameon=False, title="test set", title_fontsize=8, alignment="left")
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def write_report(sweep_dir: str | Path, out_dir: str | Path | None = None,
                 planned: list[list[str]] | None = None) -> dict:
    """report.md, report.csv and report.png in `out_dir` (default: the sweep dir); `runs`: the
    jobs that finished, `unfinished`: those that did not (in the table too)."""
    runs, skipped = read_runs(sweep_dir, planned)
    if not any(run.finished for run in runs):
        raise FileNotFoundError(f"{sweep_dir}: no run with .hydra/overrides.yaml and metrics.json")
    out = Path(out_dir or sweep_dir)
    refuse_file_as_dir(out, "--out is the folder report.md, report.csv and report.png go in")
    out.mkdir(parents=True, exist_ok=True)
    header, rows = table(runs)
    (out / "report.md").write_text(markdown(header, rows), encoding="utf-8")
    (out / "report.csv").write_text(csv_text(header, rows), encoding="utf-8")
    plot(header, rows, out / "report.png", n_axes=len(varied_axes(runs)))
    finished = sum(run.finished for run in runs)
    return {"header": header, "rows": rows, "runs": finished, "unfinished": len(runs) - finished,
            "skipped": skipped, "out_dir": str(out)}
