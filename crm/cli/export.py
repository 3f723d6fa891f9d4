"""crm-export CHECKPOINT OUT_DIR: any saved checkpoint (a file, or an FSDP sharded dir, consolidated)
-> a HF directory that plain transformers loads; a LoRA checkpoint's adapters merged into its base
(--base DIR where the base has moved), or kept in peft's adapter form (--adapters).

The checkpoint describes itself (crm.models.checkpoint): its card holds the tokenizer, the HF config and
the prompt template, so a checkpoint exports wherever it has been moved or copied.
"""
from __future__ import annotations

import argparse
import sys


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
    args = p.parse_args(argv)
    from crm.models.checkpoint import export_checkpoint  # torch: after --help and argparse's refusals

    try:
        out = export_checkpoint(args.checkpoint, args.out_dir, base=args.base,
                                adapters=args.adapters)
    except (OSError, ValueError, KeyError) as exc:
        print(f"crm-export: {exc}", file=sys.stderr)
        return 2
    print(f"exported {args.checkpoint} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
