"""The run's logger: csv (the default), wandb or none."""
from __future__ import annotations

import csv
import logging
import os
import warnings
from pathlib import Path

import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from crm.training.config import LoggerConfig
from crm.training.preemption import slurm_job_id



class _NoAdverts(logging.Filter):
    """Lightning's "💡 Tip: ... try installing litlogger / litmodels" lines: an advert for a cloud
    service in every run's log, nothing about the run."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip:")


for _name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
    logging.getLogger(_name).addFilter(_NoAdverts())

def make_logger(logger: LoggerConfig, run_dir: Path, run_name: str, sweep: dict | None = None):
    """The run's Lightning logger (False for none); `sweep` a multirun job's {group, axes, job},
    so that wandb groups and tags its runs."""
    if logger.name == "none":
        return False
    if logger.name == "csv":
        return ResumableCSVLogger(save_dir=str(run_dir), name="csv", version="")
    os.environ.setdefault("WANDB_MODE", "offline")  # no key, no network unless asked
    run_id = slurm_job_id()  # a requeued job continues its own wandb run
    group, tags = logger.group, list(logger.tags)
    if sweep:
        group = group or sweep["group"]
        tags += [f"{k}={v}" for k, v in sweep["axes"].items()]
        run_name = f"{run_name}-{sweep['job']}"
    return L.pytorch.loggers.WandbLogger(
        project=logger.project, entity=logger.entity, group=group, tags=tags,
        name=run_name, save_dir=str(run_dir), id=run_id, resume="allow" if run_id else None)


class ResumableCSVLogger(L.pytorch.loggers.CSVLogger):
    """Appends to the run's csv/metrics.csv. Lightning's CSVLogger deletes the file it finds, so a
    resumed run (resume=auto, a requeued job) would lose the earlier steps' metrics.

    Steps run again after a crash appear twice; the later row is the resumed run's.

    Lightning offers no public way to append: this relies on its writer deleting the file when
    created and writing rows under its `metrics_keys`; tests/training/test_distributed.py
    (test_a_resumed_run_appends_to_the_csv_history, not slow) fails if either changes.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.writer_started = False

    @property
    def experiment(self):
        path = Path(self.log_dir) / "metrics.csv"
        resuming = not self.writer_started and rank_zero_only.rank == 0 and path.is_file()
        self.writer_started = True
        if not resuming:
            return super().experiment
        aside = path.with_name(path.name + ".resumed")
        path.replace(aside)  # out of the writer's way while it starts
        with warnings.catch_warnings():  # "Previous log files ... will be deleted": not here
            warnings.filterwarnings("ignore", message="Experiment logs directory")
            writer = super().experiment
        with aside.open(newline="") as f:
            writer.metrics_keys = next(csv.reader(f), [])  # rows are appended under this header
        aside.replace(path)
        return writer


def plot_curves(metrics_csv: Path, run: str) -> Path | None:
    """`curves.png` beside the CSV logger's metrics.csv: loss and accuracy by optimizer step, train
    and validation, titled with `run`, so a run is read at a glance (None when there is no step to
    draw)."""
    series: dict[str, list[tuple[int, float]]] = {}
    with open(metrics_csv, newline="", encoding="utf-8") as handle:
        for row in csv.DictReader(handle):
            for name in ("train/loss", "val/loss", "train/acc", "val/acc"):
                if row.get(name) and row.get("step"):
                    # Lightning writes train and val rows under the steps taken before this one
                    # (0 after the first): drawn at the optimizer steps taken, as crm-train counts.
                    steps = int(float(row["step"])) + 1
                    series.setdefault(name, []).append((steps, float(row[name])))
    if not series:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    from crm.core.glyphs import drawable

    panels = [p for p in ("loss", "acc") if any(n.endswith(p) for n in series)]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 3.6), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        for split, style in (("train", "-"), ("val", "o-")):
            points = sorted(series.get(f"{split}/{panel}", []))
            if points:
                ax.plot([s for s, _ in points], [v for _, v in points], style, ms=4, lw=1.2,
                        label=split)
        if panel == "acc":
            ax.axhline(0.5, color="grey", lw=0.8, ls="--")  # chance on two labels
        ax.set_xlabel("optimizer steps taken")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel({"loss": "loss", "acc": "accuracy"}[panel])
        ax.legend(fontsize=8)
        ax.spines[["top", "right"]].set_visible(False)
    fig.suptitle(drawable(run), fontsize=11, fontweight="bold")
    fig.tight_layout()
    path = Path(metrics_csv).with_name("curves.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
