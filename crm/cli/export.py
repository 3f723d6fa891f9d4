"""crm-export CHECKPOINT OUT_DIR: any saved checkpoint (a file, or an FSDP sharded dir, consolidated)
-> a HF directory that plain transformers loads.

The checkpoint describes itself (crm.models.checkpoint): its card holds the tokenizer, the HF config and
the prompt template, so a checkpoint exports wherever it has been moved or copied.
"""
from __future__ import annotations

import argparse
import sys

from crm.models.checkpoint import export_checkpoint


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
