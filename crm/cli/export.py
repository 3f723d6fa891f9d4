"""crm-export CHECKPOINT OUT_DIR: any saved checkpoint (a file, or an FSDP sharded dir, consolidated)
-> a HF directory that plain transformers loads; a LoRA checkpoint's adapters merged into its base
(--base DIR where the base has moved), or kept in peft's adapter form (--adapters).

The checkpoint describes itself (crm.models.checkpoint): its card holds the tokenizer, the HF config and
the prompt template, so a checkpoint exports wherever it has been moved or copied.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from crm.cli.scorer import transformers_bars
from crm.core.files import refuse_file_as_dir, refuse_foreign, refuse_replacing


def check_out_dir(out: Path, checkpoint: str, overwrite: bool) -> None:
    """Another checkpoint's export in OUT_DIR (a pairwise CRM would silently become a pointwise
    one), or files that are no export (a folder of the user's data, model files written among
    them), are not written over without `overwrite`: a ConfigError naming --overwrite, as crm-eval
    refuses a run dir of another checkpoint. The same checkpoint re-exports in place."""
    from crm.models.export import META

    refuse_file_as_dir(out, "OUT_DIR is the folder the exported model goes in")
    if overwrite:
        return
    allow = "export into a new or empty OUT_DIR, or --overwrite to write over it"
    if out.is_dir() and any(out.iterdir()):
        refuse_foreign(out, out / META, "crm-export", allow)
    refuse_replacing(out / META, {"checkpoint": _as_file(checkpoint)},
                     lambda before: {"checkpoint": _as_file(before.get("source"))}, allow)


def _as_file(path: str | None) -> str | None:
    """A checkpoint compared as a file, not a string: named by a relative path it is the same one."""
    return str(Path(path).resolve()) if path else path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="crm-export", description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", help="a .ckpt file or a sharded checkpoint dir")
    p.add_argument("out_dir")
    p.add_argument("--adapters", action="store_true",
                   help="a LoRA checkpoint: keep peft's adapter form (adapter_model.safetensors + the "
                        "head) on its base, instead of merging the adapters into a plain model")
    p.add_argument("--base", default=None,
                   help="a LoRA checkpoint: the base model's directory, where it has moved since "
                        "training (checked against the fingerprint the checkpoint holds)")
    p.add_argument("--overwrite", action="store_true",
                   help="write into an OUT_DIR that holds another checkpoint's export, or files that "
                        "are no export (refused without it)")
    args = p.parse_args(argv)
    from crm.models.checkpoint import export_checkpoint  # torch: after --help and argparse's refusals

    transformers_bars(sys.stderr.isatty())  # its "Writing model shards" bar

    try:
        check_out_dir(Path(args.out_dir), args.checkpoint, args.overwrite)
        out = export_checkpoint(args.checkpoint, args.out_dir, base=args.base,
                                adapters=args.adapters)
    except (OSError, ValueError, KeyError) as exc:
        print(f"crm-export: {exc}", file=sys.stderr)
        return 2
    print(f"exported {args.checkpoint} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
