"""What a training step costs the host outside forward, backward and the optimizer, counted
(docs/PERFORMANCE.md section 13; benchmarks/step_overhead.py times it): each of these ran at every
micro batch once, and a counter here fails if it comes back.

- Lightning's `log` (the costliest part of crm's own host work per micro batch): none on a micro
  batch that does not log; the length policy's counts are logged once an epoch, summed.
- A read of a tensor's value (`.item()`, `.tolist()`, `bool()`: on a GPU, the host waits for the
  device): none on a micro batch that does not log, the optimizer's own left out (torch's CPU
  AdamW reads its step counters; CUDA's fused one reads none), padded and packed rows.
- transformers' mask preparation, which reads a device value for a right-padded batch without a
  mask: not run for the training model (the meta device, where any read raises, runs its forward).
- The Bradley-Terry loss's check for ties off the CPU.
- The stream's epoch plan: made once an epoch, not once a micro batch.
"""
from __future__ import annotations

from collections import Counter
from functools import partial

import lightning as L
import pytest
import torch
from dist.probe import optimizer_step_told_apart
from helpers import make_records, split_sizes, tiny_tokenizer, write_shard_dir
from lightning.pytorch.loggers import Logger

import crm.data.stream as stream
from crm.data.config import StreamConfig
from crm.data.packing import pack
from crm.data.padding import pad_rows
from crm.data.transforms import TransformConfig
from crm.models.factory import LossConfig, ModelConfig, build_crm
from crm.models.heads import PointwiseCRM
from crm.training.module import CRMModule, OptimConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
VOCAB, PAD = 64, 0
ARCH = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            head_dim=16, intermediate_size=64, vocab_size=VOCAB)
READS = ("item", "tolist", "__bool__")


def module(kind: str = "pairwise") -> CRMModule:
    return CRMModule(partial(build_crm, ModelConfig(arch=ARCH, attention="sdpa"), LossConfig(kind),
                             num_labels=2 if kind == "pairwise" else 1, pad_token_id=PAD),
                     OptimConfig(warmup_steps=0))


def batches(n: int, accumulate: int, packed: bool) -> list[dict]:
    """`n` micro batches as the stream makes them (plain-int counts of the length policy), steps of
    `accumulate`; each micro batch i shortened i examples and dropped 1."""
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        rows = [torch.randint(1, VOCAB, (k,), generator=g).tolist() for k in (5, 9, 7, 4)]
        batch = {**pack([(r,) for r in rows]), "branched": False} if packed else pad_rows(rows, PAD)
        batch.update(labels=torch.arange(4) % 2, keys=[f"k{i}-{j}" for j in range(4)],
                     shortened=i, dropped=1, step_examples=torch.tensor(4 * accumulate),
                     step_index=i % accumulate, step_batches=accumulate, epoch_index=i)
        out.append(batch)
    return out


class Recorder(Logger):
    name, version = "recorder", "0"

    def __init__(self):
        super().__init__()
        self.logged: list[tuple[int, dict]] = []

    def log_metrics(self, metrics, step=None):
        self.logged.append((step, dict(metrics)))

    def log_hyperparams(self, params, *args, **kwargs):
        pass


class Census(L.Callback):
    """Per micro batch, from its on_train_batch_start to the next one's: `log` calls of the module
    and tensor reads (the optimizer's own apart)."""

    def __init__(self):
        self.micro: list[dict] = []
        self.in_optimizer = False
        self._undo = []

    def on_train_start(self, trainer, pl_module):
        census = self

        def counting(name, original):
            def counted(*args, **kwargs):
                if census.micro:
                    key = f"{name}/optimizer" if census.in_optimizer else name
                    census.micro[-1]["counts"][key] += 1
                return original(*args, **kwargs)
            return counted

        for name in READS:
            original = getattr(torch.Tensor, name)
            self._undo.append((torch.Tensor, name, name in vars(torch.Tensor), original))
            setattr(torch.Tensor, name, counting(name, original))
        log = pl_module.log
        self._undo.append((pl_module, "log", False, log))
        pl_module.log = counting("log", log)
        optimizer = trainer.optimizers[0]
        step = optimizer.step

        self._undo.append((optimizer, "step", False, step))
        optimizer.step = optimizer_step_told_apart(census, step)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.micro.append({"step": trainer.global_step + 1, "counts": Counter()})

    def on_train_end(self, trainer, pl_module):
        for owner, name, had, original in reversed(self._undo):
            if had:
                setattr(owner, name, original)
            else:
                delattr(owner, name)


def fit(packed: bool, *, steps: int = 6, accumulate: int = 2, log_every: int = 3) -> tuple[Census, Recorder]:
    census, recorder = Census(), Recorder()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, accumulate_grad_batches=accumulate,
                        logger=recorder, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, log_every_n_steps=log_every,
                        callbacks=[census])
    loader = torch.utils.data.DataLoader(batches(steps * accumulate, accumulate, packed), batch_size=None)
    trainer.fit(module(), train_dataloaders=loader)
    assert trainer.global_step == steps
    return census, recorder


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_a_micro_batch_that_does_not_log_reads_nothing_and_logs_nothing(packed):
    census, recorder = fit(packed)
    quiet = [m["counts"] for m in census.micro if m["step"] % 3]
    logging = [m["counts"] for m in census.micro if not m["step"] % 3]
    assert len(quiet) == 8 and len(logging) == 4
    for counts in quiet:
        own = {k: v for k, v in counts.items() if not k.endswith("/optimizer")}
        assert own == {}, own
    assert sum(c["log"] for c in logging) > 0  # the census sees the logging steps' calls
    # The length policy's counts: once, at the epoch's end, summed over its 12 micro batches.
    logged = [metrics for _, metrics in recorder.logged if "data/shortened" in metrics]
    assert len(logged) == 1
    assert logged[0]["data/shortened"] == sum(range(12)) and logged[0]["data/dropped"] == 12


def test_the_training_models_forward_reads_no_device_value():
    """On the meta device every read of a value raises: the backbone runs there as the training
    module configures it. transformers' own sdpa path for a right-padded batch without a mask
    asks `(...).all()` whether the positions are packed sequences; crm's attention function skips
    that question."""
    crm_module = module()
    crm_module.configure_model()
    backbone = crm_module.crm.model.to("meta")
    ids = torch.randint(1, VOCAB, (3, 11), device="meta")
    hidden = backbone.model(input_ids=ids, use_cache=False).last_hidden_state
    assert hidden.shape == (3, 11, ARCH["hidden_size"])
    plain = module().build_crm().model.to("meta")  # transformers' sdpa, as built
    with pytest.raises((RuntimeError, NotImplementedError)):
        plain.model(input_ids=ids, use_cache=False)


def test_the_bradley_terry_loss_checks_for_ties_on_the_cpu_only():
    crm = build_crm(ModelConfig(arch=ARCH, attention="sdpa"), LossConfig("pointwise"), num_labels=1,
                    pad_token_id=PAD)
    assert isinstance(crm, PointwiseCRM) and crm.tie_log_nu is None
    rewards = torch.zeros(8, device="meta", requires_grad=True)
    crm.forward = lambda *args, **kwargs: rewards  # the rewards of 4 pairs, on a device
    batch = {"input_ids": torch.ones(8, 3, dtype=torch.long, device="meta"),
             "attention_mask": torch.ones(8, 3, dtype=torch.long, device="meta"),
             "labels": torch.zeros(4, dtype=torch.long, device="meta")}
    sums = crm.loss_sums(batch)  # on the meta device a read of `tie.any()` would raise
    assert sums["n"] == 4 and sums["loss"].device.type == "meta"
    crm.forward = lambda *args, **kwargs: torch.zeros(8)
    ones = torch.ones(8, 3, dtype=torch.long)
    cpu = {"input_ids": ones, "attention_mask": ones, "labels": torch.tensor([0, 0, 2, 0])}
    with pytest.raises(ValueError, match="a tie reached a Bradley-Terry pointwise CRM"):
        crm.loss_sums(cpu)


def test_the_stream_plans_an_epoch_once_not_once_a_micro_batch(tmp_path, monkeypatch):
    records = make_records(40)
    shards = write_shard_dir(tmp_path, split_sizes(records, [13, 27])).shards("train")
    calls = Counter()
    plan_rank = stream.plan_rank

    def counted(*args, **kwargs):
        calls[kwargs["epoch"]] += 1
        return plan_rank(*args, **kwargs)

    monkeypatch.setattr(stream, "plan_rank", counted)
    dataset = stream.PairStream(shards, tiny_tokenizer(), StreamConfig(batch_size=2),
                                TransformConfig(ties="drop"))
    loader = stream.StreamLoader(dataset)
    for _ in range(2):  # two epochs, each batch consumed as the trainer consumes it
        seen = 0
        for batch in loader:
            loader.mark_consumed(batch["position"])
            assert isinstance(batch["shortened"], int) and isinstance(batch["dropped"], int)
            seen += 1
        assert seen == len(loader) == 20
    assert calls == {0: 1, 1: 1}, calls
