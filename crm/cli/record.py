"""A command's record in its run dir: `.hydra/config.yaml` (the composed config),
`.hydra/hydra.yaml` (Hydra's own) and `.hydra/overrides.yaml` (the command line), as Hydra writes
them, but written by the command once it has accepted the run.

Hydra writes them before the command starts (`hydra.output_subdir`); every command's config sets
it to null, so that a refused run (another data set for a run dir's checkpoint, another checkpoint
for an evaluation's name, a setting that cannot work) leaves the record of the run already in that
dir as it was (docs/DESIGN.md section 7)."""
from __future__ import annotations

import os
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

RECORD_DIR = ".hydra"  # Hydra's own name for it: sweeps and users look there


def save_run_record(cfg: DictConfig) -> Path:
    """The record of this run (`cfg`: the task's config as Hydra composed it) in its run dir; the
    record's directory. Each file replaced whole: a reader never sees half of one."""
    hydra = HydraConfig.instance().cfg  # {"hydra": ...}, as Hydra saves it
    out = Path(hydra.hydra.runtime.output_dir) / RECORD_DIR
    out.mkdir(parents=True, exist_ok=True)
    for name, node in (("config.yaml", cfg), ("hydra.yaml", hydra),
                       ("overrides.yaml", hydra.hydra.overrides.task)):
        partial = out / f".{name}.partial"
        OmegaConf.save(node, partial)
        os.replace(partial, out / name)
    return out
