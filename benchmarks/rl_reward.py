"""crm.CRMReward's throughput as a GRPO reward, and the crm-rl demo's runtime (docs/RL.md).

Prints one JSON document:

1. Completions scored per second by each strategy on a GRPO-shaped batch: --prompts prompts of the
   demo data x --group completions each (the demo's answers cut after 1-5 sentences), under one
   criteria line, with a fresh verdict cache (every completion new, as in training). The tiny CRM
   is the demo's architecture (configs/model/tiny.yaml), randomly initialised (a forward costs the
   same whatever the weights), with a BPE trained on the demo data, on CPU in float32. Figures are
   per second of this process's CPU time, best of --repeats (on a shared machine wall time
   measures the neighbours; wall-clock figures are reported too), with the model forwards per
   completion. A 0.6B-size CRM (Qwen3-0.6B's shape, random init, bfloat16) is measured only
   where CUDA is visible.
2. `crm-rl` with no overrides (the demo) as a subprocess, when the demo's CRM exists under
   CRM_ROOT (`make demo`): its wall time and the harness's own split (warm-up, runs). --no-demo
   skips it.

    python benchmarks/rl_reward.py [--prompts 16] [--group 4] [--repeats 3] [--threads 1] [--no-demo]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

import crm_configs
from crm.core.prompts import PromptTemplate
from crm.core.records import read_lines
from crm.data.demo import write_demo
from crm.inference.reward import CRMReward
from crm.inference.scorer import CRMScorer
from crm.models.factory import LossConfig, ModelConfig, build_crm
from crm.models.tokenizer import train_bpe_tokenizer
from crm.rl.policy import first_sentences

ROOT = Path(os.environ.get("CRM_ROOT", "."))
CRITERIA = ["I prefer detailed answers that cover everything."]
STRATEGIES = [("pairwise", "round_robin"), ("pairwise", "reference"), ("pointwise", "pointwise"),
              ("pointwise", "round_robin")]


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def batch(train_file: Path, prompts: int, group: int, seed: int = 0):
    """(prompts, completions, references): `group` completions per prompt, as GRPO hands them."""
    answers: dict[str, list[str]] = {}
    for line in read_lines(train_file, "train"):
        r = line.record
        answers.setdefault(r.query, []).extend([r.model_a[1].content, r.model_b[1].content])
    rng = random.Random(seed)
    rows = []
    for q in rng.sample(sorted(answers), prompts):
        # distinct completions (the worst case: no tie is free), the reference not among them
        texts = sorted({first_sentences(a, k) for a in answers[q][1:] for k in range(1, 6)})
        rows += [(q, text, answers[q][0]) for text in rng.sample(texts, group)]
    return [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]


def tiny_scorers(tokenizer, device, dtype, arch) -> dict[str, CRMScorer]:
    out = {}
    for kind in ("pairwise", "pointwise"):
        torch.manual_seed(0)
        crm = build_crm(ModelConfig(arch=arch, attention="sdpa", dtype=dtype), LossConfig(kind),
                        num_labels=2 if kind == "pairwise" else 1,
                        pad_token_id=tokenizer.pad_token_id, vocab_size=len(tokenizer))
        out[kind] = CRMScorer(crm.model.to(device), tokenizer, PromptTemplate(), kind, 512,
                              batch_size=32, device=device)
    return out


def measure(scorers: dict, prompts, completions, references, repeats: int) -> dict:
    out = {}
    for kind, strategy in STRATEGIES:
        best, wall_best, forwards = None, None, None
        for _ in range(repeats):
            reward = CRMReward(scorers[kind], strategy)  # a fresh cache: every completion is new
            columns = {"criteria": [CRITERIA] * len(completions)}
            if strategy == "reference":
                columns["reference"] = references
            cpu0, wall0 = cpu_seconds(), time.perf_counter()
            reward(prompts, completions, **columns)
            cpu, wall = cpu_seconds() - cpu0, time.perf_counter() - wall0
            best = cpu if best is None else min(best, cpu)
            wall_best = wall if wall_best is None else min(wall_best, wall)
            forwards = reward.counts["forwards"]
        out[f"{kind}/{strategy}"] = {
            "completions_per_cpu_s": round(len(completions) / best, 1),
            "completions_per_wall_s": round(len(completions) / wall_best, 1),
            "forwards_per_completion": round(forwards / len(completions), 2)}
    return out


def demo_runtime() -> dict:
    export = ROOT / "outputs" / "demo" / "export"
    if not (export / "crm.json").is_file():
        return {"measured": False, "why": f"no demo CRM at {export}: `make demo` makes it"}
    env = {**os.environ, "CRM_ROOT": str(ROOT)}
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    done = subprocess.run([str(Path(sys.executable).parent / "crm-rl"), "name=benchmark"], env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode:
        return {"measured": False, "why": done.stderr.strip().splitlines()[-1:]}
    result = json.loads((ROOT / "outputs" / "rl" / "benchmark" / "rl.json").read_text())
    return {"measured": True, "wall_s": round(wall, 1),
            "warm_up_s": result["seconds"]["warm_up"],
            "runs_s": {name: entry["seconds"] for name, entry in result["runs"].items()},
            "guards_s": {name: entry["seconds"] for name, entry in result["guards"].items()
                         if isinstance(entry, dict)},
            "evidence_all_passed": result["evidence"]["all_passed"],
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=4, help="completions per prompt (GRPO's G)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the machine is shared)")
    p.add_argument("--no-demo", action="store_true", help="skip the crm-rl demo's runtime")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        write_demo(tmp, n_train=600, n_test=2, n_bench=1)
        train_file = Path(tmp) / "train.jsonl"
        prompts, completions, references = batch(train_file, args.prompts, args.group)
        texts = [PromptTemplate().pairwise, *CRITERIA, *completions, *references, *prompts]
        tokenizer = train_bpe_tokenizer(texts, vocab_size=2048)
    tiny = OmegaConf.load(Path(crm_configs.__file__).parent / "model" / "tiny.yaml")
    arch = OmegaConf.to_container(tiny.arch)
    result = {
        "batch": {"prompts": args.prompts, "group": args.group, "completions": len(completions),
                  "criteria": CRITERIA},
        "tiny_cpu": measure(tiny_scorers(tokenizer, torch.device("cpu"), "float32", arch),
                            prompts, completions, references, args.repeats),
    }
    if torch.cuda.is_available():
        gpu = tiny_scorers(tokenizer, torch.device("cuda"), "bfloat16", "qwen3-0.6b")
        result["qwen3_0.6b_cuda"] = measure(gpu, prompts, completions, references, args.repeats)
    else:
        result["qwen3_0.6b_cuda"] = "not measured: no GPU on this machine"
    result["machine"] = {"cpus": os.cpu_count(), "threads": args.threads,
                         "loadavg_before": [round(x, 2) for x in load_before],
                         "loadavg_after": [round(x, 2) for x in os.getloadavg()]}
    result["demo"] = {"measured": False, "why": "--no-demo"} if args.no_demo else demo_runtime()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
