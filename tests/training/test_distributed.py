"""Distributed training end to end, on 2 CPU processes (gloo): FSDP2 sharding, loss curves that
agree across FSDP, DDP and one process on the same global batches (from a pretrained checkpoint
loaded into the shards; the HSDP job from random init), sharded checkpoints that resume and export, a
simulated 2-node SLURM job, preemption (SIGUSR1 -> save, requeue, stop) and recovery from kill -9.

Every run is a `crm-train` subprocess (a DDP/FSDP run inside pytest would re-run the pytest
session in rank 1). The test starts both ranks of a run at once with LOCAL_RANK set, as torchrun
would (8-10 s quicker a run than Lightning's launcher in rank 0 starting rank 1, which
tests/training/test_lora.py's FSDP run goes through); for SLURM it starts one process per task with
SLURM_* variables, as srun would. Runs share one demo data set; the runs several tests compare
(FSDP, DDP, the one-process reference) run once per module, on first use.
"""
from __future__ import annotations

import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from functools import cached_property
from pathlib import Path

import pytest
import torch
from helpers import free_port, save_tiny_base
from hydra import compose, initialize_config_module

from crm.core.errors import ConfigError
import crm.cli.train  # noqa: F401  (registers train.yaml's schema)
from crm.data.demo import DemoConfig, prepare_demo
from crm.data.manifest import load_manifest
from crm.data.shard import shard
from crm.models.checkpoint import SHARDED_META, is_complete_checkpoint, load_checkpoint, model_weights
from crm.training.resume import resolve_resume

# The subprocess tests are marked slow (12 runs, about 5 minutes on the 2-core machine):
# `make test` runs them too, `-m 'not slow'` leaves them out.
# A test that starts ranks holds both cores: the other xdist worker waits meanwhile (tests/conftest.py).
slow = pytest.mark.slow
ranks = pytest.mark.both_cores

BIN = Path(sys.executable).parent
REFERENCE = Path(__file__).parents[1] / "dist" / "single_reference.py"
PROBE = Path(__file__).parents[1] / "dist" / "probe.py"  # a callback: collectives, states, batch sizes
RUN_TIMEOUT = 240  # seconds; a healthy run takes 10-40 s on the (shared) 2-core machine

# 386 demo pairs shard into 360 eligible train records and 16 val records (ties dropped). Runs
# train on them with every 7th query too long to fit (with_long_queries): the length policy drops
# those, so micro batches hold 0 to 4 examples and ranks differ; the loss (sum over the step's
# examples / their global count) makes every run's gradients the one-process reference's anyway.
DEMO = ["data.demo.n_train=386", "data.demo.n_user=0", "data.demo.n_test=20", "data.demo.n_bench=4"]
TRAIN_RECORDS, RANK_BATCH, LONG_EVERY = 360, 4, 7
LONG_SHARDS = "long_shards"  # under the root
DATA = ["data=shards", f"data.path=${{paths.root_dir}}/{LONG_SHARDS}"]
SMALL = [*DATA, "loss=cls", "transform.ties=drop", "model.arch.hidden_size=32",
         "model.arch.num_hidden_layers=2", "model.arch.intermediate_size=64", "model.vocab_size=300",
         "trainer.enable_progress_bar=false", "evaluate=false", "trainer.log_every_n_steps=1",
         "early_stopping_patience=0", "stream.num_workers=0", "torch_threads=1",
         # A constant learning rate: the schedule does not depend on max_steps, so a run resumed
         # with a larger max_steps retraces an uninterrupted one.
         "optim.warmup_steps=0", "optim.min_lr_ratio=1.0"]
FSDP = ["trainer=fsdp", "trainer.accelerator=cpu", "trainer.devices=2",
        "parallel.param_dtype=float32", "micro_batch_size=4", "global_batch_size=8"]
DDP = ["trainer=ddp", "micro_batch_size=4", "global_batch_size=8"]
# The shared 20-step runs: validation every 4 steps (val/loss at 4, 8, ..., 20), checkpoints every 5.
# Their micro batches include one rank's emptied and the other's not (steps 1, 8, 11, 13) and both
# ranks' emptied (step 18: a step of no example).
STEPS = 20
CURVE = [f"trainer.max_steps={STEPS}", "val_every_n_steps=4", "save_every_n_steps=5"]

LOSS_ATOL = 2e-5  # fp32 at lr 3e-3: FSDP vs DDP vs one process (measured <= 1e-5 over 30 steps)
LOGIT_ATOL = 3e-5  # their exported models' logits (measured <= 7e-6)


# -- processes ------------------------------------------------------------------------------------

def run_env(root: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "MASTER_", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE"))}
    env.update(CRM_ROOT=str(root), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               PYTHONPATH=str(PROBE.parent), PROBE_DIR=str(root / "probe"))
    env.update(extra)
    return env


def slurm_env(root: Path, job_id: str, rank: int, ntasks: int, port: int, path_prefix=None,
              per_node: int = 1, **extra: str) -> dict:
    """One srun task of a job of `ntasks` tasks, `per_node` a node (docs/DESIGN.md section 10), all
    on loopback."""
    env = run_env(root, SLURM_JOB_ID=job_id, SLURM_JOB_NAME="crm-test", SLURM_NTASKS=str(ntasks),
                  SLURM_NTASKS_PER_NODE=str(per_node), SLURM_NNODES=str(ntasks // per_node),
                  SLURM_NODELIST="127.0.0.1", SLURM_PROCID=str(rank),
                  SLURM_NODEID=str(rank // per_node), SLURM_LOCALID=str(rank % per_node),
                  MASTER_PORT=str(port), **extra)
    if path_prefix:
        env["PATH"] = f"{path_prefix}{os.pathsep}{env['PATH']}"
    return env


class Proc:
    """A process in its own session (its Lightning-launched rank 1 too), output in a log file."""

    def __init__(self, cmd: list[str], env: dict, log: Path):
        self.cmd, self.log = cmd, log
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "wb") as out:
            self.popen = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def signal(self, signum: int, group: bool = False) -> None:
        (os.killpg if group else os.kill)(self.popen.pid, signum)

    def wait(self, timeout: float = RUN_TIMEOUT) -> int:
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"timed out after {timeout} s: {' '.join(self.cmd)}\n"
                                 f"{self.output()[-3000:]}") from None

    def kill(self) -> None:
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)  # the session's group: rank 1 as well
        except ProcessLookupError:
            pass
        self.popen.wait()

    def assert_ok(self, timeout: float = RUN_TIMEOUT) -> None:
        rc = self.wait(timeout)
        assert rc == 0, f"exit {rc}: {' '.join(self.cmd)}\n{self.output()[-4000:]}"


@contextmanager
def cleanup(*procs: Proc):
    """Kills whatever is still running when the block exits (a failed assertion included)."""
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()  # its process group: a rank 1 left behind by a failed rank 0 too


def crm_train_cmd(*overrides: str, script: Path | None = None) -> list[str]:
    prefix = [sys.executable, str(script)] if script else [str(BIN / "crm-train")]
    return [*prefix, *SMALL, *overrides]


def probe(name: str) -> list[str]:
    """crm-train overrides that add tests/dist/probe.py's callback; its report: probe_report(name)."""
    return ["+callbacks.probe._target_=probe.Probe", f"+callbacks.probe.name={name}"]


def probe_report(root: Path, name: str) -> dict:
    return json.loads((root / "probe" / f"probe-{name}.json").read_text())


def train(root: Path, name: str, *overrides: str, script: Path | None = None, ranks: int = 1,
          **env: str) -> Path:
    """Runs crm-train (or `script` with crm-train's arguments) to the end; the run dir.

    ranks=1: one process (with trainer.devices=2, Lightning's launcher in it would start rank 1
    once rank 0 has composed its config, rank 1 importing everything again meanwhile: 8-10 s on
    the 2-core machine). ranks=2: both ranks at once, each told its LOCAL_RANK, as a launcher that
    creates the processes (torchrun) starts them; Lightning starts none.
    """
    (run_dir,) = finish(begin(root, name, *overrides, script=script, ranks=ranks, **env))
    return run_dir


def begin(root: Path, name: str, *overrides: str, script: Path | None = None, ranks: int = 1,
          **env: str) -> tuple[Path, tuple[Proc, ...]]:
    """train()'s run started: (its run dir, its processes), for finish()."""
    cmd = crm_train_cmd(f"name={name}", *overrides, script=script)
    return root / "outputs" / name, start(root, name, cmd, ranks, **env)


def finish(*started: tuple[Path, tuple[Proc, ...]]) -> list[Path]:
    """Waits for runs begun together, each to its end; their run dirs. A one-process run beside a
    2-rank one takes the core the ranks leave idle (start-up, waits in collectives)."""
    procs = [proc for _, run_procs in started for proc in run_procs]
    with cleanup(*procs):
        for proc in procs:
            proc.assert_ok()
    return [run_dir for run_dir, _ in started]


def start(root: Path, tag: str, cmd: list[str], ranks: int = 1, **env: str) -> tuple[Proc, ...]:
    """`cmd` started as train() starts it: one process, or `ranks` at once (rank 0 first)."""
    if ranks == 1:
        return (Proc(cmd, run_env(root, **env), root / "logs" / f"{tag}.log"),)
    rendezvous = dict(MASTER_PORT=str(free_port()), NODE_RANK="0", WORLD_SIZE=str(ranks))
    return tuple(Proc(cmd, run_env(root, **rendezvous, LOCAL_RANK=str(rank), **env),
                      root / "logs" / f"{tag}-{rank}.log") for rank in range(ranks))


def wait_for(predicate, procs: tuple[Proc, ...], timeout: float, what: str, interval=0.02):
    deadline = time.monotonic() + timeout
    while not predicate():
        for p in procs:
            if p.popen.poll() is not None:
                raise AssertionError(f"exited ({p.popen.returncode}) before {what}:\n"
                                     f"{p.output()[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} after {timeout} s:\n{procs[0].output()[-3000:]}")
        time.sleep(interval)


# -- run outputs ----------------------------------------------------------------------------------

def metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


def logged(run_dir: Path, metric: str) -> list[tuple[int, float]]:
    """(optimizer step, value) of every row of csv/metrics.csv that holds `metric`, in file order
    (a resumed run appends to the file)."""
    with open(run_dir / "csv" / "metrics.csv", newline="") as f:
        # Lightning logs step k's train/val metrics at global_step k - 1.
        return [(int(row["step"]) + 1, float(row[metric])) for row in csv.DictReader(f)
                if row.get(metric)]


def curves(run_dir: Path) -> tuple[dict[int, float], dict[int, float]]:
    """({optimizer step: train/loss}, {optimizer step: val/loss}); a step logged twice (run again
    after a crash) keeps its later value."""
    return dict(logged(run_dir, "train/loss")), dict(logged(run_dir, "val/loss"))


def max_diff(a: dict[int, float], b: dict[int, float]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(abs(a[k] - b[k]) for k in a)


def checkpoint_meta(path: Path) -> dict:
    """A checkpoint's non-tensor state: the file itself, or a sharded dir's meta.pt."""
    path = Path(path)
    file = path / SHARDED_META if path.is_dir() else path
    return torch.load(file, map_location="cpu", weights_only=True)


def stream_state(checkpoint: dict) -> dict:
    (state,) = checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    return state


def batches_consumed(state: dict, world: int) -> int:
    """Micro batches the train stream handed out, epochs included (an epoch is K per rank)."""
    per_epoch = -(-TRAIN_RECORDS // (world * RANK_BATCH))
    return state["epoch"] * per_epoch + state["batches_done"]


# -- fixtures -------------------------------------------------------------------------------------

def with_long_queries(raw: Path, out: Path) -> Path:
    """The demo's training records with every LONG_EVERY-th query far longer than the stream's
    max_tokens: the length policy drops them (criteria and query are never cut), and length
    grouping sorts them together, so some micro batches lose examples and some are emptied."""
    lines = raw.read_text().splitlines()
    records = []
    for i, line in enumerate(lines):
        record = json.loads(line)
        if i % LONG_EVERY == 0:
            long_query = record["model_a"][0]["content"] + " Also, in detail:" + " tell me more" * 400
            for side in ("model_a", "model_b"):
                record[side][0]["content"] = long_query
        records.append(json.dumps(record))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(records) + "\n")
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """CRM_ROOT of every run here: the demo data generated once into its .cache, and DATA: the
    same records with long queries (with_long_queries), sharded as the demo shards them (the same
    keys, so the same train/val split)."""
    root = tmp_path_factory.mktemp("crm_dist")
    with initialize_config_module(version_base="1.3", config_module="crm_configs"):
        cfg = compose("train", overrides=[*DEMO, f"paths.root_dir={root}"])
    prepare_demo(DemoConfig(**cfg.data.demo))
    raw = Path(cfg.data.demo.out_dir) / "raw" / "train.jsonl"
    shard([str(with_long_queries(raw, root / "long" / "train.jsonl"))], root / LONG_SHARDS,
          shard_size=1000)
    manifest = load_manifest(root / LONG_SHARDS)
    eligible = {split: sum(s.eligible(keep_ties=False) for s in manifest.shards(split))
                for split in ("train", "val")}
    assert eligible == {"train": TRAIN_RECORDS, "val": 16}, eligible  # see DEMO
    return root


class SharedRuns:
    """The 20-step runs several tests compare, each run on first use (the FSDP run's with the
    one-process reference beside it), all from one pretrained checkpoint (PRETRAINED): each FSDP
    rank reads its slices into its shards and draws the fresh head one process draws. (Random
    init at several ranks is the HSDP job's, against its own one-process reference.)"""

    def __init__(self, root: Path):
        self.root = root

    @cached_property
    def fsdp(self) -> Path:
        fsdp = begin(self.root, "fsdp", *FSDP, *CURVE, *pretrained(self.root), *probe("fsdp"), ranks=2)
        if "reference" in self.__dict__:
            return finish(fsdp)[0]
        fsdp, self.reference = finish(fsdp, self._reference())
        return fsdp

    @cached_property
    def ddp(self) -> Path:
        return train(self.root, "ddp", *DDP, *CURVE, *pretrained(self.root), ranks=2)

    @cached_property
    def reference(self) -> Path:
        return finish(self._reference())[0]

    def _reference(self):
        """One process; step k trains on rank 0's + rank 1's batch k of the 2-rank runs."""
        return begin(self.root, "reference", "micro_batch_size=8", "global_batch_size=8", *CURVE,
                     *pretrained(self.root), script=REFERENCE)


def pretrained(root: Path) -> list[str]:
    """The overrides that start a run from the module's tiny pretrained base (written on first use)."""
    base = root / "base_checkpoint"
    if not base.is_dir():
        save_tiny_base(base)
    return [f"model.path={base}"]


@pytest.fixture(scope="module")
def runs(root) -> SharedRuns:
    return SharedRuns(root)


# -- 1. sharding ----------------------------------------------------------------------------------

@slow
@ranks
def test_fsdp_shards_parameters_and_optimizer_states(runs):
    fsdp, ddp, single = (metrics(r)["train"] for r in (runs.fsdp, runs.ddp, runs.reference))
    assert fsdp["world_size"] == ddp["world_size"] == 2 and single["world_size"] == 1
    (full,) = single["per_rank_memory"]
    assert full["param_bytes"] > 0 and full["optimizer_bytes"] >= 2 * full["param_bytes"]  # AdamW
    assert [r["rank"] for r in fsdp["per_rank_memory"]] == [0, 1]
    for rank in fsdp["per_rank_memory"]:
        for kind in ("param_bytes", "optimizer_bytes"):
            ratio = rank[kind] / full[kind]
            print(f"FSDP rank {rank['rank']} {kind}: {rank[kind]} / {full[kind]} = {ratio:.4f}")
            assert 0.45 <= ratio <= 0.55, (rank, full)
    for rank in ddp["per_rank_memory"]:  # DDP replicates: every rank holds everything
        assert (rank["param_bytes"], rank["optimizer_bytes"]) == (full["param_bytes"],
                                                                  full["optimizer_bytes"])
    # The run's record (crm/cli/record.py), written by rank 0 once the ranks agreed on the resume
    from omegaconf import OmegaConf

    assert "- trainer=fsdp" in (runs.fsdp / ".hydra" / "overrides.yaml").read_text().splitlines()
    assert OmegaConf.load(runs.fsdp / ".hydra" / "config.yaml").trainer.devices == 2


# -- 2. loss curves -------------------------------------------------------------------------------

@slow
@ranks
def test_fsdp_ddp_and_one_process_from_a_pretrained_checkpoint_agree_on_the_same_global_batches(runs):
    (f_train, f_val), (d_train, d_val), (r_train, r_val) = (
        curves(r) for r in (runs.fsdp, runs.ddp, runs.reference))
    for run in (runs.fsdp, runs.ddp, runs.reference):
        config = checkpoint_meta(run / "checkpoints" / "last.ckpt")["crm_config"]
        assert config["model"]["path"] == pretrained(runs.root)[0].removeprefix("model.path=")
    assert sorted(f_train) == list(range(1, STEPS + 1)) and sorted(f_val) == list(range(4, STEPS + 1, 4))
    assert max(f_train.values()) - min(f_train.values()) > 0.1  # the model trains (the curve moves)
    figures = {"fsdp-ddp train": max_diff(f_train, d_train), "fsdp-ddp val": max_diff(f_val, d_val),
               "ddp-one train": max_diff(d_train, r_train), "ddp-one val": max_diff(d_val, r_val),
               "fsdp-one train": max_diff(f_train, r_train), "fsdp-one val": max_diff(f_val, r_val)}
    print(f"max |loss difference| over {STEPS} steps:", {k: f"{v:.2e}" for k, v in figures.items()})
    for name, diff in figures.items():
        assert diff <= LOSS_ATOL, (name, diff)
    # The first steps agree far more closely (the same initial weights, the pretrained ones in the
    # shards, the same fresh head): differences are rounding, amplified by training.
    assert max(abs(f_train[k] - r_train[k]) for k in range(1, 4)) <= 1e-6
    # The length policy dropped records, emptying some micro batches of one rank and not the
    # other's: the runs neither hung nor weighed examples by where they landed.
    dropped = logged(runs.fsdp, "data/dropped")
    assert dropped and dropped[-1][1] > 0
    rank0, rank1 = probe_report(runs.root, "fsdp")["examples"]
    assert len(rank0) == len(rank1) == STEPS and max(rank0 + rank1) == RANK_BATCH
    assert any(min(a, b) == 0 < max(a, b) for a, b in zip(rank0, rank1)), (rank0, rank1)
    assert any(a == b == 0 for a, b in zip(rank0, rank1)), (rank0, rank1)  # a step of no example
    # Same data: the runs saw the same number of records at every step.
    for run in (runs.fsdp, runs.ddp):
        state = stream_state(checkpoint_meta(run / "checkpoints" / "last.ckpt"))
        assert batches_consumed(state, world=2) == STEPS


# -- 3. consolidated export -----------------------------------------------------------------------

def assert_export_holds(export_dir: Path, checkpoint: Path | str) -> None:
    """The export's weights are exactly the checkpoint's (a file, or a sharded dir consolidated)."""
    from safetensors.torch import load_file

    exported = load_file(export_dir / "model.safetensors")
    loaded = load_checkpoint(checkpoint)
    saved = model_weights(loaded)
    assert json.loads((export_dir / "crm.json").read_text())["global_step"] == loaded["global_step"]
    assert exported and set(exported) <= set(saved)
    for key, tensor in exported.items():
        torch.testing.assert_close(tensor, saved[key], rtol=0, atol=0, msg=key)


def export_logits(export_dir: Path) -> torch.Tensor:
    """Plain transformers on a padded batch of demo-like prompts."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(export_dir, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(export_dir, local_files_only=True)
    assert model.config.pad_token_id == tokenizer.pad_token_id is not None
    texts = ["Criteria: answers concisely. Query: how do I boil an egg? A: nine minutes. B: no idea.",
             "Criteria: is friendly. Query: hi? A: hello there, how can I help? B: what.",
             "short"]
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        return model.eval()(**batch).logits


@slow
@ranks  # the shared FSDP run, when no test before this one started it
def test_fsdp_checkpoints_export_consolidated_to_plain_transformers(runs, tmp_path):
    from crm.models.checkpoint import export_checkpoint

    # The run's own export (its best checkpoint, a sharded dir) against the other two runs'.
    exports = {name: getattr(runs, name) / "export" for name in ("fsdp", "ddp", "reference")}
    steps = {name: json.loads((d / "crm.json").read_text())["global_step"]
             for name, d in exports.items()}
    assert len(set(steps.values())) == 1, steps  # the same best step everywhere
    assert_export_holds(exports["fsdp"], runs.fsdp / "checkpoints" / "best.ckpt")  # sharded
    logits = {name: export_logits(d) for name, d in exports.items()}

    # crm-export of the last (sharded) checkpoint: the CLI, consolidating without a process group.
    out = tmp_path / "fsdp_last"
    proc = subprocess.run([str(BIN / "crm-export"), str(runs.fsdp / "checkpoints" / "last.ckpt"),
                           str(out)], env=run_env(tmp_path), capture_output=True, text=True,
                          timeout=RUN_TIMEOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((out / "crm.json").read_text())["global_step"] == STEPS
    export_checkpoint(runs.reference / "checkpoints" / "last.ckpt", tmp_path / "reference_last")
    export_checkpoint(runs.ddp / "checkpoints" / "last.ckpt", tmp_path / "ddp_last")
    for name in ("fsdp_last", "reference_last", "ddp_last"):
        logits[name] = export_logits(tmp_path / name)

    assert logits["fsdp"].shape == (3, 2)
    if steps["fsdp"] != STEPS:  # other weights give other logits: the comparisons below can fail
        assert (logits["fsdp"] - logits["fsdp_last"]).abs().max() > 1e-4
    figures = {pair: (logits[pair[0]] - logits[pair[1]]).abs().max().item() for pair in [
        ("fsdp", "reference"), ("fsdp", "ddp"), ("ddp", "reference"),
        ("fsdp_last", "reference_last"), ("fsdp_last", "ddp_last")]}
    print("max |logit difference|:", {"-".join(k): f"{v:.2e}" for k, v in figures.items()})
    for pair, diff in figures.items():
        assert diff <= LOGIT_ATOL, (pair, diff)


@slow
@ranks  # the shared FSDP run, when no test before this one started it
def test_a_scorer_reads_an_fsdp_sharded_checkpoint_as_it_is(runs, root, tmp_path):
    """CRMScorer straight from the shards (no export first), as from that checkpoint's export, and
    as from the DDP run's single-file checkpoint of the same step."""
    from crm.core.records import load_records
    from crm.core.examples import eval_example
    from crm.inference.scorer import CRMScorer
    from crm.models.checkpoint import export_checkpoint

    sharded = runs.fsdp / "checkpoints" / "last.ckpt"
    assert sorted(p.name for p in sharded.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    test_file = root / ".cache" / "demo" / "raw" / "test" / "in_distribution.jsonl"
    examples = [eval_example(r) for r in load_records(test_file, "test")[:16]]
    cpu = {"device": torch.device("cpu"), "dtype": torch.float32}
    probs = CRMScorer.load(sharded, **cpu).pair_probabilities(examples)
    exported = export_checkpoint(sharded, tmp_path / "export")
    torch.testing.assert_close(CRMScorer.load(exported, **cpu).pair_probabilities(examples), probs,
                               rtol=0, atol=0)
    ddp = CRMScorer.load(runs.ddp / "checkpoints" / "last.ckpt", **cpu).pair_probabilities(examples)
    print(f"sharded vs DDP checkpoint: max |P difference| {(probs - ddp).abs().max().item():.2e}")
    torch.testing.assert_close(ddp, probs, rtol=0, atol=LOGIT_ATOL)
    assert probs[:, :2].sum(1).allclose(torch.ones(len(examples)))


# -- 4. a simulated 2-node SLURM job --------------------------------------------------------------

def slurm_job(root: Path, job_id: str, ntasks: int, *overrides: str, path_prefix=None,
              tag: str = "", per_node: int = 1, **env: str) -> tuple[Proc, ...]:
    port = free_port()
    return tuple(Proc(crm_train_cmd(*overrides), slurm_env(root, job_id, rank, ntasks, port,
                                                          path_prefix, per_node, **env),
                      root / "logs" / f"slurm-{job_id}{tag}-{rank}.log")
                 for rank in range(ntasks))


# 2 nodes x 2 ranks, 2 records a micro batch, 16 a step (accumulation 2): one epoch is 45 micro
# batches a rank (360 / 4 / 2), 23 optimizer steps, the last of one micro batch. FSDP over 2 ranks,
# 4 records a micro batch: 45 micro batches a rank again (a run resumes at another world size from
# an epoch end, where Lightning's loop and the stream agree on the epoch's length).
HSDP_JOB = ["trainer=fsdp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.num_nodes=2",
            "parallel.param_dtype=float32", "micro_batch_size=2", "global_batch_size=16",
            "val_every_n_steps=10", "save_every_n_steps=23"]
EPOCH_STEPS, UNITS = 23, 3  # FSDP units: 2 decoder layers + the root


def hsdp_job(root: Path, job_id: str, *overrides: str) -> Path:
    """A simulated SLURM job of 2 nodes x 2 tasks to its end; its run dir."""
    procs = slurm_job(root, job_id, 4, *HSDP_JOB, *probe(job_id), *overrides, per_node=2)
    with cleanup(*procs):
        for p in procs:
            p.assert_ok()
    return root / "outputs" / job_id  # the job id names the run dir under SLURM


def assert_same_state(loaded: dict, saved: dict) -> None:
    """A resumed run's state at its start is the state the other run saved: weights exactly, the
    AdamW moments to fp32 rounding (resharded over another mesh, then summed here)."""
    assert loaded.keys() == saved.keys() and any(k.startswith("exp_avg:") for k in saved)
    for key, (total, size) in saved.items():
        tol = 0.0 if key.startswith("weight:") else 1e-6 * size + 1e-12
        assert abs(loaded[key][0] - total) <= tol and abs(loaded[key][1] - size) <= tol, key


def test_hsdp_refuses_shard_groups_that_span_nodes():
    from crm.training.parallel import check_shard_groups_within_nodes

    check_shard_groups_within_nodes(["0", "0", "1", "1"], per_node=2)  # srun --distribution=block
    # cyclic: ranks dealt round robin, every shard group across both nodes
    with pytest.raises(ConfigError, match=r"ranks 0-1 \(one shard group\) run on nodes 0, 1, not one"):
        check_shard_groups_within_nodes(["0", "1", "0", "1"], per_node=2)


@pytest.fixture(scope="module")
def hsdp(root) -> tuple[Path, Path]:
    """The 2x2 job to its epoch's end, and its one-process reference, started beside it: the
    union of the 4 ranks' 2 micro batches a step."""
    reference = begin(root, "reference_4x2", "micro_batch_size=16", "global_batch_size=16",
                      f"trainer.max_steps={EPOCH_STEPS}", "val_every_n_steps=10",
                      "save_every_n_steps=1000", script=REFERENCE, REFERENCE_WORLD="4",
                      REFERENCE_ACCUMULATION="2")
    # sharding=auto: several nodes of several ranks (CPU: no device memory to plan against) -> hsdp
    job = slurm_job(root, "4242", 4, *HSDP_JOB, *probe("4242"), f"trainer.max_steps={EPOCH_STEPS}",
                    per_node=2)
    return tuple(finish((root / "outputs" / "4242", job), reference))


@slow
@ranks
def test_hsdp_on_two_simulated_nodes_trains_as_one_process(root, hsdp):
    hsdp, reference = hsdp
    m = metrics(hsdp)["train"]
    assert m["world_size"] == 4 and m["global_step"] == EPOCH_STEPS
    assert (m["micro_batch_size"], m["accumulation"]) == (2, 2)
    last = hsdp / "checkpoints" / "last.ckpt"
    assert checkpoint_meta(last)["crm_config"]["parallel"]["sharding"] == "hsdp"
    assert sorted(p.name for p in last.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]
    (h_train, h_val), (r_train, r_val) = curves(hsdp), curves(reference)
    assert sorted(h_train) == list(range(1, EPOCH_STEPS + 1)) and sorted(h_val) == [10, 20]
    figures = {"train": max_diff(h_train, r_train), "val": max_diff(h_val, r_val)}
    print(f"HSDP 2x2 (accumulation 2) vs one process: max |loss difference| over {EPOCH_STEPS} "
          f"steps: {figures}")
    assert max(figures.values()) <= LOSS_ATOL
    # Within a node, a reduce-scatter per FSDP unit and micro batch (45 of them); across nodes,
    # one all-reduce per unit and optimizer step.
    counts = probe_report(root, "4242")["counts"]
    assert counts["reduce_scatter/2"] == UNITS * 45 and counts["all_reduce/2"] == UNITS * EPOCH_STEPS
    # Hydra's train.log is rank 0's; the other ranks write their own.
    logs = {p.name: p.read_text() for p in hsdp.glob("train*.log")}
    assert set(logs) == {"train.log", "train.rank1.log", "train.rank2.log", "train.rank3.log"}
    assert all(text.count("FSDP2: 2 decoder layers") == 1 for text in logs.values()), logs


@slow
@ranks
def test_hsdp_checkpoints_resume_under_fsdp_at_world_2_and_back(root, hsdp):
    hsdp, _ = hsdp
    # HSDP 2x2 -> FSDP 2 ranks (accumulation 2) through its epoch; then FSDP -> HSDP for one step.
    fsdp = train(root, "fsdp_from_hsdp", *FSDP, "micro_batch_size=4", "global_batch_size=16",
                 f"resume={hsdp / 'checkpoints' / 'last.ckpt'}", f"trainer.max_steps={2 * EPOCH_STEPS}",
                 "val_every_n_steps=10", f"save_every_n_steps={EPOCH_STEPS}", *probe("fsdp_from_hsdp"),
                 ranks=2)
    saved, loaded = probe_report(root, "4242"), probe_report(root, "fsdp_from_hsdp")
    assert_same_state(loaded["start"], saved["end"])
    m = metrics(fsdp)["train"]
    assert (m["world_size"], m["accumulation"], m["global_step"]) == (2, 2, 2 * EPOCH_STEPS)
    # One reduce-scatter per FSDP unit and optimizer step, not per micro batch (45).
    assert loaded["counts"]["reduce_scatter/2"] == UNITS * EPOCH_STEPS, loaded["counts"]
    # The second epoch, after one of 45 micro batches (its last step one micro batch): validation
    # still every 10 optimizer steps, at their ends (a count of micro batches drifts mid-step).
    for events in loaded["events"]:
        assert [e for e in events if e[0].startswith("validation")] == [
            ["validation", 30], ["validation", 40]], events
    # Its best checkpoint, saved by that validation, resumes (at the same world: mid-epoch).
    best = fsdp / "checkpoints" / "best.ckpt"
    best_step = checkpoint_meta(best)["global_step"]
    from_best = train(root, "fsdp_from_best", *FSDP, "micro_batch_size=4", "global_batch_size=16",
                      f"resume={best}", f"trainer.max_steps={best_step + 1}",
                      "val_every_n_steps=1000", "save_every_n_steps=1000", "export=false", ranks=2)
    assert metrics(from_best)["train"]["resumed_from"] == str(best)
    assert metrics(from_best)["train"]["global_step"] == best_step + 1

    back = hsdp_job(root, "4243", f"resume={fsdp / 'checkpoints' / 'last.ckpt'}",
                    f"trainer.max_steps={2 * EPOCH_STEPS + 1}")
    assert_same_state(probe_report(root, "4243")["start"], loaded["end"])
    assert metrics(back)["train"]["global_step"] == 2 * EPOCH_STEPS + 1


# -- 5. preemption --------------------------------------------------------------------------------

def fake_scontrol(tmp_path: Path) -> tuple[Path, Path]:
    """A bin dir whose `scontrol` appends its arguments to a file; (bin dir, that file)."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "scontrol.calls"
    bin_dir.mkdir()
    script = bin_dir / "scontrol"
    script.write_text(f'#!/bin/sh\necho "$@" >> "{calls}"\n')
    script.chmod(0o755)
    return bin_dir, calls


SIGNAL_STEP, LOG_EVERY = 5, 3  # the signal lands in step 5; train/loss and perf/* every 3 steps


def assert_no_sync_on_micro_batches_that_do_not_log(census: list[list[dict]]) -> dict:
    """Per rank, every micro batch before the signal's step that does not log: no `.item()`, no
    `.tolist()`, no barrier, and no collective but the step's example count (its first micro
    batch) and the preemption flags (its last, on the CPU group). The counts per optimizer step
    of a logging step and of another, rank 0's, for docs/PERFORMANCE.md. The optimizer's own
    reads (`item/optimizer`: torch's CPU AdamW reads its CPU step counters; crm's fused AdamW on
    CUDA reads none) are left out."""
    per_step: dict[int, dict] = {}
    for rank, windows in enumerate(census):
        assert [w["step"] for w in windows][:4] == [1, 1, 2, 2], windows[:4]  # accumulation 2
        for w in windows:
            if w["step"] >= SIGNAL_STEP:
                continue  # the signal's step: its save (barriers, broadcasts), then the stop
            last = w["step_index"] == w["step_batches"] - 1
            if rank == 0:
                totals = per_step.setdefault(w["step"], {})
                for kind, n in w["counts"].items():
                    totals[kind] = totals.get(kind, 0) + n
            if last and w["step"] % LOG_EVERY == 0:
                continue  # a logging step's last micro batch: its sums reduced and read
            expected = {"all_reduce/world": 1} if w["step_index"] == 0 else {}
            if last:  # started without waiting: read at the next step's end
                expected["all_reduce/flags-async"] = 1
            counts = {k: n for k, n in w["counts"].items() if k != "item/optimizer"}
            assert counts == expected, (rank, w)
    logging = per_step[LOG_EVERY]
    assert logging.get("item", 0) + logging.get("tolist", 0) > 0, logging  # the census sees reads
    return {"logging step": logging, "other step": per_step[1]}


@slow
@pytest.mark.parametrize("ntasks,signalled,signame", [
    pytest.param(1, 0, "SIGTERM", id="1-task-sigterm"),
    pytest.param(2, 1, "SIGUSR1", id="2-nodes-one-signalled", marks=ranks)])
def test_preemption_saves_at_a_step_boundary_and_the_requeued_job_resumes(
        root, tmp_path, ntasks, signalled, signame):
    bin_dir, calls = fake_scontrol(tmp_path)
    job_id = f"77{ntasks}"
    # Accumulation 2 either way: the signal lands between the micro batches of a step. One task:
    # SIGTERM (Lightning's own handler replaced); two: FSDP over 2 nodes, one rank warned.
    if ntasks == 1:
        setup = ["trainer=cpu", "micro_batch_size=4", "global_batch_size=8"]
    else:
        setup = ["trainer=fsdp", "trainer.accelerator=cpu", "trainer.devices=1",
                 "trainer.num_nodes=2", "parallel.param_dtype=float32", "micro_batch_size=2",
                 "global_batch_size=8"]
    accum = 2
    # A periodic last.ckpt due at the signal's step too: still one save there.
    command = [*setup, "val_every_n_steps=1000", f"save_every_n_steps={SIGNAL_STEP}", "resume=auto",
               f"trainer.log_every_n_steps={LOG_EVERY}", f"perf.log_every_n_steps={LOG_EVERY}",
               *probe(f"preempt{ntasks}")]
    procs = slurm_job(root, job_id, ntasks, *command, "trainer.max_steps=200",
                      path_prefix=bin_dir, tag="-first",
                      PROBE_SIGNAL=f"{signalled}:{SIGNAL_STEP}:{signame}")
    run_dir = root / "outputs" / job_id
    last = run_dir / "checkpoints" / "last.ckpt"
    with cleanup(*procs):
        for p in procs:
            p.assert_ok()  # every rank stops, signalled or not
    first = metrics(run_dir)
    # One process reads its flag at the end of the signalled step; ranks read the flags' all-reduce
    # started there at the end of the next step (crm/training/preemption.py: no host barrier).
    saved_at = SIGNAL_STEP if ntasks == 1 else SIGNAL_STEP + 1
    assert first["preempted"] is True and first["train"]["global_step"] == saved_at
    report = probe_report(root, f"preempt{ntasks}")
    # The signalled rank got it mid-step; every rank saved once more after it, at saved_at (the
    # periodic last.ckpt due at the signal's step still saved there, the flag not yet read), and
    # nothing validated or saved after that.
    preemption_save = [["save", saved_at]]
    due = [["save", SIGNAL_STEP]] if saved_at != SIGNAL_STEP else []
    for rank, events in enumerate(report["events"]):
        after = events[events.index(["signal", SIGNAL_STEP]) + 1:] if rank == signalled else [
            e for e in events if e[1] >= SIGNAL_STEP]
        assert after == due + preemption_save, (rank, events)
    requeues = calls.read_text().splitlines() if calls.exists() else []
    assert requeues == ([f"requeue {job_id}"] if signame == "SIGUSR1" else [])  # once, by rank 0
    assert is_complete_checkpoint(last) and last.is_dir() == (ntasks == 2)
    ckpt = checkpoint_meta(last)
    assert ckpt["global_step"] == saved_at
    # The stream position is the trained one: each record of the interrupted epoch once.
    state = stream_state(ckpt)
    assert batches_consumed(state, world=ntasks) == saved_at * accum, state
    assert not (run_dir / "export").exists()  # the requeued job exports
    if ntasks == 1:
        return  # SIGTERM asks no requeue; the 2-node case resumes (a file: test_train.py's resume)
    figures = assert_no_sync_on_micro_batches_that_do_not_log(report["census"])
    print(f"census per optimizer step, rank 0 (accumulation 2): {figures}")

    # The requeued job: the same command and job id (save every step to see the final position).
    procs = slurm_job(root, job_id, ntasks, *command, f"trainer.max_steps={SIGNAL_STEP + 3}",
                      "save_every_n_steps=1", path_prefix=bin_dir, tag="-requeued",
                      PROBE_SIGNAL="")
    with cleanup(*procs):
        for p in procs:
            p.assert_ok()
    second = metrics(run_dir)
    assert second["preempted"] is False
    assert second["train"]["resumed_from"] == str(last)
    assert second["train"]["global_step"] == SIGNAL_STEP + 3
    assert second["train"]["world_size"] == ntasks
    assert batches_consumed(stream_state(checkpoint_meta(last)), world=ntasks) == (SIGNAL_STEP + 3) * accum
    assert requeues == (calls.read_text().splitlines() if calls.exists() else [])  # no new requeue
    history = curves(run_dir)[0]
    # One loss history, logged every 3 steps (and at the preempted run's end, by Lightning)
    assert {3, 6} <= set(history) <= set(range(1, SIGNAL_STEP + 4)), sorted(history)
    # The export holds the final weights, last.ckpt's (the preempted run validated nothing, so it
    # left no best.ckpt), and rank 0 wrote it after every rank had left the process group: no
    # rank waited in a collective meanwhile.
    assert json.loads((run_dir / "export" / "crm.json").read_text())["source"].startswith("final")
    assert_export_holds(run_dir / "export", last)
    log = (run_dir / "train.log").read_text()
    assert log.index("left the process group") < log.index("exporting"), log[-3000:]


# -- 6. kill -9 and resume ------------------------------------------------------------------------

def test_resume_auto_ignores_incomplete_sharded_checkpoints(tmp_path):
    ckpts = tmp_path / "checkpoints"

    def sharded(name: str, complete: bool) -> Path:
        d = ckpts / name
        d.mkdir(parents=True)
        (d / "__0_0.distcp").write_bytes(b"x")
        (d / ".metadata").write_bytes(b"x")
        if complete:
            (d / SHARDED_META).write_bytes(b"x")
        return d

    partial = sharded("last.ckpt.partial", complete=False)  # killed mid-save, nothing else
    assert resolve_resume("auto", tmp_path) is None
    last = sharded("last.ckpt", complete=True)
    assert resolve_resume("auto", tmp_path) == str(last)
    shutil.rmtree(last)
    shutil.rmtree(partial)
    # Killed between the swap's renames: the old one moved aside, the new complete one not yet in.
    old = sharded("last.ckpt.old", complete=True)
    partial = sharded("last.ckpt.partial", complete=True)
    assert resolve_resume("auto", tmp_path) == str(partial)
    (partial / SHARDED_META).unlink()
    assert resolve_resume("auto", tmp_path) == str(old)
    with pytest.raises(ConfigError, match="incomplete"):
        resolve_resume(str(partial), tmp_path)


def test_every_rank_resumes_from_rank_0s_choice_whatever_it_sees(tmp_path):
    from types import SimpleNamespace

    from crm.training.trainer import AgreedResume

    seen_by_rank_1 = tmp_path / "rank1"  # this rank sees a complete last.ckpt; rank 0 saw none
    last = seen_by_rank_1 / "checkpoints" / "last.ckpt"
    last.mkdir(parents=True)
    for name in ("__0_0.distcp", ".metadata", SHARDED_META):
        (last / name).write_bytes(b"x")
    assert resolve_resume("auto", seen_by_rank_1) == str(last)
    sent = []

    def broadcast(obj, src=0):  # rank 0's message: its choice (None) and no error
        sent.append(obj)
        return (None, None)

    resume = AgreedResume("auto", seen_by_rank_1)
    resume.trainer = SimpleNamespace(strategy=SimpleNamespace(global_rank=1, broadcast=broadcast))
    assert resume.decide() is None and sent == [(None, None)]  # rank 1 sent nothing of its own
    resume.decide()
    assert len(sent) == 1  # decided once

    # Rank 0 with a resume path that cannot be read: every rank raises its error, none waits.
    rank0 = AgreedResume(str(tmp_path / "missing.ckpt"), tmp_path)
    rank0.trainer = SimpleNamespace(strategy=SimpleNamespace(global_rank=0, broadcast=lambda o, src=0: o))
    with pytest.raises(ConfigError, match="no such checkpoint"):
        rank0.decide()


def test_a_resumed_run_appends_to_the_csv_history(tmp_path):
    from crm.training.loggers import ResumableCSVLogger

    first = ResumableCSVLogger(save_dir=str(tmp_path), name="csv", version="")
    for step in range(3):
        first.log_metrics({"train/loss": 1.0 + step}, step=step)
    first.save()
    resumed = ResumableCSVLogger(save_dir=str(tmp_path), name="csv", version="")
    resumed.log_metrics({"train/loss": 2.5}, step=2)  # run again after a crash
    resumed.save()
    resumed.log_metrics({"train/loss": 4.0, "val/loss": 5.0}, step=3)  # a new column
    resumed.save()
    assert logged(tmp_path, "train/loss") == [(1, 1.0), (2, 2.0), (3, 3.0), (3, 2.5), (4, 4.0)]
    assert logged(tmp_path, "val/loss") == [(4, 5.0)]
    assert sorted(p.name for p in (tmp_path / "csv").iterdir()) == ["metrics.csv"]


@slow
@ranks
def test_kill_9_mid_run_then_resume_auto_retraces_the_uninterrupted_run(root, runs):
    name = "fsdp_killed"
    run_dir = root / "outputs" / name
    ckpts = run_dir / "checkpoints"
    last, partial = ckpts / "last.ckpt", ckpts / "last.ckpt.partial"
    procs = start(root, f"{name}-killed", crm_train_cmd(f"name={name}", *FSDP, *CURVE, *pretrained(root)),
                  ranks=2)
    with cleanup(*procs):
        wait_for(lambda: is_complete_checkpoint(last), procs, RUN_TIMEOUT, "first last.ckpt")
        # Then kill both ranks while the next checkpoint is being written (.partial exists).
        wait_for(partial.exists, procs, RUN_TIMEOUT, "a second checkpoint save", interval=0.002)
        for proc in procs:
            proc.signal(signal.SIGKILL, group=True)
        for proc in procs:
            proc.wait()
    assert procs[0].popen.returncode == -signal.SIGKILL
    assert not (run_dir / "metrics.json").exists()
    left = {p.name: is_complete_checkpoint(p) for p in ckpts.glob("last.ckpt*")}
    # last.ckpt (or, killed between the swap's two renames, a complete .partial or .old)
    expected = resolve_resume("auto", run_dir)
    assert expected is not None, left
    resume_step = checkpoint_meta(expected)["global_step"]
    assert resume_step in range(5, STEPS, 5), resume_step
    killed_rows = len(logged(run_dir, "train/loss"))
    assert killed_rows > resume_step  # the killed run had trained past its checkpoint

    rerun = train(root, name, *FSDP, *CURVE, *pretrained(root), ranks=2)
    m = metrics(rerun)["train"]
    assert m["global_step"] == STEPS and m["resumed_from"] == expected
    assert checkpoint_meta(last)["global_step"] == STEPS  # rewritten by the rerun
    assert sorted(p.name for p in last.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]  # per rank
    assert batches_consumed(stream_state(checkpoint_meta(last)), world=2) == STEPS
    assert not partial.exists() and not (ckpts / "last.ckpt.old").exists()
    rerun_steps = [step for step, _ in logged(rerun, "train/loss")[killed_rows:]]
    assert rerun_steps == list(range(resume_step + 1, STEPS + 1))  # from the step after its checkpoint
    # The whole curve (the killed run's steps, then the rerun's) is the uninterrupted run's.
    resumed_train, resumed_val = curves(rerun)
    full_train, full_val = curves(runs.fsdp)
    train_diff, val_diff = max_diff(resumed_train, full_train), max_diff(resumed_val, full_val)
    print(f"killed after {killed_rows} logged steps, mid-save (checkpoints left: {left}); resumed "
          f"from step {resume_step}: max |train/loss diff| {train_diff:.2e}, "
          f"|val/loss diff| at {STEPS} {abs(resumed_val[STEPS] - full_val[STEPS]):.2e}")
    assert train_diff <= 1e-6 and val_diff <= 1e-6
