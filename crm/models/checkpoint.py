"""The checkpoints crm-train writes, and the one way to read them back as a HF classifier.

Lightning writes two kinds: one file (one process, DDP), or under trainer=fsdp a directory of
shards (`.metadata`, a `.distcp` per rank, `meta.pt`). Both are read here with weights_only=True.

A checkpoint describes itself: next to the weights it carries a card (`crm_card`: kind, length
limit, prompt template, and the files of the HF config and the tokenizer), so export and scoring
need nothing else: a run dir can move, a checkpoint can be copied alone.
"""
from __future__ import annotations

import logging
import tempfile
import warnings
import zipfile
from dataclasses import asdict
from pathlib import Path
from typing import NamedTuple

import torch

from crm.core.prompts import PromptTemplate
from crm.models.heads import TIE_PARAMETER

log = logging.getLogger(__name__)
PREFIX = "crm.model."  # where the LightningModule keeps the HF model's weights
CARD = "crm_card"
CARD_VERSION = 1
SHARDED_META = "meta.pt"  # Lightning writes it last into a sharded checkpoint dir
LORA = "crm_lora"  # a LoRA run's adapters and base (crm.models.lora.base_record)
TIE_LOG_NU = "crm." + TIE_PARAMETER  # where the LightningModule keeps a Davidson CRM's tie parameter


def is_complete_checkpoint(path: str | Path) -> bool:
    """A single-file checkpoint (Lightning writes those atomically) or a finished sharded dir."""
    path = Path(path)
    return path.is_file() or (path.is_dir() and (path / SHARDED_META).is_file()
                              and (path / ".metadata").is_file())


def not_loadable(path: str | Path) -> str | None:
    """Why `path` is neither an export dir nor a checkpoint crm-train wrote, naming the path to
    give instead (a run dir or its checkpoints/ is the usual slip); None when it is one."""
    from crm.models.export import META

    path = Path(path)
    if path.is_file():
        if (path.parent / META).is_file():
            return f"a file of an export directory: give the directory, checkpoint={path.parent}"
        # torch.save writes a zip archive; anything else would fail in the unpickler, a traceback
        return None if zipfile.is_zipfile(path) else (
            "a file that is not a checkpoint crm-train wrote (a .ckpt, torch's zip archive): give "
            "the export dir crm-train writes, outputs/<name>/export, or one of its checkpoints")
    if (path / META).is_file() or is_complete_checkpoint(path):
        return None
    if not path.exists():
        return "no such export directory or checkpoint"
    run_dir = path.parent if path.name == "checkpoints" else path
    export = run_dir / "export"
    checkpoints = run_dir / "checkpoints"
    found = sorted((c for c in checkpoints.glob("*") if c.name.endswith(".ckpt")
                    and is_complete_checkpoint(c)), key=lambda c: (c.name != "last.ckpt", c.name))
    use = ([f"checkpoint={export} (the export of the best checkpoint)"] if (export / META).is_file()
           else []) + [f"checkpoint={c}" for c in found[:1]]
    if not use:
        return (f"neither an export directory ({META}) nor a checkpoint (a .ckpt file or an FSDP "
                "sharded dir): give the export dir crm-train writes, outputs/<name>/export")
    what = "a run's checkpoints dir" if path.name == "checkpoints" else "a run dir"
    return f"{what}, not a checkpoint: give {' or '.join(use)}"


def load_checkpoint(path: str | Path) -> dict:
    """A Lightning checkpoint as one dict: a single file, or a sharded (FSDP) dir consolidated.

    Tensors and plain data only (weights_only=True); a sharded dir's weights are read with torch's
    distributed checkpoint reader, without a process group, and the rest from Lightning's meta.pt.
    """
    path = Path(path)
    if path.is_file():
        if not zipfile.is_zipfile(path):  # else a traceback from torch's unpickler
            raise ValueError(f"{path}: not a checkpoint crm-train wrote (a .ckpt file is torch's zip "
                             "archive): give one of a run's checkpoints, outputs/<name>/checkpoints/")
        return torch.load(path, map_location="cpu", weights_only=True)
    if not is_complete_checkpoint(path):
        raise FileNotFoundError(f"{path}: no checkpoint file, and no complete sharded checkpoint "
                                f"dir (.metadata and {SHARDED_META})")
    checkpoint = torch.load(path / SHARDED_META, map_location="cpu", weights_only=True)
    checkpoint["state_dict"] = sharded_weights(path)
    return checkpoint


def checkpoint_config(path: str | Path) -> dict | None:
    """The run config a checkpoint was trained with (`crm_config`), without reading its weights:
    a file's tensors are memory-mapped, not loaded; a sharded dir's meta.pt holds none. None
    for a checkpoint that records no config."""
    path = Path(path)
    if path.is_dir():
        meta = torch.load(path / SHARDED_META, map_location="cpu", weights_only=True)
    else:
        meta = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    config = meta.get("crm_config") if isinstance(meta, dict) else None
    return config if isinstance(config, dict) else None


def sharded_weights(path: Path) -> dict[str, torch.Tensor]:
    """The whole `state_dict` of a sharded checkpoint dir, in one process: a tensor of each
    weight's full shape (the metadata's), which torch's distributed checkpoint loader fills from
    every rank's shards. Tensors only: DCP reads them with weights_only; nothing is unpickled."""
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(str(path))
    prefix = "state_dict."  # DCP flattens Lightning's {"state_dict": {name: tensor}} thus
    weights = {fqn[len(prefix):]: torch.empty(meta.size, dtype=meta.properties.dtype)
               for fqn, meta in reader.read_metadata().state_dict_metadata.items()
               if fqn.startswith(prefix) and isinstance(meta, dcp.TensorStorageMetadata)}
    state = {"state_dict": weights}
    with warnings.catch_warnings():  # no_dist's notice that it loads in one process, as asked
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=reader, no_dist=True)
    return state["state_dict"]


def model_weights(checkpoint: dict) -> dict:
    """The HF model's weights (names as `save_pretrained` writes them) of a loaded checkpoint."""
    state = {k[len(PREFIX):]: v for k, v in checkpoint["state_dict"].items() if k.startswith(PREFIX)}
    if not state:
        raise ValueError(f"no '{PREFIX}*' weights in the checkpoint (not written by crm-train)")
    return state


def describe(model, tokenizer, *, kind: str, template: PromptTemplate, max_tokens: int) -> dict:
    """The card of a CRM: what export and scoring need besides the weights (plain data)."""
    with tempfile.TemporaryDirectory() as tmp:
        model.config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        files = {p.name: p.read_bytes() for p in Path(tmp).iterdir() if p.is_file()}
    return {"version": CARD_VERSION, "kind": kind, "max_tokens": max_tokens,
            "template": asdict(template), "files": files}


def tie_record(log_nu) -> dict | None:
    """What crm.json and a scorer keep of a pointwise CRM's tie model: {"model": "davidson",
    "log_nu": float}; None for a CRM without one (`log_nu` None)."""
    return None if log_nu is None else {"model": "davidson", "log_nu": float(log_nu.reshape(-1)[0])}


class LoadedCRM(NamedTuple):
    model: torch.nn.Module  # a HF sequence classifier, eval mode, on CPU
    tokenizer: object
    template: PromptTemplate
    kind: str
    max_tokens: int
    ties: dict | None = None  # a pointwise CRM's tie model (`tie_record`)


def build_from_card(card: dict, weights: dict | None, dtype: torch.dtype | None = None) -> LoadedCRM:
    """The HF classifier of `card` holding `weights` (in their own dtype unless `dtype` is given);
    weights=None: on the meta device, its config and tokenizer only."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    if card.get("version") != CARD_VERSION:
        raise ValueError(f"checkpoint card version {card.get('version')!r}; this crm reads "
                         f"{CARD_VERSION}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, data in card["files"].items():
            (Path(tmp) / name).write_bytes(data)
        config = AutoConfig.from_pretrained(tmp, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(tmp, local_files_only=True)
    if weights is None:
        with torch.device("meta"):
            model = AutoModelForSequenceClassification.from_config(config)
    else:
        dtype = dtype or next(t.dtype for t in weights.values() if t.is_floating_point())
        model = AutoModelForSequenceClassification.from_config(config, dtype=dtype)
        model.load_state_dict(weights)
    return LoadedCRM(model.eval(), tokenizer, PromptTemplate(**card["template"]), card["kind"],
                     card["max_tokens"])


def load_crm(path: str | Path, dtype: torch.dtype | None = None,
             base: str | Path | None = None) -> tuple[LoadedCRM, dict]:
    """(the CRM, the checkpoint's other contents) from any checkpoint crm-train writes. A LoRA
    checkpoint's adapters are merged into its base (crm.models.lora.merged_weights), read from
    the dir it trained on or from `base` where that has moved."""
    checkpoint = load_checkpoint(path)
    if CARD not in checkpoint:
        raise ValueError(f"{path}: no {CARD} in the checkpoint (not written by crm-train, or by "
                         "a crm older than self-describing checkpoints)")
    weights = model_weights(checkpoint)
    if checkpoint.get(LORA):
        from crm.models.lora import merged_weights

        weights = merged_weights(weights, checkpoint[LORA], base)
    crm = build_from_card(checkpoint.pop(CARD), weights, dtype)
    crm = crm._replace(ties=tie_record(checkpoint["state_dict"].get(TIE_LOG_NU)))
    del checkpoint["state_dict"]
    return crm, checkpoint


def export_checkpoint(path: str | Path, out_dir: str | Path, base: str | Path | None = None,
                      adapters: bool = False) -> Path:
    """Any checkpoint crm-train writes -> a HF directory with crm.json (crm.models.export). A LoRA
    checkpoint's adapters are merged into the base (`base`: its dir, where it has moved), or with
    `adapters` kept as peft's adapter directory on the base the checkpoint names."""
    from crm.models.export import export_crm

    if not adapters:
        crm, checkpoint = load_crm(path, base=base)
        extra = {"source": str(path), "global_step": checkpoint["global_step"],
                 "config": checkpoint.get("crm_config")}
        if checkpoint.get(LORA):
            extra["lora"] = {**checkpoint[LORA], "form": "merged"}
        return export_crm(crm.model, crm.tokenizer, out_dir, kind=crm.kind, template=crm.template,
                          max_tokens=crm.max_tokens, extra=extra, ties=crm.ties)
    checkpoint = load_checkpoint(path)
    record = checkpoint.get(LORA)
    if not record:
        raise ValueError(f"{path}: not a LoRA checkpoint: it has no adapters to keep (export it "
                         "without --adapters)")
    if record["base"] is None:
        raise ValueError(f"{path}: its LoRA base was built from model.arch (random init) and has "
                         "no directory for the adapters to name: export it merged")
    from crm.models.lora import check_base

    record = {**record, "base": str(check_base(record, base))}
    ties = tie_record(checkpoint["state_dict"].get(TIE_LOG_NU))
    crm = build_from_card(checkpoint[CARD], None)
    return export_crm(crm.model, crm.tokenizer, out_dir, kind=crm.kind, template=crm.template,
                      max_tokens=crm.max_tokens,
                      adapters=(model_weights(checkpoint), record),
                      extra={"source": str(path), "global_step": checkpoint["global_step"],
                             "config": checkpoint.get("crm_config"),
                             "lora": {**record, "form": "adapter"}}, ties=ties)
