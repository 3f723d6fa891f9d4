"""crm-report SWEEP_DIR: one table (report.md, report.csv) and a plot (report.png) across a multirun;
with wandb, the same table in a summary run of the sweep's group."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from crm.cli.multirun import planned_jobs
from crm.training.sweeps import read_runs, write_report


def log_to_wandb(sweep_dir: Path, report: dict, project: str | None, group: str | None) -> str:
    import wandb

    runs, _ = read_runs(sweep_dir)
    config = next(run.metrics.get("config") or {} for run in runs if run.finished)
    os.environ.setdefault("WANDB_MODE", "offline")
    group = group or sweep_dir.name
    run = wandb.init(project=project or "crm", group=group, job_type="report", name=f"{group}-report",
                     dir=str(report["out_dir"]), config={"sweep_dir": str(sweep_dir), **config})
    rows = [[None if v == "" else v for v in row] for row in report["rows"]]  # typed columns
    run.log({"sweep_table": wandb.Table(columns=report["header"], data=rows),
             "sweep_plot": wandb.Image(str(Path(report["out_dir"]) / "report.png"))})
    run.finish()
    return run.id


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="crm-report", description=__doc__.splitlines()[0])
    p.add_argument("sweep_dir", help="a Hydra multirun dir (e.g. multirun/<name>)")
    p.add_argument("--out", help="where to write the report (default: the sweep dir)")
    p.add_argument("--wandb", action="store_true", help="also log the table to wandb "
                   "(offline unless WANDB_MODE says otherwise)")
    p.add_argument("--project", default="crm", help="wandb project")
    p.add_argument("--group", help="wandb group (default: the sweep dir's name, as crm-train uses)")
    args = p.parse_args(argv)
    try:
        report = write_report(args.sweep_dir, args.out, planned_jobs(Path(args.sweep_dir)))
    except (OSError, ValueError) as exc:
        print(f"crm-report: {exc}", file=sys.stderr)
        return 2
    for reason in report["skipped"]:
        print(f"not finished: {reason}", file=sys.stderr)
    print((Path(report["out_dir"]) / "report.md").read_text(), end="")
    print(f"{report['runs']} runs"
          + (f" ({report['unfinished']} more without metrics, named in the table)"
             if report["unfinished"] else "")
          + f" -> {report['out_dir']}/report.{{md,csv,png}}")
    if args.wandb:
        print(f"wandb run {log_to_wandb(Path(args.sweep_dir), report, args.project, args.group)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
