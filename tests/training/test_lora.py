"""LoRA (lora.rank > 0, crm/models/lora.py) on a tiny pretrained base written to disk.

One process (train(cfg) in this process): only adapters and head train and only they are saved,
and a single-file checkpoint resumes to the uninterrupted curve;
the merged export scores as the LoRA model does and plain transformers loads it with its labels;
the adapter export (peft's form) scores the same through CRMScorer and CRMReward; a changed base
and bad settings are refused in one line. Two FSDP2 processes (crm-train subprocesses: the
uninterrupted run's rank 0 starts rank 1 through Lightning's launcher, the suite's one crm-train run
that does; the resumed run's ranks start at once): the meta-device sharded load, frozen bf16 base
and fp32 adapters in one sharded unit, a sharded LoRA checkpoint that resumes to the uninterrupted
curve, and its merged export.
"""
from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import TINY_DEMO, assert_ranks_ok, free_port, run_as_job, run_ranks, save_tiny_base
from hydra import compose, initialize_config_module

from crm.cli.train import train
from crm.core.errors import ConfigError
from crm.models.checkpoint import LORA, export_checkpoint, load_checkpoint, model_weights
from crm.models.factory import LossConfig, ModelConfig, build_crm
from crm.models.lora import LoraConfig, base_name, fingerprint, is_adapter, is_trained

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

RANK = 4
RUN = [*TINY_DEMO, "loss=cls", "transform.ties=drop", f"lora.rank={RANK}", "micro_batch_size=4",
       "global_batch_size=8",
       "torch_threads=1", "stream.num_workers=0",
       "trainer.enable_progress_bar=false", "trainer.log_every_n_steps=1",
       "early_stopping_patience=0", "optim.lr=3e-3",
       # A constant learning rate: a run resumed with a larger max_steps retraces an uninterrupted one.
       "optim.warmup_steps=0", "optim.min_lr_ratio=1.0"]
CURVE = ["trainer.max_steps=6", "val_every_n_steps=3", "save_every_n_steps=3"]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return save_tiny_base(tmp_path_factory.mktemp("lora") / "base")


def run_train(root: Path, run_dir: Path, *overrides: str) -> dict:
    with initialize_config_module(version_base="1.3", config_module="crm_configs"):
        cfg = compose("train", overrides=[*RUN, f"paths.root_dir={root}",
                                          f"paths.output_dir={run_dir}", *overrides],
                      return_hydra_config=True)
    return run_as_job(cfg, train)


def train_losses(run_dir: Path) -> dict[int, float]:
    with open(run_dir / "csv" / "metrics.csv", newline="") as f:
        return {int(r["step"]) + 1: float(r["train/loss"]) for r in csv.DictReader(f)
                if r.get("train/loss")}


@pytest.fixture(scope="module")
def one_process(demo_root, base, tmp_path_factory) -> Path:
    """A 6-step LoRA run on the base: best.ckpt, last.ckpt, its merged export, its evaluation."""
    run_dir = tmp_path_factory.mktemp("lora_run") / "run"
    run_train(demo_root, run_dir, f"model.path={base}", *CURVE)
    return run_dir


def logits(model, tokenizer) -> torch.Tensor:
    texts = ["Criteria: concise. Query: boil an egg? A: nine minutes. B: no idea.", "short"]
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        return model.eval()(**batch).logits


def test_only_adapters_and_head_train_and_are_saved(one_process, base):
    metrics = json.loads((one_process / "metrics.json").read_text())
    losses = train_losses(one_process)
    print("train/loss by step", losses)
    # It learns: the loss falls within the first steps (later ones swing with the 8-record
    # batches) and the validation loss is below chance.
    assert min(losses[k] for k in (2, 3, 4)) < losses[1] - 0.1
    assert metrics["train"]["best_val_loss"] < math.log(2) - 0.02
    assert metrics["eval"]  # crm-train's evaluation scored the merged export
    ckpt = load_checkpoint(one_process / "checkpoints" / "last.ckpt")
    weights = model_weights(ckpt)
    assert weights and all(is_trained(name) for name in weights)  # no base weight stored
    record = ckpt[LORA]
    assert record["fingerprint"] == fingerprint(base) and record["base"] == str(base.resolve())
    assert sum(t.numel() for t in weights.values()) == record["trainable_parameters"]
    assert metrics["train"]["lora_trainable_parameters"] == record["trainable_parameters"]
    assert {n.rsplit(".", 3)[0].rsplit(".", 1)[-1] for n in weights if is_adapter(n)} == set(
        LoraConfig().target_modules)
    (optimizer,) = ckpt["optimizer_states"]
    assert len(optimizer["state"]) == len(weights)  # AdamW states for the trained tensors only
    print("LoRA rank", RANK, "trainable", record["trainable_parameters"], "checkpoint bytes",
          (one_process / "checkpoints" / "last.ckpt").stat().st_size)


def test_a_single_file_lora_checkpoint_resumes_to_the_same_curve(one_process, demo_root, base,
                                                                  tmp_path):
    run_dir = tmp_path / "run"
    curve = [f"model.path={base}", "val_every_n_steps=3", "save_every_n_steps=3", "export=false",
             "evaluate=false"]
    run_train(demo_root, run_dir, *curve, "trainer.max_steps=3")
    resumed = run_train(demo_root, run_dir, *curve, "trainer.max_steps=6")
    assert resumed["train"]["resumed_from"] == str(run_dir / "checkpoints" / "last.ckpt")
    straight, again = train_losses(one_process), train_losses(run_dir)
    assert sorted(again) == list(range(1, 7))
    for step in range(1, 7):
        assert abs(straight[step] - again[step]) <= 1e-6, (step, straight, again)


def test_merged_export_scores_as_the_lora_model_and_loads_in_plain_transformers(one_process, base):
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    export = one_process / "export"
    plain = AutoModelForSequenceClassification.from_pretrained(export, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(export, local_files_only=True)
    assert plain.config.num_labels == 2 and plain.config.id2label == {0: "model_a", 1: "model_b"}
    meta = json.loads((export / "crm.json").read_text())
    assert meta["lora"]["form"] == "merged"
    # The LoRA model itself (adapters unmerged) on the base, in float32: the same scores.
    checkpoint = load_checkpoint(meta["source"])
    lora = build_crm(ModelConfig(path=str(base)), LossConfig(), num_labels=2, pad_token_id=None,
                     lora=LoraConfig(rank=RANK)).model
    lora.load_state_dict(model_weights(checkpoint), strict=False)
    torch.testing.assert_close(logits(plain, tokenizer), logits(lora.float(), tokenizer),
                               atol=1e-5, rtol=0)
    # Only adapters and head changed: every weight LoRA did not adapt is the base's (in the
    # base dtype it trained in).
    exported, stored = load_file(export / "model.safetensors"), load_file(base / "model.safetensors")
    adapted = {base_name(n).replace(".lora_A.default", "") for n in model_weights(checkpoint)
               if ".lora_A." in n}
    for name, tensor in exported.items():
        if name not in adapted and name != "score.weight":
            assert torch.equal(tensor, stored[name].bfloat16().float()), name


def test_adapter_export_reloads_through_peft_scorer_and_reward(one_process, tmp_path):
    from crm.inference.reward import CRMReward
    from crm.inference.scorer import CRMScorer

    best = one_process / "checkpoints" / "best.ckpt"
    adapters = export_checkpoint(best, tmp_path / "adapters", adapters=True)
    assert (adapters / "adapter_model.safetensors").is_file()
    assert not (adapters / "model.safetensors").exists()
    merged, kept = (CRMScorer.load(d, batch_size=4) for d in (one_process / "export", adapters))
    pair = (["concise"], "boil an egg?", "nine minutes", "no idea")
    assert abs(merged.compare(*pair) - kept.compare(*pair)) <= 1e-6  # peft's merge, crm's merge
    # crm-eval's metrics (crm.evaluation.accuracy) of the adapter form: the merged export's, which
    # crm-train's own evaluation computed.
    from crm.evaluation.accuracy import evaluate_files

    evaluated = json.loads((one_process / "metrics.json").read_text())["eval"]
    again, _ = evaluate_files(kept, list(evaluated))
    for file, figures in evaluated.items():
        assert again[file]["accuracy_mean"] == figures["accuracy_mean"], file
    rewards = [CRMReward(d, "reference")(prompts=["boil an egg?"], completions=["nine minutes"],
                                         criteria=[["concise"]], reference=["no idea"])
               for d in (one_process / "export", adapters)]
    assert rewards[0] == pytest.approx(rewards[1], abs=1e-6)


def test_a_changed_or_missing_base_is_refused_in_one_line(one_process, demo_root, base, tmp_path):
    from safetensors.torch import load_file, save_file

    other = tmp_path / "other_base"
    other.mkdir()
    for f in base.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    weights = load_file(other / "model.safetensors")
    save_file({k: v * 1.01 for k, v in weights.items()}, other / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="resume: the checkpoint's LoRA adapters trained on the base"):
        run_train(demo_root, one_process, f"model.path={other}", "trainer.max_steps=7")
    last = one_process / "checkpoints" / "last.ckpt"
    with pytest.raises(ValueError, match="not the base this LoRA checkpoint trained on"):
        export_checkpoint(last, tmp_path / "out", base=other)
    with pytest.raises(ValueError, match="the base weights of this LoRA checkpoint are not there"):
        export_checkpoint(last, tmp_path / "out", base=tmp_path)


@pytest.mark.parametrize("override,message", [
    ("lora.rank=-2", "lora.rank=-2: expected 0"),
    ("lora.target_modules=[]", "lora.target_modules is empty"),
    ("lora.target_modules=[c_attn]", "c_attn not a linear layer of this model"),
])
def test_bad_lora_settings_are_one_line_at_start(demo_root, base, tmp_path, override, message):
    with pytest.raises((ConfigError, ValueError), match=message):
        run_train(demo_root, tmp_path / "run", f"model.path={base}", override)


# -- FSDP2, two processes -------------------------------------------------------------------------

def crm_train(root: Path, name: str, *overrides: str, ranks: int = 1) -> Path:
    """ranks=1: rank 0 alone, whose Lightning launcher starts rank 1; ranks=2: both started at once
    (helpers.run_ranks, as torchrun would: 8-10 s sooner on 2 cores)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "MASTER_", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE"))}
    env.update(CRM_ROOT=str(root), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONWARNINGS="ignore", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    cmd = [str(Path(sys.executable).parent / "crm-train"), f"name={name}", *RUN, "evaluate=false",
           "trainer=fsdp", "trainer.accelerator=cpu", "trainer.devices=2", "micro_batch_size=4",
           *overrides]
    if ranks > 1:
        assert_ranks_ok(run_ranks(cmd, env, root / "logs" / name, ranks))
        return root / "outputs" / name
    # Its own session: a timeout kills rank 1 (launched by Lightning) with it.
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
    assert proc.returncode == 0, out.decode(errors="replace")[-4000:]
    return root / "outputs" / name


@pytest.mark.slow
@pytest.mark.both_cores
def test_fsdp_lora_from_a_sharded_load_resumes_to_the_same_curve(demo_root, base):
    # The uninterrupted run also keeps its step-3 checkpoint, which a second run resumes from.
    keep = ["+callbacks.keep._target_=lightning.pytorch.callbacks.ModelCheckpoint",
            f"+callbacks.keep.dirpath={demo_root}/keep", "+callbacks.keep.every_n_train_steps=3",
            "+callbacks.keep.save_top_k=-1", "+callbacks.keep.filename='at-{step}'"]
    # (Lightning refuses two ModelCheckpoints of the same settings: last.ckpt is saved at 6 only.)
    straight = crm_train(demo_root, "lora_fsdp", f"model.path={base}", *CURVE, *keep,
                         "save_every_n_steps=6")
    step3 = demo_root / "keep" / "at-step=3.ckpt"
    resumed = crm_train(demo_root, "lora_fsdp_resumed", f"model.path={base}", *CURVE,
                        f"resume='{step3}'", "export=false", ranks=2)
    a, b = train_losses(straight), train_losses(resumed)
    assert sorted(a) == list(range(1, 7)) and sorted(b) == [4, 5, 6]
    for step in (4, 5, 6):
        assert abs(a[step] - b[step]) <= 1e-6, (step, a, b)
    assert a[3] < a[1]
    # The sharded checkpoint holds the trained tensors only (metadata names every saved tensor).
    import torch.distributed.checkpoint as dcp

    saved = dcp.FileSystemReader(str(step3)).read_metadata().state_dict_metadata
    weights = [k for k in saved if k.startswith("state_dict.")]
    assert weights and all(is_trained(k) for k in weights)
    # Its merged export (best.ckpt, consolidated from the shards) loads in plain transformers, and
    # every weight LoRA does not adapt is still the base's: the shards of the frozen base, gathered
    # in bf16 every step, never changed.
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification

    assert AutoModelForSequenceClassification.from_pretrained(
        straight / "export", local_files_only=True).config.num_labels == 2
    exported, stored = load_file(straight / "export" / "model.safetensors"), load_file(
        base / "model.safetensors")
    frozen = [n for n in exported if n != "score.weight"
              and n.rsplit(".", 2)[-2] not in LoraConfig().target_modules]
    assert frozen and all(torch.equal(exported[n], stored[n].bfloat16().float()) for n in frozen)
