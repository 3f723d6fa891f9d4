"""Builds a PairwiseCRM or PointwiseCRM around a Qwen3 sequence classifier, from the model and loss
config groups (configs/model/*.yaml, configs/loss/*.yaml), whose schema the two dataclasses here are."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from crm.models.backbone import DTYPES, build_classifier, load_pretrained
from crm.models.heads import PairwiseCRM, PointwiseCRM
from crm.models.lora import LoraConfig, add_adapters, init_adapters

KINDS = ("pairwise", "pointwise")


@dataclass(frozen=True)
class ModelConfig:
    name: str | None = None  # the option's name (configs/model/<name>.yaml); runs and reports show it
    path: str | None = None  # a local HF checkpoint dir: its architecture and weights replace `arch`
    tokenizer: str | None = None  # a local tokenizer dir (default: path)
    vocab_size: int | None = None  # the BPE vocabulary trained when there is no tokenizer (tiny models)
    attention: str = "auto"  # auto | sdpa | eager | flash_attention_2 (eager only; backbone.choose_attention)
    dtype: str = "float32"  # parameter dtype at build, a name in DTYPES
    arch: Any = None  # a name in backbone.ARCHITECTURES, or a dict of Qwen3Config fields

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"model.dtype={self.dtype}: expected one of {', '.join(DTYPES)}")

    def architecture(self, vocab_size: int | None = None) -> str | dict | None:
        """`arch`, a tiny model's fields with its tokenizer's vocabulary when `vocab_size` is given."""
        if isinstance(self.arch, dict) and vocab_size is not None:
            return {**self.arch, "vocab_size": vocab_size}
        return self.arch


@dataclass(frozen=True)
class LossConfig:
    kind: str = "pairwise"  # pairwise: L_cls, cross-entropy | pointwise: L_ranking, Bradley-Terry
    name: str | None = None  # the option's name (configs/loss/<name>.yaml): cls | ranking
    margin: float = 0.0  # pointwise: -logsigmoid(r_c - r_r - margin)
    center_coef: float = 0.0  # pointwise: + center_coef * (r_c + r_r)^2

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"loss.kind={self.kind}: expected one of {', '.join(KINDS)}")


def build_crm(model: ModelConfig, loss: LossConfig, *, num_labels: int, pad_token_id: int | None,
              vocab_size: int | None = None, device=None, compiled: bool = False,
              lora: LoraConfig | None = None):
    """loss.kind pairwise (num_labels 2, or 3 with ties) or pointwise (one reward); `vocab_size`
    (the tokenizer's) sizes a tiny model's embeddings.

    device="meta" builds shapes only: from a `path`, no weight is read (see build_classifier).
    `compiled`: the decoder layers will be compiled (backbone.choose_attention). `lora` with a
    rank: LoRA adapters in the decoder, only they and the head train (crm.models.lora); on the
    meta device they are drawn once the shards exist (crm.training.parallel.build_sharded).
    """
    classifier = dict(pad_token_id=pad_token_id, path=model.path,
                      arch=model.architecture(vocab_size), attention=model.attention,
                      dtype=DTYPES[model.dtype], device=device, compiled=compiled)
    labels = num_labels if loss.kind == "pairwise" else 1
    meta = torch.device(device or "cpu").type == "meta"
    if lora is None or not lora.enabled:
        hf = build_classifier(num_labels=labels, **classifier)
    elif model.path and not meta:
        # The adapters go in on the meta device, which casts the frozen base to its dtype before
        # anything is allocated: the weights are read straight into bf16, never a float32 model.
        hf = build_classifier(num_labels=labels, **{**classifier, "device": "meta"})
        add_adapters(hf, lora, init=False)
        hf.to_empty(device=device or "cpu")
        load_pretrained(hf, model.path)
        init_adapters(hf)
    else:
        hf = add_adapters(build_classifier(num_labels=labels, **classifier), lora, init=not meta)
    if loss.kind == "pairwise":
        return PairwiseCRM(hf)
    return PointwiseCRM(hf, margin=loss.margin, center_coef=loss.center_coef)
