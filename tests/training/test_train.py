"""The training pipeline (crm.cli.train): configs, every loss x noise x direction, the demo chain
train -> export -> evaluate, resume, precision, batch accumulation and early stopping.

Runs compose the real configs with `hydra.compose` and call `train(cfg)` on a very small Qwen3
and a small demo data set, generated once per session.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from functools import partial
from pathlib import Path

import lightning as L
import pytest
import torch
from helpers import TINY_DEMO, run_as_job, tiny_tokenizer
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf, open_dict
from transformers import AutoTokenizer

import crm_configs
from crm.data.packing import unpack
from crm.models.checkpoint import load_checkpoint, model_weights
from crm.core.errors import ConfigError
from crm.cli.schema import settings
from crm.cli.train import check_job, train
from crm.training.config import DeviceSettings
from crm.training.module import CRMModule, OptimConfig
from crm.training.resolve import Layout, batch_plan, device_type, lay_out, world_size
from crm.models.factory import LossConfig, ModelConfig, build_crm
from crm.data.padding import pad_rows
from crm.core.records import Message

CONFIG_DIR = Path(crm_configs.__file__).parent

TINY_MODEL = ["model.arch.hidden_size=32", "model.arch.num_hidden_layers=1",
              "model.arch.num_attention_heads=2", "model.arch.num_key_value_heads=1",
              "model.arch.head_dim=16", "model.arch.intermediate_size=64",
              "model.arch.max_position_embeddings=512", "model.vocab_size=1024"]
# Two optimizer steps of 4 records, no sanity-check validation, no export; validation only when a
# test asks for it.
FAST = ["micro_batch_size=4", "global_batch_size=4", "torch_threads=1", "stream.max_tokens=256",
        "stream.num_workers=0", "stream.shuffle_buffer=64", "stream.window_batches=4", "trainer.max_steps=2",
        "val_every_n_steps=100", "save_every_n_steps=100", "optim.warmup_steps=0",
        "logger=none", "trainer.enable_progress_bar=false", "+trainer.enable_model_summary=false",
        "+trainer.num_sanity_val_steps=0", "export=false", "evaluate=false"]


def config_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))


def config_groups() -> list[tuple[str, str]]:
    """(group, option) for every YAML file in a subdirectory of configs/ (nested groups too).

    `common/` dirs hold what a group's options include, not options: they compose through them.
    `benchmark/` is crm-eval's group and `engine/` the scoring commands' (tests/cli/test_schemas.py
    composes them)."""
    return sorted((str(p.parent.relative_to(CONFIG_DIR)), p.stem)
                  for p in CONFIG_DIR.rglob("*.yaml")
                  if p.parent != CONFIG_DIR and p.parent.name not in ("common", "benchmark", "engine"))


def compose_train(overrides: list[str], hydra_node: bool = False):
    with initialize_config_module(version_base="1.3", config_module="crm_configs"):
        return compose("train", overrides=overrides, return_hydra_config=hydra_node)


def run_train(root: Path, run_dir: Path, *overrides: str, tiny: bool = True,
              demo: bool = True) -> dict:
    """train(cfg) as `crm-train` runs it: Hydra's runtime.output_dir set, the hydra node removed."""
    base = (TINY_MODEL if tiny else []) + (TINY_DEMO if demo else []) + FAST
    cfg = compose_train([*base, f"paths.root_dir={root}", f"paths.output_dir={run_dir}",
                         *overrides], hydra_node=True)
    return run_as_job(cfg, train)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def last_ckpt(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)


def optimizer_steps(ckpt: dict) -> set[int]:
    return {int(s["step"]) for s in ckpt["optimizer_states"][0]["state"].values()}


def stream_state(ckpt: dict) -> dict:
    (state,) = ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    return state


# -- 1. configs -----------------------------------------------------------------------------------

def test_config_groups_hold_the_documented_options():
    models = {"tiny", "qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b"}
    assert models <= set(config_options("model"))
    assert {"cls", "ranking"} <= set(config_options("loss"))
    assert {"none", "add", "remove", "replace", "random"} <= set(config_options("noise"))
    assert {"original", "reverse", "random", "curriculum"} <= set(config_options("direction"))
    assert {"demo", "shards"} <= set(config_options("data"))
    assert {"cpu", "gpu", "ddp"} <= set(config_options("trainer"))
    assert {"csv", "wandb", "none"} <= set(config_options("logger"))


@pytest.mark.parametrize("group,option", config_groups(), ids=lambda x: x)
def test_every_config_option_composes_and_resolves(group, option, tmp_path):
    overrides = [f"{group}={option}", f"paths.root_dir={tmp_path}"]
    if (group, option) == ("data", "shards") or (group == "experiment"
                                                 and not option.startswith("cpu_")):
        overrides.append(f"data.path={tmp_path}/shards")  # the user's shards: a required value
    cfg = compose_train(overrides, hydra_node=group.startswith("hydra"))
    with open_dict(cfg):
        cfg.pop("hydra", None)  # resolved by Hydra at run time (hydra.job.num and such)
    resolved = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    node = OmegaConf.select(cfg, group.replace("/", "."))
    if group in ("model", "loss", "noise", "direction", "data", "logger"):
        assert node.name == option  # the option names itself (run names and reports use it)
    if group == "trainer":
        # trainer.* are Lightning Trainer arguments, passed as they are.
        import inspect
        assert set(resolved["trainer"]) <= set(inspect.signature(L.Trainer).parameters)
    if group == "model" and option.startswith("qwen3"):
        from crm.models.backbone import ARCHITECTURES
        assert resolved["model"]["arch"] in ARCHITECTURES
    assert resolved["paths"]["root_dir"] == str(tmp_path)


def test_world_size_and_accumulation_of_the_trainer_configs():
    def devices(*overrides) -> DeviceSettings:
        return DeviceSettings.of(compose_train(list(overrides)).trainer)

    assert world_size(devices("trainer=cpu"), "cpu") == 1
    assert world_size(devices("trainer=ddp"), "cpu") == 2
    assert world_size(devices("trainer=ddp", "trainer.num_nodes=3"), "cpu") == 6
    gpu = compose_train(["trainer=gpu"]).trainer
    # the demo recipe on one GPU: the cpu group's steps
    assert (world_size(devices("trainer=gpu"), "cuda"), gpu.max_steps) == (
        1, compose_train([]).trainer.max_steps)
    assert lay_out(settings(compose_train(["trainer=ddp"])).start_settings()) == Layout(
        "cpu", world_size=2, micro_batch_size=32, accumulation=1)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="trainer.accelerator=gpu: no CUDA device"):
            device_type(devices("trainer=fsdp"))
        with pytest.raises(ConfigError, match="no CUDA device is visible"):
            world_size(devices("trainer=fsdp"), "cuda")
    assert batch_plan(32, 4, 1, 64) == (4, 8)
    assert batch_plan(32, 8, 2, 64) == (8, 2)
    with pytest.raises(ConfigError, match="not a multiple of micro_batch_size=8 x 3 ranks"):
        batch_plan(32, 8, 3, 64)


def test_the_process_group_timeout_is_a_setting_the_strategy_gets(tmp_path):
    from datetime import timedelta

    from crm.training.resolve import resolve_timeout
    from crm.perf.flops import model_shape
    from crm.perf.memory import process_group_timeout_minutes
    from crm.training.parallel import ParallelConfig
    from crm.training.trainer import make_trainer

    parallel = ParallelConfig(timeout_minutes=45)
    for group in ("ddp", "fsdp"):
        trainer_cfg = {**OmegaConf.to_container(compose_train([f"trainer={group}"]).trainer),
                       "accelerator": "cpu", "devices": 2}
        trainer = make_trainer(trainer_cfg, world=2, accumulation=1, val_every_n_steps=1, callbacks=[],
                               logger=False, run_dir=tmp_path, parallel=parallel)
        assert trainer.strategy._timeout == timedelta(minutes=45), group
    with pytest.raises(ValueError, match="parallel.timeout_minutes=0"):
        ParallelConfig(timeout_minutes=0)
    # auto: sized for a checkpoint save at the model size (12 B per trained parameter), at least
    # torch's 30 minutes; a LoRA run saves its adapters and head only.
    cfg = compose_train(["model=qwen3-8b", "trainer=fsdp", "trainer.num_nodes=2",
                         "trainer.devices=8"])
    shape = model_shape(settings(cfg).model, "pairwise")
    assert process_group_timeout_minutes(shape, num_nodes=2) == 30
    slow = process_group_timeout_minutes(shape, num_nodes=2, write_gbs=0.05)  # 50 MB/s a node
    assert slow == math.ceil(3 * shape.total_params * 12 / (2 * 0.05e9) / 60) > 30
    assert process_group_timeout_minutes(shape, num_nodes=2, trained_params=10**8,
                                         write_gbs=0.05) == 30
    minutes = resolve_timeout(settings(cfg).start_settings(), None)
    assert minutes == 30 and ParallelConfig(timeout_minutes=minutes).timeout == timedelta(minutes=30)


def test_auto_micro_batch_is_the_largest_that_divides_a_ranks_share():
    assert batch_plan(64, "auto", 1, 64) == (64, 1)  # the demo: unchanged
    assert batch_plan(64, "auto", 2, 64) == (32, 1)
    assert batch_plan(64, "auto", 2, 8) == (8, 4)  # capped by the memory bound
    assert batch_plan(48, "auto", 2, 10) == (8, 3)  # 24 per rank: 8 divides it, 10 does not
    assert batch_plan(14, "auto", 2, 4) == (1, 7)  # 7 per rank is prime
    with pytest.raises(ConfigError, match="cannot be split over 3 ranks"):
        batch_plan(64, "auto", 3, 64)


def test_direction_curriculum_steps_become_micro_batches_of_a_rank(demo_root, tmp_path):
    def transform(*overrides):  # as check_job builds it, with the run's accumulation
        cfg = compose_train([*TINY_MODEL, *TINY_DEMO, f"paths.root_dir={demo_root}",
                             "global_batch_size=8", "micro_batch_size=4", *overrides])
        return check_job(settings(cfg), tmp_path).transform

    curriculum = transform("direction=curriculum", "direction.warmup_steps=150")
    assert (curriculum.direction, curriculum.warmup_direction) == ("random", "original")
    assert curriculum.warmup_batches == 300  # 150 steps x 2 micro batches
    assert transform("direction=random").warmup_batches == 0


# -- 2. every loss x noise x direction ------------------------------------------------------------

COMBINATIONS = [(loss, noise, direction) for loss in config_options("loss")
                for noise in config_options("noise") for direction in config_options("direction")]


@pytest.mark.parametrize("loss,noise,direction", COMBINATIONS,
                         ids=["-".join(c) for c in COMBINATIONS])
def test_every_loss_noise_direction_trains(loss, noise, direction, demo_root, tmp_path):
    run_dir = tmp_path / "run"
    # One validation, at the last step: its loss is in metrics.json.
    metrics = run_train(demo_root, run_dir, f"loss={loss}", f"noise={noise}",
                        f"direction={direction}", "val_every_n_steps=2")
    train_m = metrics["train"]
    assert train_m["global_step"] == 2
    assert train_m["resumed_from"] is None
    assert math.isfinite(train_m["best_val_loss"]) and train_m["best_val_loss"] > 0
    assert json.loads((run_dir / "metrics.json").read_text())["train"] == train_m
    assert "eval" not in metrics and not (run_dir / "export").exists()


def test_user_shards_train(tmp_path, recwarn, caplog, capsys):
    from crm.data.shard import shard
    from helpers import make_records

    caplog.set_level("INFO", logger="crm")
    source = tmp_path / "train.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for _, r in make_records(48)))
    manifest = shard([str(source)], tmp_path / "shards", val_fraction=0.25, shard_size=16)
    assert manifest["splits"]["val"]["counts"]["written"] >= 4  # at least one validation batch
    run_dir = tmp_path / "run"
    metrics = run_train(tmp_path, run_dir, "data=shards", f"data.path={tmp_path / 'shards'}",
                        "loss=cls", "noise=add", "val_every_n_steps=2", "export=true",
                        "evaluate=true", demo=False)
    assert metrics["train"]["global_step"] == 2
    assert math.isfinite(metrics["train"]["best_val_loss"])
    assert "eval" not in metrics  # data.test_files is empty for user shards
    # Two steps from random init learn a shortcut, and the end of the run says so (issue 44).
    check = metrics["shortcut_check"]
    assert check["records"] >= 4 and check["same_verdict_under_both_criteria"] == 1.0
    assert [w.split(":")[0] for w in check["warnings"]][:1] == ["criteria-blind"]
    assert "the trained CRM is criteria-blind: " in caplog.text
    assert (run_dir / "export" / "model.safetensors").is_file()
    assert not (tmp_path / ".cache").exists()  # nothing of the demo was generated
    # A newcomer's log: none of the warnings known to be harmless (crm.training.trainer
    # quiet_known_warnings), and the parameters in one line instead of a table with 0 FLOPs.
    known = [str(w.message) for w in recwarn
             if "LeafSpec" in str(w.message) or "`IterableDataset` has `__len__`" in str(w.message)]
    assert not known, known
    out = capsys.readouterr().out + caplog.text
    assert "PairwiseCRM: " in out and " parameters, " in out and "FLOPs" not in out, out[-3000:]


# -- 3. the demo chain: train -> export -> evaluate -----------------------------------------------

@pytest.mark.parametrize("loss, ties", [("cls", "none"), ("ranking", "none"), ("ranking", "davidson")])
def test_demo_chain_trains_exports_and_evaluates(loss, ties, demo_root, tmp_path, monkeypatch):
    import matplotlib.pyplot as plt
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from crm.models.heads import davidson_logits, last_token_logits
    from crm.inference.scorer import CRMScorer

    from transformers.utils import logging as hf_logging

    run_dir = tmp_path / "run"
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the curves' figure to read it
    monkeypatch.setattr(hf_logging, "disable_progress_bar", lambda: figures.append("no hf bars"))
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)  # a batch job's log, also under -s
    # Evaluation refuses a test pair that cannot fit: 384 tokens fit every demo pair.
    metrics = run_train(demo_root, run_dir, f"loss={loss}", f"loss.ties={ties}", "trainer.max_steps=4",
                        "val_every_n_steps=2", "stream.max_tokens=384", "logger=csv",
                        "trainer.log_every_n_steps=1",
                        "export=true", "evaluate=true")
    assert metrics == json.loads((run_dir / "metrics.json").read_text())
    assert metrics["train"]["global_step"] == 4
    best = metrics["train"]["best_checkpoint"]
    assert best == str(run_dir / "checkpoints" / "best.ckpt") and Path(best).is_file()

    test_files = compose_train([f"paths.root_dir={demo_root}"]).data.test_files
    assert sorted(metrics["eval"]) == sorted(test_files) and len(test_files) == 5
    for path, m in metrics["eval"].items():
        assert m["n"] > 0, path
        for field in ("accuracy", "accuracy_swapped", "accuracy_mean", "flip_rate", "tie_rate"):
            assert 0.0 <= m[field] <= 1.0, (path, field, m[field])
    header = (run_dir / "csv" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"train/loss", "val/loss", "step"} <= set(header)
    assert (run_dir / "csv" / "curves.png").stat().st_size > 10_000  # the curves beside the CSV
    # drawn at the optimizer steps taken (val after 2 and 4), the CSV's step being one less
    assert figures[0] == "no hf bars"
    (fig,) = figures[1:]
    curves = {line.get_label(): list(line.get_xdata()) for ax in fig.axes
              for line in ax.get_lines() if not line.get_label().startswith("_")}
    assert curves == {"train": [1, 2, 3, 4], "val": [2, 4]}
    assert fig._suptitle.get_text() == "demo · run"  # which run: its name and its dir

    export = run_dir / "export"
    meta = json.loads((export / "crm.json").read_text())
    assert meta["kind"] == ("pairwise" if loss == "cls" else "pointwise")
    assert meta["source"] == best and meta["max_tokens"] == 384
    assert meta["config"]["loss"]["name"] == loss
    # transform.ties=auto: kept where the CRM can say tie (the 3-way head, Davidson's model)
    assert meta["config"]["transform"]["ties"] == ("drop" if (loss, ties) == ("ranking", "none")
                                                   else "keep")
    if ties == "davidson":
        # 4 steps inside the 30-step warmup move a weight by at most 1e-3 * (1+2+3+4) / 30; log nu
        # trains at TIE_LR_SCALE times the rate
        assert meta["ties"]["model"] == "davidson" and abs(meta["ties"]["log_nu"]) > 0.005
    else:
        assert "ties" not in meta

    # Plain transformers loads the export, with the weights of the best checkpoint.
    model = AutoModelForSequenceClassification.from_pretrained(export, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(export, local_files_only=True)
    assert model.config.pad_token_id == tokenizer.pad_token_id is not None
    assert model.config.num_labels == (3 if loss == "cls" else 1)
    saved = model_weights(load_checkpoint(best))
    for name, tensor in model.state_dict().items():
        if name in saved:
            torch.testing.assert_close(tensor, saved[name], rtol=0, atol=0)
    assert set(saved) - set(model.state_dict()) == set()

    # The same logits from plain transformers (the head at the last non-pad token) and CRMScorer.
    scorer = CRMScorer.from_export(export, device="cpu", dtype=torch.float32)
    criteria, query = ["answers concisely", "is friendly"], "how do I boil an egg?"
    a, b = (Message("assistant", "Boil it for nine minutes."),), (Message("assistant", "No idea."),)
    if loss == "cls":
        rows = scorer.encoder.pairwise_many([(criteria, query, a, b), (criteria[:1], query, b, a)])
    else:
        rows = scorer.encoder.pointwise_many([(criteria, query, a), (criteria, query, b)])
    assert len(rows[0]) != len(rows[1])  # the batch pads
    batch = pad_rows(rows, tokenizer.pad_token_id)
    with torch.no_grad():
        plain = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        ours = last_token_logits(scorer.model, batch["input_ids"], batch["attention_mask"])
    torch.testing.assert_close(plain, ours, rtol=1e-5, atol=1e-5)
    if loss == "cls":
        p_a = torch.softmax(plain[0], -1)[0].item()
    elif ties == "davidson":
        p_a = davidson_logits(plain[0, 0] - plain[1, 0], torch.tensor(meta["ties"]["log_nu"])
                              ).softmax(-1)[0].item()
    else:
        p_a = torch.sigmoid(plain[0, 0] - plain[1, 0]).item()
    p_scorer = scorer.compare(criteria, query, a[0].content, b[0].content)
    assert p_scorer == pytest.approx(p_a, abs=1e-5)


# -- 3b. self-describing checkpoints, the prompt template, callbacks from the config -------------

def test_a_moved_run_dir_still_exports_and_scores(demo_root, tmp_path, capsys, monkeypatch):
    """A checkpoint carries its tokenizer, HF config and template: no path into the run dir."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from crm.cli.export import check_out_dir, main as export_main
    from crm.inference.scorer import CRMScorer

    run_dir = tmp_path / "run"
    run_train(demo_root, run_dir, "save_every_n_steps=2")  # the tiny BPE is trained into run/tokenizer
    vocabulary = AutoTokenizer.from_pretrained(run_dir / "tokenizer").get_vocab()
    moved = tmp_path / "elsewhere" / "renamed"
    moved.parent.mkdir()
    run_dir.rename(moved)
    shutil.rmtree(moved / "tokenizer")  # not even the run's own copy is needed
    checkpoint, out = moved / "checkpoints" / "last.ckpt", tmp_path / "export"
    assert export_main([str(checkpoint), str(out)]) == 0
    meta = json.loads((out / "crm.json").read_text())
    assert meta["global_step"] == 2 and meta["source"] == str(checkpoint)
    assert AutoTokenizer.from_pretrained(out).get_vocab() == vocabulary
    saved = model_weights(load_checkpoint(checkpoint))
    exported = load_file(out / "model.safetensors")
    assert exported.keys() == saved.keys()
    for name, tensor in exported.items():
        torch.testing.assert_close(tensor, saved[name], rtol=0, atol=0)
    # Nothing replaced silently: another checkpoint's export, a folder of the user's data, a file.
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("{}\n")
    other = str(moved / "checkpoints" / "other.ckpt")
    allow = "export into a new or empty OUT_DIR, or --overwrite to write over it"
    capsys.readouterr()
    for out_dir, line in (
            (out, f"{out} holds the results of checkpoint={checkpoint} (this run: "
                  f"checkpoint={other}): {allow}"),
            (data, f"{data} exists and is not an output of crm-export (no {data / 'crm.json'}): "
                   f"{allow}"),
            (data / "train.jsonl", f"{data / 'train.jsonl'} is a file, not a directory: OUT_DIR is "
                                   "the folder the exported model goes in; give a new directory or "
                                   "an existing one")):
        assert export_main([other, str(out_dir)]) == 2
        assert capsys.readouterr().err.strip().splitlines() == [f"crm-export: {line}"]
    assert json.loads((out / "crm.json").read_text())["source"] == str(checkpoint)
    assert sorted(p.name for p in data.iterdir()) == ["train.jsonl"]
    # A file that is no checkpoint (here the user's data) is named, not unpickled into a traceback.
    assert export_main([str(data / "train.jsonl"), str(tmp_path / "new")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"crm-export: {data / 'train.jsonl'}: not a checkpoint crm-train wrote (a .ckpt file is "
        "torch's zip archive): give one of a run's checkpoints, outputs/<name>/checkpoints/"]
    check_out_dir(out, str(checkpoint), overwrite=False)  # the same checkpoint re-exports in place
    monkeypatch.chdir(checkpoint.parent)  # and by a relative path, the same file
    check_out_dir(out, checkpoint.name, overwrite=False)
    check_out_dir(data, other, overwrite=True)
    # The scorer reads the moved checkpoint as it reads the export.
    pair = [(["answers concisely"], "how do I boil an egg?", "Nine minutes.", "No idea.")]
    from_ckpt = CRMScorer.load(checkpoint, device=torch.device("cpu"), dtype=torch.float32)
    from_export = CRMScorer.load(out, device=torch.device("cpu"), dtype=torch.float32)
    torch.testing.assert_close(from_ckpt.compare_many(pair), from_export.compare_many(pair),
                               rtol=0, atol=0)


CUSTOM = "C: {criteria} | Q: {query} | 1: {conversation_a} | 2: {conversation_b} | which one?"
SYSTEM = "You judge by the criteria."


def test_a_custom_template_trains_and_survives_export(demo_root, tmp_path, monkeypatch):
    from crm.core.prompts import PromptTemplate
    from crm.inference.scorer import CRMScorer

    seen = []
    original = CRMModule.training_step

    def training_step(self, batch, batch_idx):
        seen.append(unpack(batch)[0] if "read" in batch else
                    batch["input_ids"][0, :int(batch["attention_mask"][0].sum())].tolist())
        return original(self, batch, batch_idx)

    monkeypatch.setattr(CRMModule, "training_step", training_step)
    run_dir = tmp_path / "run"
    run_train(demo_root, run_dir, "loss=cls", f"template.pairwise='{CUSTOM}'",
              f"template.system='{SYSTEM}'", "val_every_n_steps=2", "export=true")
    expected = PromptTemplate(pairwise=CUSTOM, system=SYSTEM)
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "export")
    trained = tokenizer.decode(seen[0])
    assert trained.startswith(f"<|im_start|>system\n{SYSTEM}") and "| which one?" in trained
    for source in (run_dir / "export", run_dir / "checkpoints" / "best.ckpt"):
        scorer = CRMScorer.load(source, device=torch.device("cpu"), dtype=torch.float32)
        assert scorer.template == expected, source
        a, b = (Message("assistant", "a"),), (Message("assistant", "b"),)
        (ids,) = scorer.encoder.pairwise_many([(("brief",), "q?", a, b)])
        assert tokenizer.decode(ids).endswith("| 1: a | 2: b | which one?<|im_end|>\n")
    assert json.loads((run_dir / "export" / "crm.json").read_text())["template"]["pairwise"] == CUSTOM


def test_a_template_with_an_unknown_field_is_refused_before_training(demo_root, tmp_path):
    with pytest.raises(ValueError, match="template pairwise: KeyError\\('answer'\\)"):
        run_train(demo_root, tmp_path / "run", "template.pairwise='{criteria} {answer}'")


def test_callbacks_from_the_config_join_the_run(demo_root, tmp_path):
    extra = tmp_path / "every_step"
    run_train(demo_root, tmp_path / "run",
              f"+callbacks.every_step={{_target_: lightning.pytorch.callbacks.ModelCheckpoint, "
              f"dirpath: '{extra}', every_n_train_steps: 1, save_top_k: -1}}")
    assert sorted(p.name for p in extra.iterdir()) == ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt"]
    with pytest.raises(ValueError, match="callbacks.best: the name of one of crm's own callbacks"):
        run_train(demo_root, tmp_path / "other",
                  "+callbacks.best={_target_: lightning.pytorch.callbacks.Timer}")


def test_logger_wandb_runs_offline(demo_root, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    run_dir = tmp_path / "run"
    run_train(demo_root, run_dir, "logger=wandb", "logger.project=crm-test", "logger.tags=[a]")
    (run,) = (run_dir / "wandb").glob("offline-run-*")
    assert list(run.glob("*.wandb"))


# -- 4. resume ------------------------------------------------------------------------------------

def test_resume_continues_model_optimizer_and_stream(demo_root, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    first = run_train(demo_root, run_dir, "trainer.max_steps=4", "save_every_n_steps=2")
    assert first["train"]["global_step"] == 4 and first["train"]["resumed_from"] is None
    ckpt = last_ckpt(run_dir)
    assert ckpt["global_step"] == 4
    assert optimizer_steps(ckpt) == {4}  # AdamW's per-parameter step counts
    # The stream position is the trained one (4 micro batches of epoch 0), not the prefetched one.
    assert stream_state(ckpt) == {"epoch": 0, "batches_done": 4, "world": 1, "batch_size": 4,
                                  "seed": 0}
    weights_at_4 = ckpt["state_dict"]

    seen = {}

    def on_train_batch_start(self, batch, batch_idx):
        if not seen:  # the state the resumed run starts from
            seen["position"] = batch["position"].tolist()
            seen["steps"] = {int(s["step"]) for s in self.trainer.optimizers[0].state.values()}
            seen["weights"] = {k: v.detach().clone() for k, v in self.state_dict().items()}

    monkeypatch.setattr(CRMModule, "on_train_batch_start", on_train_batch_start)
    second = run_train(demo_root, run_dir, "trainer.max_steps=6", "save_every_n_steps=2",
                       "resume=auto")
    last = str(run_dir / "checkpoints" / "last.ckpt")
    assert second["train"]["resumed_from"] == last
    assert second["train"]["global_step"] == 6
    assert seen["position"] == [0, 4]  # the first batch not yet trained on
    assert seen["steps"] == {4}
    for name, tensor in weights_at_4.items():
        torch.testing.assert_close(seen["weights"][name], tensor, rtol=0, atol=0)
    ckpt = last_ckpt(run_dir)
    assert ckpt["global_step"] == 6 and optimizer_steps(ckpt) == {6}
    assert stream_state(ckpt)["batches_done"] == 6
    assert json.loads((run_dir / "metrics.json").read_text())["train"]["resumed_from"] == last


def test_resume_from_a_missing_path_is_a_clear_error(demo_root, tmp_path):
    missing = tmp_path / "nowhere" / "last.ckpt"
    with pytest.raises(ConfigError, match=f"resume={missing}: no such checkpoint"):
        run_train(demo_root, tmp_path / "run", f"resume={missing}")


def test_resume_false_starts_over(demo_root, tmp_path):
    run_dir = tmp_path / "run"
    run_train(demo_root, run_dir, "save_every_n_steps=2")
    again = run_train(demo_root, run_dir, "resume=false", "trainer.max_steps=1")
    assert again["train"]["resumed_from"] is None and again["train"]["global_step"] == 1


# -- 5. precision ---------------------------------------------------------------------------------

class DtypeProbe(L.Callback):
    """Records parameter, head-output, gradient and AdamW state dtypes of a run."""

    def __init__(self):
        self.seen: dict = {}

    def on_train_start(self, trainer, pl_module):
        def hook(module, args, output):
            self.seen["output"] = output.dtype
            self.seen["autocast"] = (torch.is_autocast_enabled("cpu")
                                     and torch.get_autocast_dtype("cpu"))

        def logits(module, args, output):
            self.seen["logits"] = output.dtype

        # A linear layer of the backbone computes in the precision's dtype; the head in float32.
        pl_module.crm.model.model.layers[-1].mlp.down_proj.register_forward_hook(hook)
        pl_module.crm.register_forward_hook(logits)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen["param"] = {p.dtype for p in pl_module.parameters()}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.seen["grad"] = {p.grad.dtype for p in pl_module.parameters() if p.grad is not None}

    def on_train_end(self, trainer, pl_module):
        state = trainer.optimizers[0].state.values()
        self.seen["exp_avg"] = {s["exp_avg"].dtype for s in state}
        self.seen["exp_avg_sq"] = {s["exp_avg_sq"].dtype for s in state}


def synthetic_batches(tokenizer, n: int = 2) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        rows = [torch.randint(3, len(tokenizer), (length,), generator=g).tolist()
                for length in (5, 9, 7, 4)]
        batch = pad_rows(rows, tokenizer.pad_token_id)
        batch.update(labels=torch.tensor([0, 1, 1, 0]), shortened=torch.tensor(0),
                     dropped=torch.tensor(0), step_examples=torch.tensor(4), step_index=0,
                     step_batches=1, epoch_index=i)
        out.append(batch)
    return out


F32, BF16 = torch.float32, torch.bfloat16


# What Lightning 2.6 does (measured here):
# - 32-true: everything float32.
# - bf16-mixed: autocast to bfloat16 around the forward; parameters, gradients and AdamW states stay
#   in the dtype the model was BUILT in. Built float32 (model.dtype=float32) that is real mixed
#   precision; built bfloat16, nothing is float32 (hence train() refuses bf16-mixed unless
#   model.dtype=float32).
# - bf16-true: no autocast; Lightning converts the module to bfloat16 whatever its build dtype, so
#   parameters, gradients and AdamW's exp_avg/exp_avg_sq are bfloat16.
@pytest.mark.parametrize("precision,build,param,output,autocast", [
    ("32-true", F32, F32, F32, False),
    ("bf16-mixed", F32, F32, BF16, BF16),
    ("bf16-true", F32, BF16, BF16, False),
    ("bf16-true", BF16, BF16, BF16, False),
    ("bf16-mixed", BF16, BF16, BF16, BF16),
])
def test_precision_dtypes_of_parameters_gradients_and_optimizer(precision, build, param, output,
                                                                 autocast):
    tok = tiny_tokenizer()
    arch = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                head_dim=16, intermediate_size=64, vocab_size=len(tok))
    module = CRMModule(partial(build_crm, ModelConfig(arch=arch, attention="sdpa",
                                                   dtype=str(build).removeprefix("torch.")),
                               LossConfig("pairwise"), num_labels=2, pad_token_id=tok.pad_token_id),
                       OptimConfig(warmup_steps=0))
    probe = DtypeProbe()
    trainer = L.Trainer(accelerator="cpu", devices=1, precision=precision, max_steps=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[probe])
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(synthetic_batches(tok),
                                                                      batch_size=None))
    assert trainer.global_step == 2
    assert probe.seen == {"param": {param}, "output": output, "autocast": autocast, "logits": F32,
                          "grad": {param}, "exp_avg": {param}, "exp_avg_sq": {param}}


@pytest.mark.parametrize("precision,dtype", [("bf16-mixed", F32), ("bf16-true", BF16)])
def test_train_bf16_modes_checkpoint_the_dtypes_they_promise(precision, dtype, demo_root,
                                                              tmp_path):
    run_dir = tmp_path / "run"
    metrics = run_train(demo_root, run_dir, f"trainer.precision={precision}", "val_every_n_steps=2")
    assert math.isfinite(metrics["train"]["best_val_loss"])
    ckpt = last_ckpt(run_dir)
    assert {t.dtype for t in ckpt["state_dict"].values() if t.is_floating_point()} == {dtype}
    state = ckpt["optimizer_states"][0]["state"].values()
    assert {s["exp_avg"].dtype for s in state} == {s["exp_avg_sq"].dtype for s in state} == {dtype}


def test_bf16_mixed_refuses_a_bf16_built_model(demo_root, tmp_path):
    with pytest.raises(ValueError, match="keeps float32 master weights"):
        run_train(demo_root, tmp_path / "run", "trainer.precision=bf16-mixed",
                  "model.dtype=bfloat16")


# -- 6. global batch and accumulation -------------------------------------------------------------

def test_global_batch_is_accumulated_micro_batches(demo_root, tmp_path):
    run_dir = tmp_path / "run"
    metrics = run_train(demo_root, run_dir, "global_batch_size=8", "micro_batch_size=4",
                        "trainer.max_steps=3", "save_every_n_steps=3")
    assert metrics["train"]["accumulation"] == 2
    assert metrics["train"]["global_step"] == 3  # optimizer steps, not micro batches
    ckpt = last_ckpt(run_dir)
    assert optimizer_steps(ckpt) == {3}
    assert stream_state(ckpt)["batches_done"] == 6  # 3 steps x 2 micro batches of 4


def test_global_batch_not_divisible_by_micro_batch_is_refused(demo_root, tmp_path):
    with pytest.raises(ConfigError, match="global_batch_size=10 is not a multiple of "
                                          "micro_batch_size=4 x 1 ranks"):
        run_train(demo_root, tmp_path / "run", "global_batch_size=10", "micro_batch_size=4")


@pytest.mark.parametrize("overrides, message", [
    (["data=shards", "data.path=/nonexistent"], "data.path=/nonexistent: no manifest.json there"),
    (["data=demo", "model.path=/nonexistent"], "model.path=/nonexistent: no such directory"),
    (["data=demo", "stream.packing=yes"], "stream.packing='yes': expected auto, true or false"),
    # torch's AdamW would refuse these inside fit, after the tokenizer is trained, as a traceback
    (["data=demo", "optim.lr=-1"], r"optim.lr=-1.0: expected > 0"),
    (["data=demo", "optim.betas=[0.9,1.5]"], r"optim.betas=\[0.9, 1.5\]: expected each in \[0, 1\)"),
    (["data=demo", "optim.min_lr_ratio=2"], r"optim.min_lr_ratio=2.0: expected in \[0, 1\]"),
])
def test_configuration_errors_name_the_setting(demo_root, tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        run_train(demo_root, tmp_path / "run", *overrides, demo=overrides[0] == "data=demo")


def test_a_configuration_error_is_one_line_without_a_traceback(tmp_path):
    # The command's wrapper (crm/cli/errors.py: one_line_config_errors), once, in a process of its own.
    env = {**os.environ, "CRM_ROOT": str(tmp_path)}
    done = subprocess.run([str(Path(sys.executable).parent / "crm-train"), "global_batch_size=10",
                           "micro_batch_size=4"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("crm-train: ") and "global_batch_size=10 is not a multiple" in last
    assert "Traceback" not in done.stderr and "HYDRA_FULL_ERROR" not in done.stderr


# -- 7. early stopping and validation -------------------------------------------------------------

def test_early_stopping_stops_when_val_loss_rises(demo_root, tmp_path, monkeypatch):
    # A stubbed validation whose loss rises with every step: 1.0 at step 1, then 2.0 at step 2,
    # which with patience 1 stops the run (a real diverging run would be slow and flaky).
    def on_validation_epoch_end(self):  # where val/* is logged, once the ranks' sums are reduced
        self.log("val/loss", float(self.global_step), on_epoch=True)

    monkeypatch.setattr(CRMModule, "on_validation_epoch_end", on_validation_epoch_end)
    metrics = run_train(demo_root, tmp_path / "run", "early_stopping_patience=1",
                        "val_every_n_steps=1", "trainer.max_steps=20")
    assert metrics["train"]["global_step"] == 2
    assert metrics["train"]["best_val_loss"] == 1.0


def test_every_validation_reads_the_whole_val_split(demo_root, tmp_path, monkeypatch):
    # The sanity check stops the val loader after two batches; later validations must still start
    # from the first batch (a stateful loader would resume mid-split, or yield nothing).
    passes: dict[int, list] = {}
    original = CRMModule.validation_step

    def validation_step(self, batch, batch_idx):
        step = -1 if self.trainer.sanity_checking else self.global_step
        passes.setdefault(step, []).append(tuple(batch["position"].tolist()))
        return original(self, batch, batch_idx)

    monkeypatch.setattr(CRMModule, "validation_step", validation_step)
    run_train(demo_root, tmp_path / "run", "val_every_n_steps=1", "trainer.num_sanity_val_steps=2")
    assert set(passes) == {-1, 1, 2}
    full = passes[1]
    assert len(full) > 2  # more val batches than the sanity check reads
    assert passes[-1] == full[:2]
    assert passes[2] == full == [(0, j) for j in range(len(full))]


def test_a_model_without_path_or_vocabulary_is_a_clear_error(demo_root, tmp_path):
    with pytest.raises(ValueError, match="model=qwen3-0.6b: no model.path"):
        run_train(demo_root, tmp_path / "run", "model=qwen3-0.6b", "model.dtype=float32",
                  tiny=False)
