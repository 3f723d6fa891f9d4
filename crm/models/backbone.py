"""Qwen3 backbones with a sequence-classification head: from a local checkpoint or an architecture.

The real sizes are the published Qwen3 architectures; they build on the meta device to count
parameters and plan memory without weights. `tiny` is a CPU-sized Qwen3 with the same code path,
randomly initialised. A checkpoint (HF safetensors) is loaded into an allocated model, whole or
FSDP-sharded, each rank reading only what it holds (`load_pretrained`).
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, Qwen3Config
from transformers.utils import is_flash_attn_2_available

from crm.models.config import DTYPE_NAMES, resolve_attention

log = logging.getLogger(__name__)
DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}

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


def choose_attention(requested: str = "auto", compiled: bool = False,
                     device_type: str | None = None) -> str:
    """The attention implementation for decoder layers that are `compiled` or eager, on
    `device_type`, with this machine's flash-attn (crm.models.config.resolve_attention's rule;
    ValueError where it cannot run). Logged with its reason.

    A run decides it once, for its trainer's device (crm.training.resolve), and builds its model
    with the answer. A model built with `auto` and no `device_type` takes sdpa: a build does not
    know where the model will run, and sdpa runs everywhere.
    """
    chosen, why = resolve_attention(requested, compiled, device_type, is_flash_attn_2_available())
    log.info("attention: %s (%s)", chosen, why)
    return chosen


def qwen3_config(arch: dict, *, num_labels: int, pad_token_id: int) -> Qwen3Config:
    return Qwen3Config(**arch, num_labels=num_labels, pad_token_id=pad_token_id)


def build_classifier(*, num_labels: int, pad_token_id: int | None, path: str | None = None,
                     arch: str | dict | None = None, attention: str = "auto",
                     dtype: torch.dtype = torch.float32, device: str | torch.device | None = None,
                     compiled: bool = False):
    """A Qwen3ForSequenceClassification: weights from `path`, or random init from `arch`.

    `arch` is a name in ARCHITECTURES or a dict of Qwen3Config fields (the tiny model's). On the
    meta device the model has shapes and no storage. `pad_token_id` falls back to the
    checkpoint's; the head needs one to find each row's last token in a padded batch. `compiled`:
    its decoder layers will be compiled (the attention choice depends on it).

    From `path` the model is built on the meta device from the checkpoint's config, then allocated
    on `device` and filled by `load_pretrained`: the weights are read once, into their final place.
    With device="meta" nothing is read and `model.name_or_path` keeps `path`: a caller that shards
    the model first loads each rank's shards afterwards (crm.training.parallel.build_sharded).
    """
    attention = choose_attention(attention, compiled)
    if path:
        # local_files_only: a path is a directory here, never a hub id fetched at run time.
        config = AutoConfig.from_pretrained(path, num_labels=num_labels, local_files_only=True)
        pad = pad_token_id if pad_token_id is not None else config.pad_token_id
        if pad is None:
            raise ValueError(f"{path}: no pad_token_id in its config and none given: batches of "
                             "more than one row cannot be scored")
        config.pad_token_id = pad
        with torch.device("meta"):
            model = AutoModelForSequenceClassification.from_config(config, dtype=dtype,
                                                                    attn_implementation=attention)
        if torch.device(device or "cpu").type != "meta":
            model.to_empty(device=device or "cpu")
            load_pretrained(model, path)
        return model
    if arch is None:
        raise ValueError("a backbone needs model.path (a local HF checkpoint) or model.arch")
    fields = ARCHITECTURES[arch] if isinstance(arch, str) else dict(arch)
    if pad_token_id is None:
        raise ValueError("pad_token_id is required for a model built from an architecture")
    config = qwen3_config(fields, num_labels=num_labels, pad_token_id=pad_token_id)
    with torch.device(device or "cpu"):
        model = AutoModelForSequenceClassification.from_config(config, dtype=dtype,
                                                                attn_implementation=attention)
    return model


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers of a Qwen3 sequence classifier: the unit of sharding, activation
    checkpointing and compilation."""
    return model.model.layers


HEAD = "score.weight"  # Qwen3ForSequenceClassification's head; the backbone is `model.*`


def load_pretrained(model, path: str | Path) -> None:
    """Reads the HF safetensors checkpoint at `path` into `model`'s allocated parameters, whether
    they are whole tensors or this rank's FSDP shards (DTensors).

    Each parameter is read alone: only the slice this rank holds (a DTensor's local shape and
    global offset), converted to the model's dtype as it is copied into place. The ranks of a
    sharded model read disjoint parts of the checkpoint, none holds the whole model, and no
    collective is needed. The file is opened again for each tensor: safetensors memory-maps it, and
    the pages read through the mapping count in the rank's resident memory until it is closed (the
    whole checkpoint at world 1, on top of the model); closed after each tensor, only the pages of
    one slice are ever resident through it.

    The backbone (`model.*`) must be there with this model's shapes. The head is loaded when the
    checkpoint has one of this size; a checkpoint without one (a base model, e.g. a Qwen3ForCausalLM
    save: its `lm_head` is not read) gets a fresh head, and a head of another size is replaced by a
    fresh one with a warning. Non-persistent buffers (RoPE's inv_freq), which no checkpoint holds
    and allocation leaves uninitialised, are computed again.
    """
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor

    stored: dict[str, tuple[Path, tuple[int, ...]]] = {}  # name -> (file, shape)
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            stored.update((name, (file, tuple(f.get_slice(name).get_shape()))) for name in f.keys())
    if not stored:
        raise FileNotFoundError(f"{path}: no *.safetensors weights (save the checkpoint with "
                                "safetensors: save_pretrained does by default)")
    # A LoRA model (crm.models.lora) reads its base into `X.base_layer.weight` from `X.weight`;
    # its adapters are not in any base checkpoint.
    state = {name.replace(".base_layer.", "."): tensor for name, tensor in model.state_dict().items()
             if ".lora_A." not in name and ".lora_B." not in name}
    wanted = {name: tensor for name, tensor in state.items() if name != HEAD}
    missing = [name for name in wanted if name not in stored]
    other_shape = [f"{name} {stored[name][1]} (model {tuple(tensor.shape)})"
                   for name, tensor in wanted.items()
                   if name in stored and stored[name][1] != tuple(tensor.shape)]
    if missing or other_shape:
        raise ValueError(f"{path}: not this model's backbone: {len(missing)} weights missing "
                         f"{missing[:3]}, {len(other_shape)} of another shape {other_shape[:3]} "
                         "(a Qwen3 checkpoint with `model.*` weights of this size is expected)")
    head, labels = stored.get(HEAD), model.config.num_labels
    if head is not None and head[1] == tuple(state[HEAD].shape):
        wanted[HEAD] = state[HEAD]
    else:
        if head is None:
            log.info("%s: no classification head: a fresh one of %d label(s)", path, labels)
        else:
            log.warning("%s: its head %s has %d label(s), this model %d: the head starts fresh",
                        path, HEAD, head[1][0], labels)
        init_fresh_head(model)
    unread = sorted(set(stored) - set(wanted) - {HEAD})
    if unread:
        log.info("%s: not read (not part of a sequence classifier): %s", path, ", ".join(unread))
    for name, tensor in wanted.items():
        local, offset = tensor, (0,) * tensor.dim()
        if isinstance(tensor, DTensor):
            # Where this rank's piece sits in the whole tensor, as DTensor describes it to torch's
            # distributed checkpoint (torch exports no function for a shard's offset; the one DCP
            # calls underneath is in the private torch.distributed.tensor._utils).
            # tests/models/test_pretrained.py loads at world 2 and compares with a plain load.
            (chunk,) = tensor.__create_chunk_list__()
            local, offset = tensor.to_local(), tuple(chunk.offsets)
        rows = tuple(slice(start, start + size) for start, size in zip(offset, local.shape))
        with safe_open(stored[name][0], framework="pt") as f:
            local.copy_(f.get_slice(name)[rows])
    init_non_persistent_buffers(model)


def init_fresh_head(model) -> None:
    """The head transformers initialises for a missing one (normal, std initializer_range).

    Drawn whole from the seeded generator on every rank and each rank keeps its slice: a sharded
    model gets exactly the head one process would.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    weight = model.score.weight
    fresh = torch.empty(weight.shape, dtype=weight.dtype)
    torch.nn.init.normal_(fresh, mean=0.0, std=model.config.initializer_range)
    fresh = fresh.to(weight.device)
    if isinstance(weight, DTensor):  # every rank holds the same tensor: no communication
        fresh = distribute_tensor(fresh, weight.device_mesh, weight.placements, src_data_rank=None)
    with torch.no_grad():
        weight.copy_(fresh)


def init_non_persistent_buffers(model) -> None:
    """Computes again what `to_empty` left uninitialised and no checkpoint holds: buffers outside
    the state dict (RoPE's inv_freq). transformers' own `_init_weights` knows how, per module."""
    for module in model.modules():
        buffers = {name for name, _ in module.named_buffers(recurse=False)}
        if buffers and not buffers.issubset(module.state_dict()):
            # transformers has no public per-module initialiser: `_init_weights` is the hook its
            # own `initialize_weights` applies to every module, which would also overwrite the
            # weights just loaded. tests/models/test_pretrained.py compares inv_freq and logits
            # with a plain from_pretrained, so a change of the hook fails there.
            model._init_weights(module)


def count_parameters(model: torch.nn.Module) -> dict:
    """Total and non-embedding parameters (shared tensors once), as Qwen3's model cards count."""
    seen, total, embedding = set(), 0, 0
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        if "embed_tokens" in name or "lm_head" in name:
            embedding += p.numel()
    return {"total": total, "non_embedding": total - embedding}

