"""The floor plan (docs/DESIGN.md section 1): crm's folders are its layers and imports only point
down, so serving a CRM loads no trainer. Checked on the source (every `crm.*` import, in functions
too) and on a running process (what crm-eval, crm-leaderboard and crm-usl have imported)."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from scorers import export_tiny, tiny_scorer

REPO = Path(__file__).resolve().parents[1]
# Each layer and the layers it may import (besides itself). Two stacks share the bottom:
# core < data < models < perf < training, and models < inference < evaluation < app (and
# inference < rl: RL with a CRM reward); cli is on top.
BELOW = {
    "core": set(),
    "data": {"core"},
    "models": {"core", "data"},
    "perf": {"core", "data", "models"},
    "training": {"core", "data", "models", "perf"},
    "inference": {"core", "data", "models"},
    "evaluation": {"core", "data", "models", "inference"},
    "app": {"core", "data", "models", "inference", "evaluation"},
    "rl": {"core", "data", "models", "inference"},
    "cli": {"core", "data", "models", "perf", "training", "inference", "evaluation", "app", "rl"},
    "data_tools": {"core", "data"},
}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, module level or not; `from crm.x import y`
    counts as crm.x.y, since y may be a module."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return out


def layer_of(path: Path) -> str:
    parts = path.relative_to(REPO).parts
    return "data_tools" if parts[0] == "data_tools" else parts[1]


def sources() -> list[Path]:
    """Every module of the library and of data_tools; crm/__init__.py (the public API, lazy) and
    the layers' own __init__ files hold no imports to check."""
    return [p for p in sorted([*REPO.glob("crm/*/*.py"), *REPO.glob("data_tools/*.py")])
            if p.name != "__init__.py"]


def test_every_layer_is_listed_and_every_module_is_in_a_layer():
    layers = {p.name for p in (REPO / "crm").iterdir() if (p / "__init__.py").is_file()}
    assert layers == set(BELOW) - {"data_tools"}
    assert not [p.name for p in (REPO / "crm").glob("*.py") if p.name != "__init__.py"]


def test_imports_point_down_the_layers():
    wrong = []
    for path in sources():
        layer = layer_of(path)
        for line, module in imported_modules(path):
            if module == "crm" or not module.startswith("crm."):
                continue
            target = module.split(".")[1]
            if target != layer and target not in BELOW[layer]:
                wrong.append(f"{path.relative_to(REPO)}:{line}: {layer} imports {module}")
    assert not wrong, "\n".join(wrong)


# What several entry points share, each module one concern (docs/DESIGN.md section 1).
CLI_SHARED = ("crm.cli.schema", "crm.cli.errors", "crm.cli.scorer", "crm.cli.multirun",
              "crm.cli.record")


def test_an_entry_point_imports_no_other_one():
    for path in REPO.glob("crm/cli/*.py"):
        others = [m for _, m in imported_modules(path)
                  if m.startswith("crm.cli.")
                  and not any(m == shared or m.startswith(shared + ".") for shared in CLI_SHARED)]
        assert not others, f"{path.name}: {others}"


# The libraries a console script must not load before its config is composed and checked: its
# `--help` and a refused setting answer in about a second (benchmarks/cli_start.py), then the work
# loads what it needs.
HEAVY = ("torch", "lightning", "transformers", "torchmetrics", "peft", "scipy")


def test_importing_a_console_script_loads_no_heavy_library():
    """Every entry point of setup.py imported in one fresh interpreter: none of HEAVY is loaded.
    What a command's start needs (its schema and its checks) lives in torch-free modules."""
    from importlib.metadata import distribution

    modules = sorted({e.value.split(":")[0] for e in distribution("crm").entry_points
                      if e.group == "console_scripts"})
    probe = ("import importlib, json, sys\n"
             f"for m in {modules!r}: importlib.import_module(m)\n"
             f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "crm.cli.train" in modules and "crm.cli.rl" in modules
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


# Run in a fresh interpreter: what each step has imported so far. The commands run as their
# console scripts do (main() with sys.argv), crm-usl up to its built app (serving would block).
PROBE = """
import json, sys
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra

def trainer_modules():
    found = sorted(m for m in sys.modules if m.split(".")[0] in ("lightning", "pytorch_lightning")
                   or m.startswith("crm.training") or m == "crm.cli.train")
    if "train_schema.yaml" in ConfigStore.instance().repo:  # crm-train's config
        found.append("ConfigStore: train_schema")
    return found

def command(main, *argv):
    sys.argv = list(argv)
    main()
    GlobalHydra.instance().clear()

P = json.loads(sys.argv[1])  # the files the test wrote
seen = {}
import crm.core.records, crm.core.prompts, crm.core.examples
seen["crm.core: torch"] = [m for m in ("torch", "transformers") if m in sys.modules]
import crm.inference.scorer
seen["import crm.inference.scorer"] = trainer_modules()
from crm.cli.eval import main as eval_main
for checkpoint, run_dir in ((P["export"], "eval"), (P["ckpt"], "eval-ckpt")):
    command(eval_main, "crm-eval", f"checkpoint={checkpoint}", f"data.test=[{P['test']}]",
            "progress=false", f"hydra.run.dir={P['out']}/{run_dir}")
seen["crm-eval"] = trainer_modules()
from crm.cli.leaderboard import main as leaderboard_main
command(leaderboard_main, "crm-leaderboard", f"checkpoint={P['export']}", f"bench={P['bench']}",
        "baseline=base", "criteria=[short]", "progress=false", "interval.resamples=10",
        f"hydra.run.dir={P['out']}/leaderboard")
seen["crm-leaderboard"] = trainer_modules()
from hydra import compose, initialize_config_module
from crm.cli.usl import build_app
with initialize_config_module(version_base="1.3", config_module="crm_configs"):
    cfg = compose("usl", overrides=[f"checkpoint={P['export']}", f"bench={P['bench']}",
                                    "baseline=base", "cache.dir=null", "interval.resamples=10"])
page, service = build_app(cfg)
seen["crm-usl (the app built)"] = trainer_modules()
print(json.dumps(seen))
"""


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_serving_a_crm_loads_no_trainer(tmp_path):
    """crm-eval (an export and a checkpoint file), crm-leaderboard, crm-usl and the scorer import
    no Lightning, no crm.training module and not crm-train's config; crm.core no torch."""
    from crm.models.checkpoint import CARD, PREFIX, describe

    export = export_tiny(tmp_path / "export")
    scorer = tiny_scorer()
    ckpt = tmp_path / "last.ckpt"  # what load_crm reads of a crm-train checkpoint
    torch.save({"state_dict": {PREFIX + k: v for k, v in scorer.model.state_dict().items()},
                CARD: describe(scorer.model, scorer.tokenizer, kind="pairwise",
                               template=scorer.template, max_tokens=1000), "global_step": 0}, ckpt)
    conversation = [{"role": "user", "content": "a question"}]
    test = write_jsonl(tmp_path / "test.jsonl", [
        {"idx": i, "prompt": "a question", "criteria": ["short"], "preference": "model_a",
         "model_a": [*conversation, {"role": "assistant", "content": "yes"}],
         "model_b": [*conversation, {"role": "assistant", "content": "no " * i}]}
        for i in range(1, 3)])
    bench = write_jsonl(tmp_path / "bench.jsonl", [
        {"idx": f"q{i}", "topic": "t", "prompt": f"question {i}",
         "responses": {"base": "alpha", "m1": "beta " * i}} for i in range(1, 3)])
    files = {name: str(path) for name, path in
             dict(export=export, ckpt=ckpt, test=test, bench=bench, out=tmp_path).items()}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(PROBE), json.dumps(files)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen == {"crm.core: torch": [], "import crm.inference.scorer": [], "crm-eval": [],
                    "crm-leaderboard": [], "crm-usl (the app built)": []}
    assert (tmp_path / "eval-ckpt" / "metrics.json").is_file()
