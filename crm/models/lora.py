"""LoRA on a CRM: peft's adapters injected into the decoder's linear layers, the head trained in
full, the frozen base kept in `base_dtype`; and the merge that turns a LoRA checkpoint back into a
plain Qwen3ForSequenceClassification (docs/CHECKPOINTING.md section 7).

The adapters are injected in place (`peft.inject_adapter_in_model`), not wrapped in a PeftModel:
the CRM keeps `model.model.layers`, `model.score` and `model.config`, so sharding, activation
checkpointing, compilation, the head and the card see the model they always see. A targeted
linear `X` becomes `X.base_layer` (the frozen weight) + `X.lora_A.default` / `X.lora_B.default`.
"""
from __future__ import annotations

import hashlib
import math
from pathlib import Path

import torch
from torch import nn

from crm.models.backbone import DTYPES
from crm.models.config import LoraConfig

ADAPTER = "default"  # peft's adapter name; it appears in the parameter names
BASE_LAYER = ".base_layer"  # peft's name of the wrapped (frozen) linear


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def is_trained(name: str) -> bool:
    """Adapters and the head (`score.*`, trained in full: a fresh head has no base to adapt)."""
    return is_adapter(name) or name.startswith("score.") or ".score." in name


def base_name(name: str) -> str:
    """The plain model's name of a LoRA model's base weight (`q_proj.base_layer.weight` ->
    `q_proj.weight`); other names are unchanged."""
    return name.replace(BASE_LAYER + ".", ".")


def check_targets(model: nn.Module, cfg: LoraConfig) -> None:
    """One line naming target modules the model has no linear layer of (peft's own error is a
    paragraph, and comes after the model is built)."""
    linears = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    missing = sorted(set(cfg.target_modules) - linears)
    if missing:
        raise ValueError(f"lora.target_modules: {', '.join(missing)} not a linear layer of this model "
                         f"(it has {', '.join(sorted(linears))})")


def add_adapters(model: nn.Module, cfg: LoraConfig, init: bool = True) -> nn.Module:
    """Injects LoRA adapters into `model` (a Qwen3ForSequenceClassification) in place; only
    adapters and head train, the rest is cast to `cfg.base_dtype`. `init`: draw the adapters now
    (init_adapters); a meta-device model draws them once its shards exist."""
    import peft

    check_targets(model, cfg)
    peft.inject_adapter_in_model(peft_config(cfg), model, adapter_name=ADAPTER)
    base_dtype = DTYPES[cfg.base_dtype]
    for name, p in model.named_parameters():
        p.requires_grad_(is_trained(name))
        if not p.requires_grad and p.is_floating_point():
            # Before sharding, so FSDP2 shards (and gathers) the base in this dtype: FSDP2 needs
            # one dtype among a unit's *trainable* parameters only (the adapters' and head's).
            p.data = p.data.to(base_dtype)
    if init:
        init_adapters(model)
    return model


def init_adapters(model: nn.Module) -> None:
    """peft's default init (A kaiming-uniform, B zero: the adapted model starts as the base),
    drawn from a generator seeded with torch's seed, whole on every rank, each rank keeping its
    slice: one process, DDP and FSDP (meta-device build included) start from the same adapters."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    generator = torch.Generator().manual_seed(torch.initial_seed())
    for name, p in model.named_parameters():
        if not is_adapter(name):
            continue
        fresh = torch.zeros(p.shape, dtype=torch.float32)
        if ".lora_A." in name:
            nn.init.kaiming_uniform_(fresh, a=math.sqrt(5), generator=generator)
        fresh = fresh.to(device=p.device, dtype=p.dtype)
        if isinstance(p, DTensor):  # every rank drew the same tensor: no communication
            fresh = distribute_tensor(fresh, p.device_mesh, p.placements, src_data_rank=None)
        with torch.no_grad():
            p.copy_(fresh)


def trainable_counts(model: nn.Module) -> dict:
    """Trained and total parameters (a DTensor counts whole)."""
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return {"trainable": trained, "total": total}


# -- the base's identity -------------------------------------------------------------------------

FINGERPRINT_SAMPLES = 64  # blocks read per safetensors file
FINGERPRINT_BLOCK = 1 << 16


def fingerprint(path: str | Path) -> str:
    """A short hash of the HF checkpoint at `path`: each safetensors file's name, size, header
    (every tensor's name, dtype, shape, offsets) and 64 evenly spaced 64 KiB blocks of its data.

    Reads ~4 MiB a file, not the whole checkpoint (16 GB for Qwen3-8B, read by every rank at
    every start otherwise). Another model, another fine-tune or another dtype changes it; a
    single edited weight may not (docs/CHECKPOINTING.md section 7).
    """
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors weights to fingerprint")
    digest = hashlib.blake2b(digest_size=16)
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        with open(file, "rb") as f:
            header = int.from_bytes(f.read(8), "little")
            digest.update(f.read(header))
            data = size - 8 - header
            for i in range(FINGERPRINT_SAMPLES):
                f.seek(8 + header + data * i // FINGERPRINT_SAMPLES)
                digest.update(f.read(FINGERPRINT_BLOCK))
    return digest.hexdigest()


def base_record(cfg: LoraConfig, base: str | None) -> dict:
    """What a LoRA checkpoint says of itself (`crm_lora`): its adapters' settings, and the base
    it needs: a checkpoint dir and its fingerprint, or None when the base was built from an
    architecture (random init: the checkpoint then holds the base weights too)."""
    from dataclasses import asdict

    return {"config": asdict(cfg), "base": str(Path(base).resolve()) if base else None,
            "fingerprint": fingerprint(base) if base else None}


def check_base(record: dict, base: str | Path | None = None) -> Path:
    """The base checkpoint dir of a LoRA checkpoint's `record` (or `base`, where it was moved),
    checked against the fingerprint it trained on: a ValueError of one line otherwise."""
    path = Path(base or record["base"])
    if not any(path.glob("*.safetensors")):
        raise ValueError(f"{path}: the base weights of this LoRA checkpoint are not there (it holds "
                         "the adapters and the head only); give the base model's directory")
    found = fingerprint(path)
    if found != record["fingerprint"]:
        raise ValueError(f"{path}: not the base this LoRA checkpoint trained on (fingerprint "
                         f"{found}, trained on {record['fingerprint']} at {record['base']})")
    return path


# -- merge ---------------------------------------------------------------------------------------

def merged_weights(weights: dict[str, torch.Tensor], record: dict,
                   base: str | Path | None = None) -> dict[str, torch.Tensor]:
    """A LoRA model's weights (`weights`, HF names, adapters included) as a plain classifier's:
    the base from the checkpoint itself (a random-init base) or from its base dir (checked
    against its fingerprint), each adapted weight W + alpha/r * B @ A in float32 (peft's merge:
    tests/models/test_lora.py compares), the head as trained."""
    from safetensors import safe_open

    cfg = LoraConfig(**record["config"])
    plain = {base_name(k): v for k, v in weights.items() if not is_adapter(k)}
    if record["base"] is not None:
        path = check_base(record, base)
        base_dtype = DTYPES[cfg.base_dtype]
        for file in sorted(path.glob("*.safetensors")):
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    if name.startswith("model.") and name not in plain:
                        # as training saw it: rounded to the base dtype
                        plain[name] = f.get_tensor(name).to(base_dtype)
    merged = {}
    for name, tensor in plain.items():
        tensor = tensor.float()
        if name.endswith(".weight"):
            module = name[:-len(".weight")]
            a = weights.get(f"{module}.lora_A.{ADAPTER}.weight")
            if a is not None:
                b = weights[f"{module}.lora_B.{ADAPTER}.weight"]
                tensor = tensor + cfg.scaling * (b.float() @ a.float())
        merged[name] = tensor
    return merged


# -- the adapter form of an export ---------------------------------------------------------------

def peft_config(cfg: LoraConfig, **export):
    """peft's config of these adapters. `export`: what an adapter export adds (the head as a
    module to save, the base's path), so PeftModel can load them onto a base classifier."""
    import peft

    return peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                           target_modules=list(cfg.target_modules), bias="none", **export)


def save_adapters(config, weights: dict[str, torch.Tensor], record: dict, out_dir: Path) -> None:
    """`weights` (a LoRA checkpoint's: adapters, head) as peft's adapter directory
    (adapter_config.json, adapter_model.safetensors), written by peft itself from a PeftModel
    built on the meta device: the base is never read or allocated."""
    import peft
    from transformers import AutoModelForSequenceClassification

    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(config)
    model.name_or_path = record["base"]  # peft writes it as the adapters' base_model_name_or_path
    adapters = peft_config(LoraConfig(**record["config"]), modules_to_save=["score"],
                           base_model_name_or_path=record["base"])
    model = peft.get_peft_model(model, adapters, adapter_name=ADAPTER)
    trained = {name: tensor for name, tensor in weights.items() if is_trained(name)}
    # The checkpoint's names are the classifier's; PeftModel's put the base under
    # base_model.model and the head's trained copy under score.modules_to_save.<adapter>.
    state = {f"base_model.model.{name}": tensor for name, tensor in trained.items() if is_adapter(name)}
    state |= {f"base_model.model.score.modules_to_save.{ADAPTER}.{name.split('.', 1)[1]}": tensor
              for name, tensor in trained.items() if name.startswith("score.")}
    missing = set(state) - set(model.state_dict())
    if missing:
        raise ValueError(f"adapter export: {sorted(missing)[:3]} not in peft's model")
    model.load_state_dict(state, strict=False, assign=True)
    model.save_pretrained(out_dir)


def load_adapters(export_dir: Path, record: dict, dtype: torch.dtype, attention: str):
    """The plain classifier of an adapter export: its base (checked against the fingerprint)
    rounded to the base dtype as in training, the adapters merged in float32 by peft, then
    `dtype`."""
    import peft
    from transformers import AutoConfig, AutoModelForSequenceClassification

    base = check_base(record)
    config = AutoConfig.from_pretrained(export_dir, local_files_only=True)
    model = AutoModelForSequenceClassification.from_pretrained(
        base, config=config, dtype=DTYPES[record["config"]["base_dtype"]],
        attn_implementation=attention, local_files_only=True).float()
    model = peft.PeftModel.from_pretrained(model, export_dir, adapter_name=ADAPTER)
    return model.merge_and_unload().to(dtype)
