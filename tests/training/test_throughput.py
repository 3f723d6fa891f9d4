"""The throughput/MFU callback (crm.training.throughput) in tiny CPU Lightning runs with known batches
and a clock the test advances: tokens/s, padded tokens/s, samples/s and MFU by hand; validation
time excluded; under 2-process DDP the figures are global."""
from __future__ import annotations

import json
import os
import sys
import textwrap
from functools import partial
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import Logger

from crm.data.packing import pack
from crm.data.padding import pad_rows
from crm.perf.flops import ModelShape, flops_per_token
from crm.training.module import CRMModule, OptimConfig
from crm.training.throughput import Throughput
from crm.models.factory import LossConfig, ModelConfig, build_crm

VOCAB, PAD = 64, 0
ARCH = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            head_dim=16, intermediate_size=64, vocab_size=VOCAB)
LENGTHS = (5, 9, 7, 4)  # one micro batch: 25 real tokens, 4 x 9 = 36 with padding, 4 records


class Clock:
    """Seconds that pass only when the test says so."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Tick(L.Callback):
    """0.5 s per training micro batch, 100 s per validation batch (which must not count)."""

    def __init__(self, clock: Clock):
        self.clock = clock

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.clock.now += 0.5

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        self.clock.now += 100.0


class Recorder(Logger):
    def __init__(self):
        super().__init__()
        self.logged: list[tuple[int, dict]] = []

    name, version = "recorder", "0"

    def log_metrics(self, metrics, step=None):
        if any(k.startswith("perf/") for k in metrics):
            self.logged.append((step, dict(metrics)))

    def log_hyperparams(self, params, *args, **kwargs):
        pass


def batches(n: int, lengths=LENGTHS, packed: bool = False) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        rows = [torch.randint(1, VOCAB, (k,), generator=g).tolist() for k in lengths]
        batch = {**pack([(r,) for r in rows]), "branched": False} if packed else pad_rows(rows, PAD)
        batch.update(labels=torch.arange(len(lengths)) % 2, shortened=torch.tensor(0),
                     dropped=torch.tensor(0), step_examples=torch.tensor(len(lengths)),
                     step_index=0, step_batches=1, epoch_index=i)
        out.append(batch)
    return out


def module() -> CRMModule:
    return CRMModule(partial(build_crm, ModelConfig(arch=ARCH, attention="sdpa"),
                             LossConfig("pairwise"), num_labels=2, pad_token_id=PAD),
                     OptimConfig(warmup_steps=0))


def fit(throughput: Throughput, clock: Clock, *, steps: int, accumulate: int = 1,
        validate_every: int | None = None, packed: bool = False) -> Recorder:
    recorder = Recorder()
    loader = partial(torch.utils.data.DataLoader, batch_size=None)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps,
                        accumulate_grad_batches=accumulate, logger=recorder,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, log_every_n_steps=1,
                        val_check_interval=validate_every or 1.0, limit_val_batches=2,
                        callbacks=[Tick(clock), throughput])
    trainer.fit(module(), train_dataloaders=loader(batches(steps * accumulate, packed=packed)),
                val_dataloaders=loader(batches(2)) if validate_every else None)
    assert trainer.global_step == steps
    return recorder


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_tokens_samples_and_mfu_from_known_batches():
    clock, peak = Clock(), 1e7
    throughput = Throughput(log_every_n_steps=2, gpu=None, peak_flops=peak, clock=clock)
    # 4 steps of 2 micro batches; a validation after every step (2 batches, 200 s) is not counted.
    recorder = fit(throughput, clock, steps=4, accumulate=2, validate_every=2)
    assert [step for step, _ in recorder.logged] == [2, 4]
    # A window: 2 steps x 2 micro batches x 0.5 s = 2 s; 4 x 25 real tokens, 4 x 36 padded,
    # 4 x 4 records.
    shape = ModelShape.from_config(throughput_model_config())
    per_token = flops_per_token(shape, 25 / 4)  # S = mean real row length
    expected = {"perf/tokens_per_s": 100 / 2, "perf/tokens_per_s_per_gpu": 100 / 2,
                "perf/padded_tokens_per_s": 144 / 2, "perf/samples_per_s": 16 / 2,
                "perf/real_token_fraction": 100 / 144, "perf/tokens_per_sample": 144 / 16,
                "perf/mfu": 100 / 2 * per_token / peak}
    for _, metrics in recorder.logged:
        assert metrics == pytest.approx(expected)
    last = throughput.last
    assert last["step"] == 4 and last["seconds"] == 2.0 and last["tokens"] == 100
    assert last["mean_row_tokens"] == 6.25 and last["flops_per_token"] == pytest.approx(per_token)
    assert last["perf/mfu"] == pytest.approx(expected["perf/mfu"])


def test_a_packed_row_counts_every_token_real_and_computed_once():
    """The same records packed: 25 real tokens a micro batch and nothing else computed; S is still
    the records' mean length (their own sequences are what attention spans)."""
    clock = Clock()
    throughput = Throughput(log_every_n_steps=2, gpu=None, peak_flops=1e7, clock=clock)
    fit(throughput, clock, steps=2, packed=True)
    last = throughput.last
    assert last["perf/tokens_per_s"] == 50 and last["perf/padded_tokens_per_s"] == 50
    assert last["perf/real_token_fraction"] == 1.0 and last["perf/tokens_per_sample"] == 25 / 4
    assert last["mean_row_tokens"] == 6.25


def throughput_model_config():
    return build_crm(ModelConfig(arch=ARCH, attention="sdpa"), LossConfig("pairwise"), num_labels=2,
                     pad_token_id=PAD, device="meta").model.config


def test_no_peak_no_mfu():
    clock = Clock()
    throughput = Throughput(log_every_n_steps=1, gpu=None, clock=clock)
    recorder = fit(throughput, clock, steps=2)
    assert [step for step, _ in recorder.logged] == [1, 2]
    assert all("perf/mfu" not in m for _, m in recorder.logged)
    assert throughput.last["perf/mfu"] is None
    assert throughput.last["perf/tokens_per_s"] == 25 / 0.5


def test_figures_are_summed_over_ranks(monkeypatch):
    """In-process stand-in for the DDP test below: a second rank that read 3 rows of 3 tokens per
    micro batch, added by the sum over ranks (crm.training.parallel.all_ranks_sum) that the
    callback must call."""
    import crm.training.throughput

    # real, computed, rows, records, packed real, packed attended
    other = torch.tensor([9.0, 9.0, 3.0, 3.0, 0.0, 0.0], dtype=torch.float64)
    calls = []

    def all_ranks_sum(tensor):
        calls.append("sum")
        return tensor + other * 2  # the other rank's 2 micro batches of the window

    monkeypatch.setattr(crm.training.throughput, "all_ranks_sum", all_ranks_sum)
    monkeypatch.setattr(L.Trainer, "world_size", property(lambda self: 2))
    clock = Clock()
    throughput = Throughput(log_every_n_steps=2, gpu=None, peak_flops=1e7, clock=clock)
    fit(throughput, clock, steps=2)
    assert calls == ["sum"]  # once per logging point, not per step
    last = throughput.last
    assert last["seconds"] == 1.0 and last["world"] == 2
    assert last["perf/tokens_per_s"] == 68 and last["perf/tokens_per_s_per_gpu"] == 34
    assert last["perf/padded_tokens_per_s"] == 90 and last["perf/samples_per_s"] == 14
    assert last["mean_row_tokens"] == pytest.approx(68 / 14)
    assert last["perf/mfu"] == pytest.approx(68 * last["flops_per_token"] / (2 * 1e7))


DDP_SCRIPT = textwrap.dedent("""
    import json, sys
    from functools import partial
    import lightning as L, torch
    sys.path.insert(0, sys.argv[1])
    import test_throughput as t
    from crm.training.throughput import Throughput
    from crm.training.trainer import leave_process_group

    class Ranked(torch.utils.data.IterableDataset):
        # rank 0: micro batches of (5, 9, 7, 4); rank 1: (3, 3, 3): global 34 real tokens a step
        def __iter__(self):
            rank = torch.distributed.get_rank()
            yield from t.batches(2, t.LENGTHS if rank == 0 else (3, 3, 3))

    torch.set_num_threads(1)
    clock = t.Clock()
    throughput = Throughput(log_every_n_steps=2, gpu=None, peak_flops=1e7, clock=clock)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[t.Tick(clock), throughput])
    trainer.fit(t.module(), train_dataloaders=torch.utils.data.DataLoader(Ranked(), batch_size=None))
    with open(f"result_{trainer.global_rank}.json", "w") as f:
        json.dump(throughput.last, f)
    leave_process_group(trainer)  # gloo's group: Lightning leaves it to interpreter exit
""")


@pytest.mark.slow  # two processes: 10-25 s on the 2-core machine
@pytest.mark.both_cores
def test_ddp_figures_are_global(tmp_path):
    from helpers import assert_ranks_ok, run_ranks  # here: DDP_SCRIPT imports this module alone

    script = tmp_path / "ddp_throughput.py"
    script.write_text(DDP_SCRIPT)
    # Both ranks started at once (Lightning starts none), not rank 1 after rank 0's imports.
    assert_ranks_ok(run_ranks([sys.executable, str(script), str(Path(__file__).parent)],
                              {**os.environ, "PYTHONWARNINGS": "ignore"}, tmp_path / "logs",
                              timeout=300, cwd=tmp_path))
    results = {rank: json.loads((tmp_path / f"result_{rank}.json").read_text()) for rank in (0, 1)}
    # Both ranks: 2 steps x 0.5 s; real tokens 2 x (25 + 9), padded 2 x (36 + 9), 2 x (4 + 3) rows.
    for last in results.values():
        assert last["world"] == 2 and last["seconds"] == 1.0
        assert last["perf/tokens_per_s"] == 68 and last["perf/tokens_per_s_per_gpu"] == 34
        assert last["perf/padded_tokens_per_s"] == 90 and last["perf/samples_per_s"] == 14
        assert last["mean_row_tokens"] == pytest.approx(68 / 14)
        assert last["perf/mfu"] == pytest.approx(68 * last["flops_per_token"] / (2 * 1e7))
