"""Throughput and MFU of training, logged every N optimizer steps as global (all-rank) figures.

    perf/tokens_per_s          real (attention-mask) tokens per second, all ranks
    perf/tokens_per_s_per_gpu  the same over the world size (compare with docs/PERFORMANCE.md)
    perf/padded_tokens_per_s   tokens computed, padding included (rows x padded width; a packed
                               row has none but its filling to stream.token_budget), all ranks
    perf/real_token_fraction   real tokens / tokens computed (1 for packed rows without a budget)
    perf/tokens_per_sample     tokens computed per record (a packed pointwise pair computes its
                               criteria + query once)
    perf/samples_per_s         records per second, all ranks (a pointwise record is two rows)
    perf/mfu                   tokens/s x FLOPs per token / (peak per device x world size);
                               not logged when no peak is known (CPU, an unknown GPU)
    perf/compiled_graphs       graphs torch.compile built since training started (decoder layers:
    perf/graph_breaks          crm.models.compile), graph breaks and compile seconds; logged when
    perf/compile_seconds       any was built, with a warning past crm.models.compile.RECOMPILE_WARNING

FLOPs per token are crm.perf.flops' 6 N + 12 L H d S (4 N + ... with LoRA's frozen base), with S
the mean real length of the sequences attended over in the window (a packed row's per record or
branch: crm.data.packing's views). A window runs from one logging point
to the next, timed with time.perf_counter on each rank, less the time spent in validation. Counts
are summed on the device and reduced once per logging point, so nothing synchronises at other
steps.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import lightning as L
import torch

from crm.models.compile import RECOMPILE_WARNING, compile_stats
from crm.perf.flops import ModelShape, flops_per_token, mfu, peak_flops
from crm.training.parallel import all_ranks_sum

log = logging.getLogger(__name__)


class Throughput(L.Callback):
    """Logs perf/* every `log_every_n_steps` optimizer steps; `last` holds the latest figures.

    `gpu` names a row of crm.perf.flops.PEAK_FLOPS ("h100", "h200", "a100"), "auto" reads the CUDA
    device name, None reports no MFU; `peak_flops` (FLOP/s of one device) overrides it.
    """

    def __init__(self, log_every_n_steps: int = 10, *, gpu: str | None = "auto",
                 peak_flops: float | None = None, clock: Callable[[], float] = time.perf_counter):
        if log_every_n_steps < 1:
            raise ValueError(f"log_every_n_steps={log_every_n_steps}: must be at least 1")
        self.every, self.gpu, self.peak_override, self.clock = log_every_n_steps, gpu, peak_flops, clock
        self.peak: float | None = None  # per device, resolved at train start
        self.shape: ModelShape | None = None
        self.frozen_base = False
        self.last: dict = {}  # the latest logged figures (mfu None when no peak)
        self._real: torch.Tensor | None = None  # real tokens of the window, on the device
        # Of the window: tokens computed, sequences, samples, and a packed row's real and attended
        # tokens (known on the host; a padded batch's real tokens are summed in `_real`)
        self._host = [0, 0, 0, 0, 0]
        self._window_start = 0.0
        self._paused = 0.0  # validation seconds inside the window
        self._val_start: float | None = None
        self._last_step = -1
        self._warned_graphs = 0  # the graph count of the last recompile warning
        self._compiled_before: dict | None = None  # compile_stats() when training started

    # -- set-up --------------------------------------------------------------------------------

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.shape is None:
            self.shape = ModelShape.from_config(pl_module.crm.model.config)
            # LoRA: frozen weights take no weight gradient, so a step costs 4 N, not 6 N, a token.
            self.frozen_base = any(not p.requires_grad for p in pl_module.crm.parameters())
        self.peak = peak_flops(self.gpu, self.peak_override)
        if self._compiled_before is None:
            self._compiled_before = compile_stats()
        self._reset_counts()
        self._last_step = trainer.global_step
        self._start_window()

    def _reset_counts(self) -> None:
        self._real, self._host = None, [0, 0, 0, 0, 0]

    def _start_window(self) -> None:
        self._window_start, self._paused = self.clock(), 0.0

    # -- counting ------------------------------------------------------------------------------

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch,
                           batch_idx: int) -> None:
        samples = len(batch["keys"]) if "keys" in batch else (
            batch["labels"].numel() if "labels" in batch else batch["input_ids"].shape[0])
        if "read" in batch:  # packed: the counts came with the batch; computed: the row, its
            # filling to `stream.token_budget` included
            counts = (batch["input_ids"].shape[1], batch["read"].numel(), samples, batch["real_tokens"],
                      batch["attended_tokens"])
        else:
            mask = batch["attention_mask"]
            # The real-token sum stays on the device (no sync); the shapes are known on the host.
            real = mask.sum()
            self._real = real if self._real is None else self._real + real
            counts = (mask.numel(), mask.shape[0], samples, 0, 0)
        for i, n in enumerate(counts):
            self._host[i] += n

        step = trainer.global_step
        if step == self._last_step:  # accumulating: no optimizer step yet
            return
        self._last_step = step
        if step % self.every == 0:
            self._log(trainer)

    def _log(self, trainer: L.Trainer) -> None:
        elapsed = self.clock() - self._window_start - self._paused
        # Every rank reaches this step (same global_step), so the collective cannot hang.
        local = torch.tensor([0.0, *self._host], dtype=torch.float64,
                             device=trainer.strategy.root_device)
        if self._real is not None:
            local[0] = self._real
        totals = all_ranks_sum(local)
        padded_real, computed, rows, samples, packed_real, attended = (float(x) for x in totals.tolist())
        real, attended = padded_real + packed_real, padded_real + attended
        self._reset_counts()
        self._start_window()
        if elapsed <= 0 or rows == 0:
            return
        world = trainer.world_size
        seq_len = attended / rows  # mean real length of an attended sequence: the S of attention
        per_token = flops_per_token(self.shape, seq_len, frozen_base=self.frozen_base)
        tokens_per_s = real / elapsed
        figures = {
            "perf/tokens_per_s": tokens_per_s,
            "perf/tokens_per_s_per_gpu": tokens_per_s / world,
            "perf/padded_tokens_per_s": computed / elapsed,
            "perf/real_token_fraction": real / computed,
            "perf/tokens_per_sample": computed / max(samples, 1.0),
            "perf/samples_per_s": samples / elapsed,
            "perf/mfu": mfu(tokens_per_s, per_token, None if self.peak is None else self.peak * world),
        }
        compiled = {k: v - self._compiled_before[k] for k, v in compile_stats().items()}
        if compiled["graphs"]:
            figures.update({"perf/compiled_graphs": compiled["graphs"],
                            "perf/graph_breaks": compiled["graph_breaks"],
                            "perf/compile_seconds": compiled["seconds"]})
            if compiled["graphs"] > max(RECOMPILE_WARNING, self._warned_graphs):
                self._warned_graphs = compiled["graphs"]
                log.warning("torch.compile has built %d graphs by step %d (expected at most %d): shapes "
                            "vary in a way that recompiles; TORCH_LOGS=recompiles says why",
                            compiled["graphs"], trainer.global_step, RECOMPILE_WARNING)
        self.last = {**figures, "step": trainer.global_step, "seconds": elapsed, "tokens": real,
                     "mean_row_tokens": seq_len, "flops_per_token": per_token, "world": world}
        if trainer.is_global_zero:
            metrics = {k: v for k, v in figures.items() if v is not None}
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    # -- validation is not training time --------------------------------------------------------

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._val_start = self.clock()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._val_start is not None:
            self._paused += self.clock() - self._val_start
            self._val_start = None
