"""A crm-train run's edges: settings refused at start that equal a boolean without being one, the
library's stream default beside crm-train's, the benchmarks only global rank 0 scores, and a late
preemption warning during the export."""
from __future__ import annotations

import json
import os
import signal

import pytest
from test_train import compose_train, run_train

from crm.cli import train as train_cli
from crm.cli.schema import settings
from crm.core.errors import ConfigError
from crm.data.config import StreamConfig, resolve_packing
from crm.training.callbacks import ExportBest

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.mark.parametrize("key", ["stream.packing", "compile"])
@pytest.mark.parametrize("value", ["0", "1", "1.0"])
def test_a_number_that_equals_a_boolean_is_refused_at_start_in_one_line(key, value, demo_root, tmp_path):
    # Hydra reads 1 as an int and 1.0 as a float; each equals True in Python.
    with pytest.raises(ConfigError, match=rf"^{key}={value}: expected auto, true or false$"):
        run_train(demo_root, tmp_path / "run", f"{key}={value}")


def test_crm_evals_compile_refuses_a_number_too():
    """The scorer's `compile` (crm-eval, crm-leaderboard, crm-usl: ScorerSettings) as crm-train's."""
    from hydra import compose, initialize_config_module

    import crm.cli.eval  # noqa: F401  (registers its config's schema)

    with initialize_config_module(version_base="1.3", config_module="crm_configs"):
        cfg = compose("eval", overrides=["compile=1", "checkpoint=x"])
    with pytest.raises((ValueError, ConfigError), match="compile=1: expected auto, true or false"):
        settings(cfg)


def test_a_library_stream_is_padded_as_crm_train_auto_is_on_cpu():
    assert StreamConfig(batch_size=2).packing is False
    assert resolve_packing("auto", "cpu", "pairwise") is False
    assert resolve_packing("auto", "cpu", "pointwise") is False


def test_only_global_rank_zero_keeps_the_benchmarks(tmp_path, monkeypatch):
    bench = tmp_path / "pairs.jsonl"
    bench.write_text(json.dumps({"prompt": "q", "chosen": "a", "rejected": "b"}) + "\n")
    run = settings(compose_train([f"paths.root_dir={tmp_path}", f"+benchmarks.pairs={bench}"]))
    for name in train_cli.RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")  # as the launcher sets it
    assert [b.name for b in train_cli.read_benchmarks(run)] == ["pairs"]
    monkeypatch.setenv("RANK", "1")
    assert train_cli.read_benchmarks(run) == []  # checked there too, and then dropped
    bench.write_text(json.dumps({"prompt": "q", "chosen": "a"}) + "\n")
    with pytest.raises(ConfigError, match="rejected: missing"):  # every rank stops on a bad file
        train_cli.read_benchmarks(run)


class TerminatedByDefault(Exception):
    """What SIGUSR1's default action (terminate the process) would have done, in a test process
    that must survive it."""


@pytest.fixture(scope="module")
def warned_during_export(demo_root, tmp_path_factory):
    """(run dir, metrics, log text, the handler after the run) of a run whose rank 0 receives
    SIGUSR1 as its export starts."""
    import logging

    export = ExportBest.export

    def export_after_a_warning(self, trainer, pl_module):
        os.kill(os.getpid(), signal.SIGUSR1)  # SLURM's warning, 120 s before the limit
        export(self, trainer, pl_module)

    def default_action(signum, frame):
        raise TerminatedByDefault(signal.Signals(signum).name)

    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("crm.training.preemption").addHandler(handler)
    ExportBest.export = export_after_a_warning
    before = signal.signal(signal.SIGUSR1, default_action)
    run_dir = tmp_path_factory.mktemp("warned") / "run"
    try:
        metrics = run_train(demo_root, run_dir, "stream.max_tokens=384", "export=true",
                            "evaluate=true")
        after = signal.getsignal(signal.SIGUSR1)
    finally:
        signal.signal(signal.SIGUSR1, before)
        ExportBest.export = export
        logging.getLogger("crm.training.preemption").removeHandler(handler)
    return run_dir, metrics, "\n".join(records), after is default_action


def test_a_warning_signal_during_the_export_leaves_export_evaluation_and_metrics(warned_during_export):
    run_dir, metrics, log, restored = warned_during_export
    assert metrics["preempted"] is False and metrics["eval"]
    assert (run_dir / "export" / "crm.json").is_file()
    assert json.loads((run_dir / "metrics.json").read_text()) == metrics
    assert "SIGUSR1 after training: ignored" in log
    assert restored  # once the run ended, the handler from before it is back


def test_the_resolution_is_recorded_whole_in_checkpoint_export_and_metrics(warned_during_export):
    import torch

    run_dir, metrics, _, _ = warned_during_export
    resolved = metrics["resolved"]
    assert resolved == {"device": "cpu", "world_size": 1, "micro_batch_size": 4, "accumulation": 1,
                        "attention": "sdpa", "compile": False, "packing": False, "sharding": "fsdp",
                        "timeout_minutes": resolved["timeout_minutes"], "lora": None, "ties": "keep"}
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    exported = json.loads((run_dir / "export" / "crm.json").read_text())["config"]
    for config in (checkpoint["crm_config"], exported):
        assert config["resolved"] == resolved
        # each automatic setting says what ran, not auto
        assert (config["compile"], config["stream"]["packing"]) == (False, False)
        assert config["model"]["attention"] == "sdpa"
        assert config["transform"]["ties"] == "keep"  # ties=auto, for a pairwise CRM
