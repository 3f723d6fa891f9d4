"""A board at scale: engine=ray with 2 workers x 1 torch thread against engine=local with 1 thread
(docs/PERFORMANCE.md section 12, docs/DESIGN.md section 8.5).

Prints one JSON document: rows per second of `crm.evaluation.leaderboard.judge` after start-up for
each engine, alternating (local, ray, local, ray, ...) in the same run, each engine's start-up
seconds (local: loading the CRM; ray: starting a local Ray, its workers and their CRMs), the
speed-up of the medians, and the largest difference between the two engines' P(win) (and the
outcomes, win / tie / loss, that differ: none expected). The bench is the demo's generator
enlarged: `--queries` queries x 8 models against the baseline (2,500 x 8 = 20,000 (query, model)
rows by default). The CRM is the demo's tiny Qwen3 (configs/model/tiny.yaml) randomly
initialised, with a BPE trained on the demo's training data as crm-train trains it: a forward's
cost does not depend on the weights.
The machine's CPU and its load (`uptime`) before and after each measurement are recorded: the
speed-up needs two otherwise idle cores. Each scorer computes on one thread: torch's, and no pool
of the Rust tokenizer's (TOKENIZERS_PARALLELISM=false, as the engine sets it in each Ray worker):
with its pool, engine=local ran on 1.1 cores (docs/PERFORMANCE.md section 12). Each run's CPU
seconds (local: the process's; ray: the driver's and the workers' in their blocks) give rows per
CPU second, which a busy machine moves less than rows per second: what engine=ray costs in CPU
over engine=local.

    python benchmarks/score_scale.py [--queries 2500] [--rounds 2] [--block-prompts 8] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ray
import torch
from omegaconf import OmegaConf

import crm_configs
from crm.core.prompts import PromptTemplate
from crm.core.records import read_lines
from crm.data.demo import BENCH_BASELINE, TRAIN_WORDINGS, write_demo
from crm.evaluation.leaderboard import judge, select
from crm.inference.engine import EngineConfig, RayScorer, ScorerLoader, checkpoint_identity
from crm.inference.scorer import CRMScorer
from crm.models.export import export_crm
from crm.models.factory import LossConfig, ModelConfig, build_crm
from crm.models.tokenizer import train_bpe_tokenizer

CRITERIA = [TRAIN_WORDINGS["detailed"][1]]
os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per scorer, local and each worker alike


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines()
                    if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor()


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def demo_crm(out: Path, data: Path) -> Path:
    def texts():
        yield PromptTemplate().pairwise
        for line in read_lines(str(data / "train.jsonl"), "train"):
            if line.record:
                r = line.record
                yield "\n".join(r.a_criteria + r.b_criteria
                                + tuple(m.content for m in r.model_a + r.model_b))

    model = OmegaConf.load(Path(crm_configs.__file__).parent / "model" / "tiny.yaml")
    tokenizer = train_bpe_tokenizer(texts(), vocab_size=model.vocab_size)
    torch.manual_seed(0)
    crm = build_crm(ModelConfig(arch=OmegaConf.to_container(model.arch), attention="sdpa"),
                    LossConfig("pairwise"), num_labels=2, pad_token_id=tokenizer.pad_token_id,
                    vocab_size=len(tokenizer))
    return export_crm(crm.model, tokenizer, out, kind="pairwise", template=PromptTemplate(),
                      max_tokens=512)


def run_local(export: Path, selection, batch_size: int) -> tuple[dict, list]:
    torch.set_num_threads(1)
    before = load()
    start = time.perf_counter()
    scorer = CRMScorer.load(export, batch_size=batch_size, device=torch.device("cpu"))
    startup = time.perf_counter() - start
    start, cpu = time.perf_counter(), time.process_time()
    outcomes = judge(scorer, selection, CRITERIA)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return ({"engine": "local", "threads": 1, "startup_seconds": round(startup, 2),
             "seconds": round(seconds, 2), "rows_per_s": round(len(outcomes) / seconds, 1),
             "cpu_seconds": round(cpu, 2), "rows_per_cpu_s": round(len(outcomes) / cpu, 1),
             "load_before": before, "load_after": load()}, outcomes)


def run_ray(export: Path, selection, batch_size: int, block_prompts: int) -> tuple[dict, list]:
    before = load()
    start = time.perf_counter()
    config = EngineConfig(name="ray", workers=2, cpus_per_worker=1, block_prompts=block_prompts)
    scorer = RayScorer.start(ScorerLoader(str(export), batch_size), config,
                             identity=checkpoint_identity(export))
    startup = time.perf_counter() - start
    try:
        start, cpu = time.perf_counter(), time.process_time()
        outcomes = judge(scorer, selection, CRITERIA)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    finally:
        scorer.close()
    return ({"engine": "ray", "workers": 2, "threads_per_worker": 1,
             "block_prompts": block_prompts, "blocks": scorer.tasks[0]["blocks"],
             "blocks_in_flight": scorer.pool.describe()["blocks_in_flight"],
             "startup_seconds": round(startup, 2), "seconds": round(seconds, 2),
             "rows_per_s": round(len(outcomes) / seconds, 1),
             "cpu_seconds": {"driver": round(cpu, 2), "workers": round(scorer.cpu_seconds, 2)},
             "rows_per_cpu_s": round(len(outcomes) / (cpu + scorer.cpu_seconds), 1),
             "load_before": before,
             "load_after": load()}, outcomes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queries", type=int, default=2500)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--block-prompts", type=int, default=8)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        write_demo(tmp / "data", n_train=500, n_test=2, n_bench=args.queries)
        export = demo_crm(tmp / "export", tmp / "data")
        selection = select(tmp / "data" / "bench.jsonl", BENCH_BASELINE)
        rows = len(selection.records) * len(selection.models)
        runs, scores = [], {}
        for _ in range(args.rounds):
            for engine in ("local", "ray"):
                if engine == "local":
                    run, p = run_local(export, selection, args.batch_size)
                else:
                    run, p = run_ray(export, selection, args.batch_size, args.block_prompts)
                runs.append(run)
                scores.setdefault(engine, p)
                print(json.dumps(run), flush=True, file=sys.stderr)
    local_p = torch.tensor([o.p_win for o in scores["local"]])
    ray_p = torch.tensor([o.p_win for o in scores["ray"]])
    rate = {e: statistics.median(r["rows_per_s"] for r in runs if r["engine"] == e)
            for e in ("local", "ray")}
    result = {
        "benchmark": "score_scale", "cpu": cpu_model(), "cores": os.cpu_count(),
        "torch": torch.__version__, "ray": ray.__version__,
        "rows": rows, "queries": len(selection.records), "models": len(selection.models),
        "criteria": CRITERIA, "batch_size": args.batch_size,
        "threads_per_scorer": "1 (torch.set_num_threads(1), TOKENIZERS_PARALLELISM=false)", "runs": runs,
        "median_rows_per_s": rate, "speedup": round(rate["ray"] / rate["local"], 3),
        "startup_seconds": {e: [r["startup_seconds"] for r in runs if r["engine"] == e]
                            for e in ("local", "ray")},
        "max_abs_p_win_difference": float((local_p - ray_p).abs().max()),
        "outcomes_differ": sum(a.result != b.result for a, b in zip(scores["local"], scores["ray"])),
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
