"""crm-eval: score test files with a trained CRM (metrics.json, predictions.jsonl).

    crm-eval checkpoint=outputs/demo/export data.test=[a.jsonl,b.jsonl] [name=...] [batch_size=...]

`checkpoint` is an export dir or any checkpoint crm-train writes. The former `model=DIR` still
works, with a deprecation message: `model` is crm-train's config group, in the same search path.
"""
from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import MISSING, DictConfig

from crm.cli.common import (PathsConfig, ScorerSettings, checkpoint_argument, load_scorer,
                            one_line_config_errors, register_schema, settings)
from crm.core.errors import ConfigError
from crm.core.files import write_json
from crm.core.records import load_records
from crm.evaluation.accuracy import evaluate_files

log = logging.getLogger("crm.eval")


@dataclass
class EvalData:
    test: list[str] = MISSING


@dataclass
class EvalConfig(ScorerSettings):
    """configs/eval.yaml's keys and their types."""

    paths: PathsConfig = MISSING
    name: str = MISSING
    data: EvalData = MISSING


register_schema("eval", EvalConfig)


def evaluate(cfg: DictConfig) -> dict:
    started = time.time()
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    cfg = settings(cfg)
    paths = cfg.data.test
    if not paths:
        raise ConfigError("no test files: crm-eval checkpoint=DIR data.test=[FILE.jsonl,...]")
    for path in paths:
        if not Path(path).is_file():
            raise ConfigError(f"data.test: {path}: no such file")
    for path in paths:  # every bad record of every file, before the model loads (BadRecords)
        load_records(path, "test")
    check_not_another_run(run_dir / "metrics.json", cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    scorer = load_scorer(cfg)
    metrics, predictions = evaluate_files(scorer, paths)
    result = {"model": str(cfg.checkpoint), "kind": scorer.kind, "files": metrics,
              "wall_seconds": round(time.time() - started, 1)}
    write_json(run_dir / "metrics.json", result)
    with open(run_dir / "predictions.jsonl", "w", encoding="utf-8") as out:
        for path, rows in predictions.items():
            for row in rows:
                out.write(json.dumps({"file": path, **row}, ensure_ascii=False) + "\n")
    return result


def check_not_another_run(metrics: Path, cfg: EvalConfig) -> None:
    """The run dir is outputs/eval/<name>, `default` unless name= is set: results of another
    checkpoint or other test files there are not overwritten (the same evaluation is re-run)."""
    if not metrics.is_file():
        return
    before = json.loads(metrics.read_text(encoding="utf-8"))
    if before.get("model") != str(cfg.checkpoint) or sorted(before.get("files", {})) != sorted(cfg.data.test):
        raise ConfigError(f"{metrics.parent} holds the results of checkpoint={before.get('model')} "
                          f"on other files or another checkpoint: give this evaluation its own "
                          f"name= (name={cfg.name} is taken)")


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


@hydra.main(version_base="1.3", config_path="pkg://crm_configs", config_name="eval")
@one_line_config_errors
def _main(cfg: DictConfig) -> None:
    result = evaluate(cfg)
    print(summary(result["files"]))
    print(f"metrics: {Path(HydraConfig.get().runtime.output_dir) / 'metrics.json'}")


def main() -> None:
    sys.argv = checkpoint_argument(sys.argv)
    _main()


if __name__ == "__main__":
    sys.exit(main())
