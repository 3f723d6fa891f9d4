"""crm-export CHECKPOINT OUT_DIR: any saved checkpoint (a file, or an FSDP sharded dir, consolidated)
-> a HF directory that plain transformers loads.

The checkpoint says what it holds (`crm_config`, stored by the LightningModule); the tokenizer is
the run's (`<run_dir>/tokenizer` for a tiny model) or the checkpoint model's.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from omegaconf import OmegaConf

from crm.lit.callbacks import PREFIX, load_checkpoint_file
from crm.models.export import export_crm
from crm.models.factory import build_crm
from crm.prompts import PromptTemplate


def export_checkpoint(checkpoint_path: str | Path, out_dir: str | Path) -> Path:
    from transformers import AutoTokenizer

    from crm.cli.common import build_transform, crm_kwargs

    checkpoint = load_checkpoint_file(checkpoint_path)
    if not checkpoint.get("crm_config"):
        raise ValueError(f"{checkpoint_path}: no crm_config in the checkpoint (not written by crm-train)")
    cfg = OmegaConf.create(checkpoint["crm_config"])
    run_dir = Path(cfg.get("run_dir") or cfg.paths.output_dir)
    source = cfg.model.tokenizer or cfg.model.path or run_dir / "tokenizer"
    tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    crm = build_crm(cfg.loss.kind, num_labels=build_transform(cfg).num_labels,
                    **crm_kwargs(cfg.model, cfg.loss, tokenizer))
    state = {k[len(PREFIX):]: v for k, v in checkpoint["state_dict"].items() if k.startswith(PREFIX)}
    crm.model.load_state_dict(state)
    return export_crm(crm.model, tokenizer, out_dir, kind=cfg.loss.kind, template=PromptTemplate(),
                      max_tokens=cfg.stream.max_tokens,
                      extra={"source": str(checkpoint_path), "global_step": checkpoint["global_step"],
                             "config": checkpoint["crm_config"]})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="crm-export", description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", help="a .ckpt file or a sharded checkpoint dir")
    p.add_argument("out_dir")
    args = p.parse_args(argv)
    try:
        out = export_checkpoint(args.checkpoint, args.out_dir)
    except (OSError, ValueError, KeyError) as exc:
        print(f"crm-export: {exc}", file=sys.stderr)
        return 2
    print(f"exported {args.checkpoint} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
