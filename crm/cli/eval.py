"""crm-eval: score test files with a trained CRM (metrics.json, predictions.jsonl), or a benchmark
in its published layout (metrics.json, scores.jsonl; crm.evaluation.benchmarks, docs/EVALUATION.md).

    crm-eval checkpoint=outputs/demo/export data.test=[a.jsonl,b.jsonl] [name=...] [batch_size=...]
    crm-eval checkpoint=outputs/demo/export benchmark=rewardbench2 benchmark.path=DIR [criteria=none]

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
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import MISSING, DictConfig

from crm.cli.errors import one_line_config_errors
from crm.cli.record import save_run_record
from crm.cli.schema import PathsConfig, check_test_files, register_schema, settings
from crm.cli.scorer import ScorerSettings, checkpoint_argument, close_scorer, load_scorer
from crm.core.errors import ConfigError
from crm.core.files import refuse_replacing, write_json
from crm.evaluation.benchmarks import (BenchmarkConfig, criteria_override, describe,
                                       load_benchmark, run_benchmark)

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
    benchmark: BenchmarkConfig | None = None  # the `benchmark` group: configs/benchmark/<name>.yaml
    criteria: Any = None  # null, none, or the criteria for every prompt of the benchmark

    def __post_init__(self):
        super().__post_init__()
        criteria_override(self.criteria)


register_schema("eval", EvalConfig)


def evaluate(composed: DictConfig) -> dict:
    started = time.time()
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    cfg = settings(composed)
    paths = cfg.data.test
    if not paths and cfg.benchmark is None:
        raise ConfigError("no test files and no benchmark: crm-eval checkpoint=DIR "
                          "data.test=[FILE.jsonl,...] or benchmark=NAME benchmark.path=PATH")
    if cfg.criteria is not None and cfg.benchmark is None:
        raise ConfigError(f"criteria={cfg.criteria}: a benchmark's criteria (benchmark=NAME); "
                          "test records carry their own")
    check_test_files(paths, "data.test")
    check_not_another_run(run_dir / "metrics.json", cfg)
    # engine=local: the benchmark read and checked whole before the model loads, so that a file
    # not in its layout stops here. engine=ray: Ray and its workers start first, while the
    # benchmark is read (such a file still stops the command at once: closing the scorer does
    # not wait for the start).
    scorer = load_scorer(cfg, run_dir) if cfg.engine.name == "ray" else None
    try:
        benchmark = cfg.benchmark and load_benchmark(cfg.benchmark, criteria_override(cfg.criteria))
        save_run_record(composed)
        if scorer is None:
            scorer = load_scorer(cfg, run_dir)
        from crm.evaluation.accuracy import evaluate_files  # torch: not for --help or a refusal

        metrics, predictions = evaluate_files(scorer, paths)
        result = {"model": str(cfg.checkpoint), "kind": scorer.kind, "files": metrics}
        if benchmark:
            # the bar where the scorer's would show: on a terminal only (load_scorer)
            result["benchmark"] = run_benchmark(scorer, benchmark, run_dir, progress=scorer.progress)
    finally:
        if scorer is not None:
            close_scorer(scorer)
    result["wall_seconds"] = round(time.time() - started, 1)
    write_json(run_dir / "metrics.json", result)
    if paths:
        with open(run_dir / "predictions.jsonl", "w", encoding="utf-8") as out:
            for path, rows in predictions.items():
                for row in rows:
                    out.write(json.dumps({"file": path, **row}, ensure_ascii=False) + "\n")
    return result


def check_not_another_run(metrics: Path, cfg: EvalConfig) -> None:
    """The run dir is outputs/eval/<name>, `default` unless name= is set: results of another
    checkpoint, other test files or another benchmark there are not overwritten (the same
    evaluation is re-run)."""
    benchmark = cfg.benchmark.name if cfg.benchmark else None
    refuse_replacing(metrics, evaluation_inputs(str(cfg.checkpoint), cfg.data.test, benchmark),
                     lambda before: evaluation_inputs(
                         before.get("model"), before.get("files") or {},
                         (before.get("benchmark") or {}).get("benchmark")),
                     f"give this evaluation its own name= (name={cfg.name} is taken)")


def evaluation_inputs(checkpoint, test_files, benchmark) -> dict:
    return {"checkpoint": checkpoint, "data.test": sorted(test_files), "benchmark": benchmark}


def summary(files: dict) -> str:
    """One line per file: accuracy in the given and swapped order, their mean, flip and tie rates."""
    head = (f"{'file':>20} {'n':>5} {'given':>7} {'swapped':>7} {'mean':>7} {'both':>7} "
            f"{'flip':>7} {'ties':>7}")
    lines = [head]
    for path, m in files.items():
        lines.append(f"{Path(path).stem[:20]:>20} {m['n']:>5} {m['accuracy']:>7.4f} "
                     f"{m['accuracy_swapped']:>7.4f} {m['accuracy_mean']:>7.4f} "
                     f"{m['accuracy_both_orders']:>7.4f} {m['flip_rate']:>7.4f} "
                     + (f"{m['tie_rate']:>7.4f}" if m["tie_rate"] is not None else f"{'-':>7}")
                     + (f"  ({m['unscorable']} unscorable)" if m["unscorable"] else "")
                     + (f"  ({m['shortened']} shortened to fit)" if m.get("shortened") else ""))
    return "\n".join(lines)


@hydra.main(version_base="1.3", config_path="pkg://crm_configs", config_name="eval")
@one_line_config_errors
def _main(cfg: DictConfig) -> None:
    result = evaluate(cfg)
    if result["files"]:
        print(summary(result["files"]))
    if "benchmark" in result:
        print(describe(result["benchmark"]))
    print(f"metrics: {Path(HydraConfig.get().runtime.output_dir) / 'metrics.json'}")


def main() -> None:
    sys.argv = checkpoint_argument(sys.argv)
    _main()


if __name__ == "__main__":
    sys.exit(main())
