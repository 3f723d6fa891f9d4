"""A trained CRM as a Hugging Face directory: safetensors weights, tokenizer with its chat template,
and `crm.json` (kind, label map, prompt template, length limit, format version).

Plain `AutoModelForSequenceClassification.from_pretrained(dir)` + `AutoTokenizer` load it; crm's
own loaders read `crm.json` to render prompts exactly as in training.
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch

from crm.core.files import write_json
from crm.core.prompts import PromptTemplate

FORMAT_VERSION = 1
META = "crm.json"
LABEL_NAMES = {1: ["reward"], 2: ["model_a", "model_b"], 3: ["model_a", "model_b", "tie"]}


def export_crm(model, tokenizer, out_dir: str | Path, *, kind: str, template: PromptTemplate,
               max_tokens: int, extra: dict | None = None, adapters: tuple | None = None,
               ties: dict | None = None) -> Path:
    """Write `model` (a Qwen3ForSequenceClassification) to `out_dir`. `adapters`: (weights,
    record) of a LoRA checkpoint, written in peft's adapter form (crm.models.lora.save_adapters)
    in place of the model's weights; `model` may then be a meta-device one (its config is read)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = LABEL_NAMES[model.config.num_labels]
    model.config.id2label = dict(enumerate(names))
    model.config.label2id = {n: i for i, n in enumerate(names)}
    if adapters is None:
        model.save_pretrained(out)
    else:
        from crm.models.lora import save_adapters

        model.config.save_pretrained(out)  # the classifier's: labels, pad id (load_adapters reads it)
        save_adapters(model.config, *adapters, out)
    tokenizer.save_pretrained(out)
    meta = {"format_version": FORMAT_VERSION, "kind": kind, "labels": names,
            "template": asdict(template), "max_tokens": max_tokens, **(extra or {}),
            **({"ties": ties} if ties else {})}  # a pointwise CRM's tie model (checkpoint.tie_record)
    write_json(out / META, meta)
    return out


def read_meta(export_dir: str | Path) -> dict:
    path = Path(export_dir) / META
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: not a crm export (no {META})") from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: format_version {meta.get('format_version')!r}, this crm reads "
                         f"{FORMAT_VERSION}")
    return meta


def load_export(export_dir: str | Path, dtype: torch.dtype = torch.float32, attention: str = "sdpa"):
    """(model, tokenizer, template, meta) from an export directory, offline."""
    # here, not at the top: a command that only checks its checkpoint= path needs META alone
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    meta = read_meta(export_dir)
    lora = meta.get("lora")
    if lora and lora["form"] == "adapter":  # peft's adapters and head, on the base they name
        from crm.models.lora import load_adapters

        model = load_adapters(Path(export_dir), lora, dtype, attention)
    else:
        model = AutoModelForSequenceClassification.from_pretrained(
            export_dir, dtype=dtype, attn_implementation=attention, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(export_dir, local_files_only=True)
    return model.eval(), tokenizer, PromptTemplate(**meta["template"]), meta
