"""Pretrained weights (model.path): read into an allocated model, whole or FSDP-sharded.

The checkpoints are tiny random Qwen3s written with save_pretrained: a sequence classifier, a
causal LM (a base model: no classification head, an lm_head that is not read), one with a head of
another size, one in bfloat16, one in several safetensors files. The sharded load runs at world 2
in 2 processes started as torchrun starts them (tests/dist/load_sharded.py) and is compared with
plain transformers in this process.
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch
from helpers import assert_ranks_ok, run_ranks
from safetensors.torch import load_file, save_file
from transformers import (AutoModelForSequenceClassification, Qwen3Config, Qwen3ForCausalLM,
                          Qwen3ForSequenceClassification)

from crm.data.stream import pad_rows
from crm.models.factory import LossConfig, ModelConfig, build_crm

PAD = 0
# An odd vocabulary and 3 kv heads: dimensions that do not split evenly over 2 ranks.
TINY = dict(vocab_size=301, hidden_size=48, num_hidden_layers=2, num_attention_heads=3,
            num_key_value_heads=3, head_dim=16, intermediate_size=80, max_position_embeddings=128,
            pad_token_id=PAD)
SHARDED = Path(__file__).parents[1] / "dist" / "load_sharded.py"
ATOL = 1e-5  # float32


def save(model, path: Path, **kwargs) -> Path:
    model.save_pretrained(path, **kwargs)
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    torch.manual_seed(1)
    classifier = Qwen3ForSequenceClassification(Qwen3Config(**TINY, num_labels=2))
    return {
        "classifier": save(classifier, root / "classifier"),
        "several_files": save(classifier, root / "several_files", max_shard_size="40KB"),
        "causal_lm": save(Qwen3ForCausalLM(Qwen3Config(**TINY)), root / "causal_lm"),
        "three_labels": save(Qwen3ForSequenceClassification(Qwen3Config(**TINY, num_labels=3)),
                             root / "three_labels"),
        "bf16": save(Qwen3ForSequenceClassification(Qwen3Config(**TINY, num_labels=2)).to(
            torch.bfloat16), root / "bf16"),
    }


def batch() -> dict:
    """Right-padded rows of different lengths (no pad id inside a row)."""
    rows = [[(7 * i + 3 * j) % 300 + 1 for j in range(n)] for i, n in enumerate([9, 4, 13])]
    return pad_rows(rows, PAD)


def plain(path: Path, **kwargs):
    return AutoModelForSequenceClassification.from_pretrained(path, local_files_only=True,
                                                              **kwargs).eval()


def plain_logits(model) -> torch.Tensor:
    b = batch()
    with torch.no_grad():
        return model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits


def loaded(path: Path, seed: int = 0):
    torch.manual_seed(seed)
    return build_crm(ModelConfig(path=str(path), attention="sdpa"), LossConfig("pairwise"),
                     num_labels=2, pad_token_id=None).eval()


def crm_logits(crm) -> torch.Tensor:
    b = batch()
    with torch.no_grad():
        return crm(b["input_ids"], b["attention_mask"])


# -- one process ----------------------------------------------------------------------------------

def test_a_classifier_checkpoint_loads_as_plain_transformers_loads_it(checkpoints):
    crm, reference = loaded(checkpoints["classifier"]), plain(checkpoints["classifier"])
    torch.testing.assert_close(crm_logits(crm), plain_logits(reference), atol=ATOL, rtol=0)
    # Built on the meta device, then allocated: RoPE's buffers are computed again, not garbage.
    for name, buffer in reference.named_buffers():
        torch.testing.assert_close(dict(crm.model.named_buffers())[name], buffer, atol=0, rtol=0)


def test_a_bfloat16_checkpoint_loads_into_float32_parameters(checkpoints):
    crm = loaded(checkpoints["bf16"])
    reference = plain(checkpoints["bf16"], dtype=torch.float32)
    assert all(p.dtype == torch.float32 for p in crm.parameters())
    torch.testing.assert_close(crm_logits(crm), plain_logits(reference), atol=ATOL, rtol=0)


def test_a_base_checkpoint_gets_a_fresh_head_and_its_lm_head_is_not_read(checkpoints, caplog):
    path = checkpoints["causal_lm"]
    with caplog.at_level(logging.INFO, logger="crm.models.backbone"):
        crm = loaded(path)
    assert "no classification head" in caplog.text and "lm_head.weight" in caplog.text
    backbone = Qwen3ForCausalLM.from_pretrained(path, local_files_only=True).model.state_dict()
    for name, tensor in backbone.items():
        torch.testing.assert_close(crm.model.model.state_dict()[name], tensor, atol=0, rtol=0)
    head = crm.model.score.weight
    assert head.shape == (2, TINY["hidden_size"])
    # transformers' initialisation of a missing Linear: normal with std initializer_range (0.02);
    # 96 draws put the sample std within 0.02 +- 0.0045 at 3 standard errors.
    assert abs(head.std().item() - crm.model.config.initializer_range) < 0.0045
    torch.testing.assert_close(loaded(path).model.score.weight, head, atol=0, rtol=0)  # seeded
    assert not torch.equal(loaded(path, seed=1).model.score.weight, head)


def test_a_head_of_another_size_starts_fresh_with_a_warning(checkpoints, caplog):
    path = checkpoints["three_labels"]
    with caplog.at_level(logging.WARNING, logger="crm.models.backbone"):
        crm = loaded(path)
    assert "score.weight has 3 label(s), this model 2: the head starts fresh" in caplog.text
    assert crm.model.score.weight.shape == (2, TINY["hidden_size"])
    stored = load_file(path / "model.safetensors")
    torch.testing.assert_close(crm.model.model.embed_tokens.weight,
                               stored["model.embed_tokens.weight"], atol=0, rtol=0)
    pointwise = build_crm(ModelConfig(path=str(path), attention="sdpa"), LossConfig("pointwise"),
                          num_labels=1, pad_token_id=None)
    assert pointwise.model.score.weight.shape == (1, TINY["hidden_size"])


def test_a_backbone_of_another_size_is_an_error_naming_the_weights(checkpoints, tmp_path):
    other = save(Qwen3ForSequenceClassification(Qwen3Config(**{**TINY, "intermediate_size": 96})),
                 tmp_path / "other")
    (other / "config.json").write_text((checkpoints["classifier"] / "config.json").read_text())
    with pytest.raises(ValueError, match=r"not this model's backbone: 0 weights missing .*"
                                         r"6 of another shape .*mlp"):
        loaded(other)


def test_a_checkpoint_without_safetensors_is_an_error(checkpoints, tmp_path):
    (tmp_path / "config.json").write_text((checkpoints["classifier"] / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        loaded(tmp_path)


def test_on_the_meta_device_nothing_is_read(checkpoints):
    path = str(checkpoints["classifier"])
    crm = build_crm(ModelConfig(path=path, attention="sdpa"), LossConfig("pairwise"), num_labels=2,
                    pad_token_id=None, device="meta")
    assert all(t.is_meta for t in [*crm.parameters(), *crm.buffers()])
    assert crm.model.name_or_path == path  # what build_sharded loads


# -- FSDP2 at world 2 -----------------------------------------------------------------------------

@pytest.mark.both_cores
def test_sharded_load_at_world_2_gives_the_logits_of_a_plain_load(checkpoints, tmp_path):
    save_file(batch(), tmp_path / "batch.safetensors")
    names = ["classifier", "several_files", "causal_lm", "bf16"]
    cmd = [sys.executable, str(SHARDED), str(tmp_path / "batch.safetensors"), str(tmp_path),
           *(str(checkpoints[name]) for name in names)]
    env = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PATH": "/usr/bin:/bin"}
    assert_ranks_ok(run_ranks(cmd, env, tmp_path / "logs"))  # as torchrun starts 2 workers
    out = {name: load_file(tmp_path / f"{checkpoints[name].name}.safetensors") for name in names}

    reference = plain(checkpoints["classifier"])
    torch.testing.assert_close(out["classifier"]["logits"], plain_logits(reference), atol=ATOL,
                               rtol=0)
    torch.testing.assert_close(out["classifier"]["inv_freq"], reference.model.rotary_emb.inv_freq,
                               atol=0, rtol=0)
    assert len(list(checkpoints["several_files"].glob("*.safetensors"))) > 1
    torch.testing.assert_close(out["several_files"]["logits"], plain_logits(reference), atol=ATOL,
                               rtol=0)
    torch.testing.assert_close(out["bf16"]["logits"],
                               plain_logits(plain(checkpoints["bf16"], dtype=torch.float32)),
                               atol=ATOL, rtol=0)
    # No head in the checkpoint: every rank drew the one a single process draws from the seed, and
    # the backbone is plain transformers' load of the causal LM.
    head = out["causal_lm"]["head"]
    torch.testing.assert_close(head, loaded(checkpoints["causal_lm"]).model.score.weight, atol=0,
                               rtol=0)
    base = plain(checkpoints["causal_lm"], num_labels=2, pad_token_id=PAD)
    with torch.no_grad():
        base.score.weight.copy_(head)
    torch.testing.assert_close(out["causal_lm"]["logits"], plain_logits(base), atol=ATOL, rtol=0)
