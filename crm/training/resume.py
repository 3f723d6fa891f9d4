"""Whether a run resumes, and from which checkpoint: decided from the filesystem without Lightning,
so that one process refuses another data set's checkpoint before the model's libraries load
(crm.cli.train); ranks agree on the decision inside fit (crm.training.trainer.AgreedResume)."""
from __future__ import annotations

import logging
from pathlib import Path

from crm.core.errors import ConfigError
from crm.models.checkpoint import checkpoint_config, is_complete_checkpoint

log = logging.getLogger(__name__)


def resolve_resume(resume, run_dir: Path, data_path: str | None = None) -> str | None:
    """auto: this run dir's last checkpoint if a complete one exists; a path: that; false: none.

    A sharded checkpoint is swapped into place only when complete (crm.training.parallel.FSDPStrategy); a
    job killed between the swap's two renames leaves the complete `.partial` or `.old` copy.
    With `data_path`, auto refuses a checkpoint trained on another data set (`check_same_data`).
    """
    if resume in (None, False, "false", "False"):
        return None
    if resume == "auto":
        last = Path(run_dir) / "checkpoints" / "last.ckpt"
        for candidate in (last, last.with_name("last.ckpt.partial"), last.with_name("last.ckpt.old")):
            if is_complete_checkpoint(candidate):
                if data_path is not None:
                    check_same_data(candidate, data_path)
                log.info("resuming from %s", candidate)
                return str(candidate)
            if candidate.exists():
                log.warning("ignoring the incomplete checkpoint %s", candidate)
        return None
    if not is_complete_checkpoint(resume):
        raise ConfigError(f"resume={resume}: no such checkpoint, or an incomplete one")
    return str(resume)


def check_same_data(checkpoint: Path, data_path: str) -> None:
    """A run dir's checkpoint that another data set trained (a `name=` used again with another
    data.path) is refused: resumed, its stream position and epoch count belong to the other
    data, and Lightning's loop stops mid-run on the mismatch, or trains on without a word."""
    try:
        config = checkpoint_config(checkpoint)
    except Exception as exc:  # torch.load's errors on a damaged file have no common type
        raise ConfigError(f"{checkpoint}: cannot be read to resume ({type(exc).__name__}): give "
                          "this run another name=, or resume=false to start over in "
                          f"{checkpoint.parent.parent}") from None
    trained_on = ((config or {}).get("data") or {}).get("path")
    if trained_on is None or same_path(trained_on, data_path):
        return
    raise ConfigError(f"{checkpoint}: trained on data.path={trained_on}, and this run's is "
                      f"data.path={data_path}: resume=auto would continue it on other data; give "
                      "this run another name= (a run dir of its own), or resume=false to start "
                      f"over in {checkpoint.parent.parent}")


def same_path(a: str, b: str) -> bool:
    return a == b or Path(a).resolve() == Path(b).resolve()
