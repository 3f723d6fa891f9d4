"""FLOPs per token and MFU for Qwen3 classifiers, in the convention of docs/PERFORMANCE.md (torchtitan's).

    training FLOPs per token = 6 N + 12 L H d S     forward only: a third of that
    MFU = real (non-pad) tokens/s x FLOPs per token / peak FLOP/s

N is the non-embedding parameter count (crm.models.backbone.count_parameters of the model built on
the meta device: the decoder layers, the final norm and the classification head), L layers, H
attention heads, d head_dim, S the sequence length; the attention term has no causal discount.
Padding is never counted as work, so padded batches lower MFU.
"""
from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# torch and transformers are imported where a model is built or a GPU asked: the arithmetic
# needs neither, and crm-plan checks its settings (and answers --help) before they load.

log = logging.getLogger(__name__)

# Dense bf16 peak FLOP/s of one GPU (no sparsity). torchtitan uses the H100 SXM figure for the H200.
PEAK_FLOPS: dict[str, float] = {"h100": 989e12, "h200": 989e12, "a100": 312e12}


@dataclass(frozen=True)
class ModelShape:
    """The sizes the FLOPs and memory plans need, read from a (meta-device) Qwen3 classifier."""

    total_params: int  # every parameter, shared ones once (embeddings included)
    non_embedding_params: int  # N of the FLOPs formula
    layer_params: int  # one decoder layer (the unit FSDP2 shards and all-gathers)
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    num_labels: int

    @property
    def root_params(self) -> int:
        """Everything outside the decoder layers: embeddings, final norm, classification head."""
        return self.total_params - self.layers * self.layer_params

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> ModelShape:
        """From a Qwen3ForSequenceClassification (meta device is enough; no storage is read)."""
        config = model.config
        from crm.models.backbone import count_parameters

        counts = count_parameters(model)
        layer = sum(p.numel() for p in model.model.layers[0].parameters())
        return cls(total_params=counts["total"], non_embedding_params=counts["non_embedding"],
                   layer_params=layer, layers=config.num_hidden_layers, hidden=config.hidden_size,
                   heads=config.num_attention_heads, kv_heads=config.num_key_value_heads,
                   head_dim=head_dim(config), intermediate=config.intermediate_size,
                   num_labels=config.num_labels)

    @classmethod
    def from_config(cls, config) -> ModelShape:
        """From a Qwen3Config: builds the classifier on the meta device and counts it."""
        return cls.from_model(meta_classifier(config))

    @classmethod
    def from_arch(cls, arch: str | dict, *, vocab_size: int | None = None,
                  num_labels: int = 2) -> ModelShape:
        """From a name of crm.models.backbone.ARCHITECTURES or a dict of Qwen3Config fields, with
        the vocabulary of its tokenizer when given."""
        from crm.models.backbone import ARCHITECTURES, qwen3_config

        fields = dict(ARCHITECTURES[arch] if isinstance(arch, str) else arch)
        if vocab_size:
            fields["vocab_size"] = vocab_size
        return cls.from_config(qwen3_config(fields, num_labels=num_labels, pad_token_id=0))


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def meta_classifier(config) -> torch.nn.Module:
    """The sequence classifier of `config` on the meta device: shapes only, built in milliseconds.

    The attention implementation is irrelevant to the parameters; sdpa is set so that a config that
    asks for flash_attention_2 builds where flash-attn is not installed.
    """
    import torch
    from transformers import AutoModelForSequenceClassification

    config = copy.deepcopy(config)  # from_config sets its attention and dtype on the config it gets
    with torch.device("meta"):
        return AutoModelForSequenceClassification.from_config(config, attn_implementation="sdpa")


def attention_flops_per_token(shape: ModelShape, seq_len: float) -> float:
    """12 L H d S: the score and value matmuls, forward and backward, with no causal discount."""
    return 12.0 * shape.layers * shape.heads * shape.head_dim * seq_len


def flops_per_token(shape: ModelShape, seq_len: float, *, training: bool = True,
                    frozen_base: bool = False) -> float:
    """6 N + 12 L H d S for a training step (forward + backward); a third of it for a forward.
    `frozen_base` (LoRA): 4 N + 12 L H d S, the backward computing the activations' gradients
    but no weight gradient of the frozen matrices (the adapters' few FLOPs left out)."""
    train = 6.0 * shape.non_embedding_params + attention_flops_per_token(shape, seq_len)
    if not training:
        return train / 3.0
    return train - 2.0 * shape.non_embedding_params if frozen_base else train


def detect_gpu() -> str | None:
    """The PEAK_FLOPS key of this process's CUDA device, or None (CPU, or a GPU not in the table).

    PCIe and NVL H100s have lower peaks than the SXM part in the table: they count as unknown.
    """
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name().lower()
    if "pcie" in name or "nvl" in name:
        return None
    return next((key for key in PEAK_FLOPS if key in name), None)


def peak_flops(gpu: str | None = None, peak: float | None = None) -> float | None:
    """Peak FLOP/s of one device: `peak` when given, else the table's figure for `gpu`.

    gpu "auto" reads the CUDA device name; None, a CPU or an unknown GPU give None (MFU unknown).
    """
    if peak is not None:
        return float(peak)
    if gpu == "auto":
        gpu = detect_gpu()
    if gpu is None:
        return None
    key = gpu.lower()
    if key not in PEAK_FLOPS:
        log.warning("gpu=%r has no peak in crm.perf.flops.PEAK_FLOPS (%s): MFU is not reported; "
                    "configure a peak to report it", gpu, ", ".join(PEAK_FLOPS))
        return None
    return PEAK_FLOPS[key]


def mfu(tokens_per_s: float, flops_per_token: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation: achieved FLOP/s over `peak` (the peak of the devices that produced
    the tokens: per-GPU tokens/s with one GPU's peak, or global tokens/s with the sum of peaks)."""
    if not peak:
        return None
    return tokens_per_s * flops_per_token / peak


def tokens_per_s_at(mfu_target: float, flops_per_token: float, peak: float | None) -> float | None:
    """The real tokens/s that `peak` sustains at `mfu_target` (e.g. 0.4): the inverse of mfu()."""
    if not peak:
        return None
    return mfu_target * peak / flops_per_token


def model_shape(model, kind: str, vocab_size: int | None = None) -> ModelShape:
    """The shape of a model group's classifier (a crm.models.config.ModelConfig): from model.path's
    config.json, else model.arch with `vocab_size` (a trained tokenizer's) or the group's own."""
    num_labels = 1 if kind == "pointwise" else 2
    if model.path:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model.path, num_labels=num_labels, local_files_only=True)
        return ModelShape.from_config(config)
    return ModelShape.from_arch(model.architecture(vocab_size or model.vocab_size), num_labels=num_labels)
