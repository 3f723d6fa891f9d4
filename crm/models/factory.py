"""Builds a PairwiseCRM or PointwiseCRM around a Qwen3 sequence classifier, from the model and loss
config groups (configs/model/*.yaml, configs/loss/*.yaml), whose schema is crm.models.config's."""
from __future__ import annotations

import torch

from crm.models.backbone import DTYPES, build_classifier, load_pretrained
from crm.models.heads import PairwiseCRM, PointwiseCRM
from crm.models.config import LossConfig, LoraConfig, ModelConfig
from crm.models.lora import add_adapters, init_adapters

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
    return PointwiseCRM(hf, margin=loss.margin, center_coef=loss.center_coef, ties=loss.ties)
