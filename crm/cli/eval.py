"""crm-eval: score test files with a trained CRM (metrics.json, predictions.jsonl).

    crm-eval model=outputs/demo/export data.test=[a.jsonl,b.jsonl] [name=...] [batch_size=...]

`model=DIR` is short for `model.path=DIR`: the configs share one search path with crm-train, where
`model` is a config group, and Hydra reads `model=X` as a choice in that group.
"""
from __future__ import annotations

import json
import logging
import re
import sys
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from crm.cli.common import DTYPES, write_json
from crm.evaluation import evaluate_records
from crm.records import load_records

log = logging.getLogger("crm.eval")


def evaluate_files(scorer, paths) -> tuple[dict, dict]:
    """({path: metrics}, {path: predictions}) for test-format files."""
    metrics, predictions = {}, {}
    for path in paths:
        metrics[str(path)], predictions[str(path)] = evaluate_records(scorer, load_records(path, "test"))
    return metrics, predictions


def load_scorer(cfg: DictConfig):
    """The CRMScorer of `cfg.model` (an export dir or a crm-train .ckpt) with the run's options."""
    import torch

    from crm.scoring import CRMScorer

    device = None if cfg.device == "auto" else torch.device(cfg.device)
    dtype = None if cfg.dtype == "auto" else DTYPES[cfg.dtype]
    return CRMScorer.load(cfg.model.path, batch_size=cfg.batch_size, device=device, dtype=dtype,
                          prefix_reuse=cfg.get("prefix_reuse", True), progress=cfg.progress)


def evaluate(cfg: DictConfig) -> dict:
    started = time.time()
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    paths = list(cfg.data.test or [])
    if not paths:
        raise ValueError("no test files: crm-eval model=DIR data.test=[FILE.jsonl,...]")
    for path in paths:
        if not Path(path).is_file():
            raise FileNotFoundError(f"data.test: {path}: no such file")
    run_dir.mkdir(parents=True, exist_ok=True)
    scorer = load_scorer(cfg)
    metrics, predictions = evaluate_files(scorer, paths)
    result = {"model": str(cfg.model.path), "kind": scorer.kind, "files": metrics,
              "wall_seconds": round(time.time() - started, 1)}
    write_json(run_dir / "metrics.json", result)
    with open(run_dir / "predictions.jsonl", "w", encoding="utf-8") as out:
        for path, rows in predictions.items():
            for row in rows:
                out.write(json.dumps({"file": path, **row}, ensure_ascii=False) + "\n")
    return result


def summary(files: dict) -> str:
    """One line per file: accuracy in the given and swapped order, their mean, flip and tie rates."""
    head = (f"{'file':>20} {'n':>5} {'given':>7} {'swapped':>7} {'mean':>7} {'both':>7} "
            f"{'flip':>7} {'ties':>7}")
    lines = [head]
    for path, m in files.items():
        lines.append(f"{Path(path).stem[:20]:>20} {m['n']:>5} {m['accuracy']:>7.4f} "
                     f"{m['accuracy_swapped']:>7.4f} {m['accuracy_mean']:>7.4f} "
                     f"{m['accuracy_both_orders']:>7.4f} {m['flip_rate']:>7.4f} "
                     f"{m['tie_rate']:>7.4f}"
                     + (f"  ({m['unscorable']} unscorable)" if m["unscorable"] else ""))
    return "\n".join(lines)


def model_shorthand(argv: list[str]) -> list[str]:
    """`model=DIR` (also `+model=`, `++model=`) -> `model.path=DIR`, for the inference commands."""
    return argv[:1] + [re.sub(r"^(\+{0,2})model=", r"\1model.path=", a) for a in argv[1:]]


@hydra.main(version_base="1.3", config_path="pkg://crm_configs", config_name="eval")
def _main(cfg: DictConfig) -> None:
    result = evaluate(cfg)
    print(summary(result["files"]))
    print(f"metrics: {Path(HydraConfig.get().runtime.output_dir) / 'metrics.json'}")


def main() -> None:
    sys.argv = model_shorthand(sys.argv)
    _main()


if __name__ == "__main__":
    sys.exit(main())
