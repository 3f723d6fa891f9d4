"""Qwen3 backbones with a sequence-classification head: from a local checkpoint or an architecture.

The real sizes are the published Qwen3 architectures (shared/PERF.md); they build on the meta
device to count parameters and plan memory without weights. `tiny` is a CPU-sized Qwen3 with the
same code path, randomly initialised.
"""
from __future__ import annotations

import logging
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, Qwen3Config
from transformers.utils import is_flash_attn_2_available

log = logging.getLogger(__name__)

_QWEN3_COMMON = dict(vocab_size=151936, head_dim=128, num_key_value_heads=8, rms_norm_eps=1e-6,
                     max_position_embeddings=40960, rope_parameters={"rope_type": "default",
                                                                     "rope_theta": 1000000.0})
ARCHITECTURES: dict[str, dict] = {
    "qwen3-0.6b": dict(_QWEN3_COMMON, hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                       intermediate_size=3072, tie_word_embeddings=True),
    "qwen3-1.7b": dict(_QWEN3_COMMON, hidden_size=2048, num_hidden_layers=28, num_attention_heads=16,
                       intermediate_size=6144, tie_word_embeddings=True),
    "qwen3-4b": dict(_QWEN3_COMMON, hidden_size=2560, num_hidden_layers=36, num_attention_heads=32,
                     intermediate_size=9728, tie_word_embeddings=True),
    "qwen3-8b": dict(_QWEN3_COMMON, hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                     intermediate_size=12288, tie_word_embeddings=False),
}


def choose_attention(requested: str = "auto") -> str:
    """flash_attention_2 where it is installed and a GPU is present, else sdpa; logged either way."""
    if requested == "auto":
        flash = torch.cuda.is_available() and is_flash_attn_2_available()
        chosen = "flash_attention_2" if flash else "sdpa"
        why = "flash-attn installed, CUDA present" if flash else (
            "no CUDA" if not torch.cuda.is_available() else "flash-attn not installed")
        log.info("attention: %s (%s)", chosen, why)
        return chosen
    if requested == "flash_attention_2" and not is_flash_attn_2_available():
        raise ValueError("attention=flash_attention_2 but flash-attn is not installed "
                         "(pip install '.[gpu]' on a CUDA machine), or use attention=auto")
    log.info("attention: %s (requested)", requested)
    return requested


def qwen3_config(arch: dict, *, num_labels: int, pad_token_id: int, attention: str) -> Qwen3Config:
    config = Qwen3Config(**arch, num_labels=num_labels, pad_token_id=pad_token_id)
    config._attn_implementation = attention
    return config


def build_classifier(*, num_labels: int, pad_token_id: int | None, path: str | None = None,
                     arch: str | dict | None = None, attention: str = "auto",
                     dtype: torch.dtype = torch.float32, device: str | torch.device | None = None):
    """A Qwen3ForSequenceClassification: weights from `path`, or random init from `arch`.

    `arch` is a name in ARCHITECTURES or a dict of Qwen3Config fields (the tiny model's). On the
    meta device the model has shapes and no storage. `pad_token_id` falls back to the
    checkpoint's; the head needs one to find each row's last token in a padded batch.
    """
    attention = choose_attention(attention)
    if path:
        # local_files_only: a path is a directory here, never a hub id fetched at run time.
        config = AutoConfig.from_pretrained(path, num_labels=num_labels, local_files_only=True)
        pad = pad_token_id if pad_token_id is not None else config.pad_token_id
        if pad is None:
            raise ValueError(f"{path}: no pad_token_id in its config and none given: batches of "
                             "more than one row cannot be scored")
        with torch.device(device or "cpu"):
            model = AutoModelForSequenceClassification.from_pretrained(
                path, num_labels=num_labels, pad_token_id=pad, dtype=dtype,
                attn_implementation=attention, local_files_only=True,
                ignore_mismatched_sizes=True)  # a head of another size (or none) starts fresh
        return model
    if arch is None:
        raise ValueError("a backbone needs model.path (a local HF checkpoint) or model.arch")
    fields = ARCHITECTURES[arch] if isinstance(arch, str) else dict(arch)
    if pad_token_id is None:
        raise ValueError("pad_token_id is required for a model built from an architecture")
    config = qwen3_config(fields, num_labels=num_labels, pad_token_id=pad_token_id,
                          attention=attention)
    with torch.device(device or "cpu"):
        model = AutoModelForSequenceClassification.from_config(config, dtype=dtype)
    return model


def count_parameters(model: torch.nn.Module) -> dict:
    """Total and non-embedding parameters (shared tensors once), as PERF.md counts them."""
    seen, total, embedding = set(), 0, 0
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        if "embed_tokens" in name or "lm_head" in name:
            embedding += p.numel()
    return {"total": total, "non_embedding": total - embedding}

