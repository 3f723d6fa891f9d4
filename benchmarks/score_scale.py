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

`--cold` measures a command's whole life instead, start-up included (issue 58): each run is a fresh
Python process, timed from its spawn, that does what crm-leaderboard does in its order: imports
crm's evaluation, reads the bench, loads the CRM (local: torch and the model) or starts a local
Ray and its workers (ray: RayScorer.start, which imports torch where the engine does), judges
every row and closes; it reports when each step ended and when the first block was scored (ray).
`--models N` keeps N models per query and `--answer-repeat K` makes every answer K times longer
(the length policy cuts what does not fit), so that a board's rows cost about what a published
benchmark's do:

    python benchmarks/score_scale.py --cold --queries 3000 --models 4 --answer-repeat 6 --rounds 2 \
        --engines local,ray-before,ray,ray-auto --before DIR

`--engines` picks the runs of a round: `ray` starts a local Ray per run, `ray-auto` joins with
engine.address=auto a cluster started once (`ray start --head`, as SLURM.md says), `ray-before`
is `ray` with crm imported from `--before DIR` (another commit's crm/, for a before/after in one
run under the same load).
"""
# ruff: noqa: E402 (a cold run's child runs before the imports it measures)
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def child() -> None:
    """One cold run (`--cold`): this process's steps, in seconds since the parent spawned it.
    Runs before this file's own imports, importing what the command would, when it would."""
    spawned = float(sys.argv[sys.argv.index("--spawned") + 1])
    argv = dict(zip(sys.argv[1::2], sys.argv[2::2]))
    since = lambda: round(time.time() - spawned, 3)  # noqa: E731
    steps, first = {"python_started": since()}, []
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from crm.evaluation.leaderboard import judge, select

    steps["imported"] = since()
    cpu = time.process_time()
    models = argv["--model-names"].split(",") if "--model-names" in argv else None
    selection = select(argv["--bench"], argv["--baseline"], models=models)
    steps["read"] = since()
    engine, export, batch_size = argv["--child"], argv["--export"], int(argv["--batch-size"])
    if engine == "local":
        import torch

        from crm.inference.scorer import CRMScorer

        torch.set_num_threads(1)
        scorer = CRMScorer.load(export, batch_size=batch_size, device=torch.device("cpu"))
    else:
        from crm.inference.engine import EngineConfig, RayScorer, ScorerLoader, checkpoint_identity

        config = EngineConfig(name="ray", address="auto" if engine == "ray-auto" else None,
                              workers=2, cpus_per_worker=1,
                              block_prompts=int(argv["--block-prompts"]))
        scorer = RayScorer.start(ScorerLoader(export, batch_size), config,
                                 identity=checkpoint_identity(export),
                                 on_block=lambda task, block: first or first.append(since()))
    steps["started"] = since()
    outcomes = judge(scorer, selection, [argv["--criteria"]])
    steps["judged"] = since()
    result = {"engine": engine, "rows": len(outcomes), "steps": steps}
    if engine != "local":
        scorer.close()
        result["crm"] = str(Path(sys.modules["crm"].__file__).parent)
        steps["closed"] = since()
        steps["first_block"] = first[0]
        result.update(workers_cpu_seconds=round(scorer.cpu_seconds, 2),
                      startup_seconds=scorer.pool.describe()["startup_seconds"])
    result.update(driver_cpu_seconds=round(time.process_time() - cpu, 2),
                  p_win=[round(o.p_win, 7) for o in outcomes], results=[o.result for o in outcomes])
    print(json.dumps(result), flush=True)
    if engine != "local":  # a start still under way stops what it started (no join before issue 58)
        getattr(scorer.pool, "join", lambda: None)()


if __name__ == "__main__" and "--child" in sys.argv:  # before this file's imports: they are measured
    sys.exit(child())

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
    getattr(scorer.pool, "wait", lambda: None)()  # the start runs behind the caller since issue 58
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


def lengthen(bench: Path, repeat: int) -> None:
    """Every answer of `bench` `repeat` times over, in place."""
    lines = []
    for line in bench.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        record["responses"] = {m: "\n".join([r] * repeat) for m, r in record["responses"].items()}
        lines.append(json.dumps(record, ensure_ascii=False))
    bench.write_text("\n".join(lines) + "\n", encoding="utf-8")


@contextlib.contextmanager
def running_cluster(tmp: Path):
    """A Ray cluster started as SLURM.md says (`ray start --head`, 127.0.0.1 only, token auth),
    for the `ray-auto` runs to join (engine.address=auto); its address. Stopped at the end."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    process = subprocess.Popen(
        [str(Path(sys.executable).parent / "ray"), "start", "--head", f"--port={port}",
         "--num-cpus=2", "--disable-usage-stats", "--include-dashboard=false", "--block",
         f"--temp-dir={tmp / 'ray'}"], env=env, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 180
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.time() > deadline or process.poll() is not None:
                    raise RuntimeError("ray start --head did not come up") from None
                time.sleep(0.5)
        time.sleep(5)  # the raylet registers after the GCS answers
        yield f"127.0.0.1:{port}"
    finally:  # ray start --block stops its node on SIGTERM; what is left goes with its group
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def cold(args, tmp: Path, export: Path, bench: Path, model_names: list[str] | None) -> dict:
    """The engines alternating, each run a fresh process timed from outside. The cluster a
    ray-auto run joins runs for that run only (untimed): Ray before issue 58 joined any cluster
    on the machine where it meant to start its own."""
    engines = args.engines.split(",")
    runs, scores = [], {}
    for _ in range(args.rounds):
        for engine in engines:
            with contextlib.ExitStack() as stack:
                address = stack.enter_context(running_cluster(tmp)) if engine == "ray-auto" else None
                run = cold_run(args, export, bench, model_names, engine, address, scores)
            runs.append(run)
            print(json.dumps(run), flush=True, file=sys.stderr)
    return summary(engines, runs, scores)


def cold_run(args, export, bench, model_names, engine, address, scores) -> dict:
    """One run of `engine` in a fresh process, timed from its spawn; its scores kept in `scores`
    (the first run of each engine)."""
    before = load()
    spawned = time.time()
    command = [sys.executable, __file__, "--child", engine, "--spawned", repr(spawned),
               "--export", str(export), "--bench", str(bench),
               "--baseline", BENCH_BASELINE, "--criteria", CRITERIA[0],
               "--batch-size", str(args.batch_size), "--block-prompts", str(args.block_prompts)]
    if model_names:
        command += ["--model-names", ",".join(model_names)]
    env = {**os.environ, **({"RAY_ADDRESS": address} if engine == "ray-auto" else {}),
           **({"PYTHONPATH": args.before} if engine == "ray-before" else {})}
    # cwd: not the checkout's root, which Ray's workers would import crm from (ray-before's too)
    out = subprocess.run(command, capture_output=True, text=True, env=env, cwd=export.parent)
    if out.returncode:
        sys.exit(f"{engine} run failed ({out.returncode}):\n{out.stdout[-2000:]}\n"
                 f"{out.stderr[-3000:]}")
    wall = time.time() - spawned
    run = json.loads(out.stdout.strip().splitlines()[-1])
    scores.setdefault(engine, (run.pop("p_win"), run.pop("results")))
    run.pop("p_win", None), run.pop("results", None)
    run.update(wall_seconds=round(wall, 2), rows_per_s=round(run["rows"] / wall, 1),
               load_before=before, load_after=load())
    return run


def summary(engines: list[str], runs: list[dict], scores: dict) -> dict:
    wall = {e: statistics.median(r["wall_seconds"] for r in runs if r["engine"] == e)
            for e in engines}
    first = {e: statistics.median(r["steps"]["first_block"] for r in runs if r["engine"] == e)
             for e in engines if e != "local"}
    local_p, local_r = scores["local"]
    return {"runs": runs, "median_wall_seconds": wall, "median_first_block_seconds": first,
            "speedup_startup_included": {e: round(wall["local"] / wall[e], 3)
                                         for e in engines if e != "local"},
            "max_abs_p_win_difference": {e: max(abs(a - b) for a, b in zip(local_p, scores[e][0]))
                                         for e in engines if e != "local"},
            "outcomes_differ": {e: sum(a != b for a, b in zip(local_r, scores[e][1]))
                                for e in engines if e != "local"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queries", type=int, default=2500)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--block-prompts", type=int, default=8)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--cold", action="store_true", help="start-up included: a process per run")
    parser.add_argument("--models", type=int, help="models per query (default: all 8)")
    parser.add_argument("--answer-repeat", type=int, default=1)
    parser.add_argument("--engines", default="local,ray",
                        help="--cold: local, ray (a local Ray per run), ray-auto (engine.address=auto "
                             "joining a cluster started once), ray-before (ray, with crm imported "
                             "from --before); local first")
    parser.add_argument("--before", help="--cold: a directory holding another crm/ (e.g. `git "
                                         "archive <commit> crm | tar -x -C DIR`) for ray-before")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        write_demo(tmp / "data", n_train=500, n_test=2, n_bench=args.queries)
        bench = tmp / "data" / "bench.jsonl"
        if args.answer_repeat > 1:
            lengthen(bench, args.answer_repeat)
        export = demo_crm(tmp / "export", tmp / "data")
        selection = select(bench, BENCH_BASELINE)
        model_names = None
        if args.models:
            model_names = list(selection.models[:args.models])
            selection = select(bench, BENCH_BASELINE, models=model_names)
        rows = len(selection.records) * len(selection.models)
        if args.cold:
            import crm

            result = {"benchmark": "score_scale --cold", "cpu": cpu_model(),
                      "crm": str(Path(crm.__file__).parent),  # PYTHONPATH may point at another
                      "cores": os.cpu_count(), "torch": torch.__version__, "ray": ray.__version__,
                      "rows": rows, "queries": len(selection.records),
                      "models": len(selection.models), "answer_repeat": args.answer_repeat,
                      "criteria": CRITERIA, "batch_size": args.batch_size,
                      "block_prompts": args.block_prompts,
                      "threads": "local 1; ray 2 workers x 1 (TOKENIZERS_PARALLELISM=false)",
                      **cold(args, tmp, export, bench, model_names)}
            text = json.dumps(result, indent=1)
            print(text)
            if args.out:
                args.out.write_text(text + "\n", encoding="utf-8")
            return
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
