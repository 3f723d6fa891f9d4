"""The SLURM launch files: launch/*.sbatch, launch/sweep.sh, configs/hydra/launcher/slurm.yaml and
SLURM.md.

The scripts run for real under bash with a fake `srun` and `scontrol` on PATH (no cluster here):
`srun` records its command line and environment (or, in the slow test, starts one crm-train
process per task as srun would), `scontrol` answers `show hostnames`, `show job` and `requeue` from
files. Every crm-* command line the scripts build, and every one SLURM.md shows, is composed with
the real configs; the submitit launcher renders the sbatch file it would submit.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

# Each command's module registers its config's schema, which the config's defaults name.
import crm.cli.eval
import crm.cli.leaderboard
import crm.cli.plan
import crm.cli.train
import crm.cli.usl  # noqa: F401
import crm_configs
from crm.cli.scorer import checkpoint_argument
from crm.training.config import DeviceSettings
from crm.training.resolve import batch_plan, world_size

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "launch"
TRAIN_SBATCH, EVAL_SBATCH, SWEEP = LAUNCH / "train.sbatch", LAUNCH / "eval.sbatch", LAUNCH / "sweep.sh"
LAUNCHER_YAML = Path(crm_configs.__file__).parent / "hydra" / "launcher" / "slurm.yaml"
SLURM_MD = REPO / "SLURM.md"
SUBMITIT_TARGET = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
ENV_KEYS = ["MASTER_ADDR", "MASTER_PORT", "SRUN_CPUS_PER_TASK", "WANDB_MODE", "CRM_ROOT",
            "HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"]


def compose_cfg(config: str, overrides: list[str], hydra_node: bool = False):
    with initialize_config_module(version_base="1.3", config_module="crm_configs"):
        return compose(config, overrides=overrides, return_hydra_config=hydra_node)


def needs_submitit():
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher",
                        reason="hydra-submitit-launcher not installed (pip install -e '.[slurm]')")


# -- a fake SLURM ---------------------------------------------------------------------------------

FAKE_SRUN = '''\
#!{python}
import json, os, signal, subprocess, sys, time
state = os.environ["FAKE_SLURM_DIR"]
args, opts = sys.argv[1:], []
while args and args[0].startswith("-"):
    opts.append(args.pop(0))
with open(os.path.join(state, "srun.calls"), "a") as f:
    f.write(json.dumps({{"opts": opts, "argv": args,
                        "env": {{k: os.environ.get(k) for k in {env_keys!r}}}}}) + "\\n")
if not os.environ.get("FAKE_SRUN_SPAWN"):  # record only: write what the test asks for, exit
    if os.environ.get("FAKE_SRUN_SLEEP"):  # a step that runs until SLURM's SIGTERM
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        time.sleep(float(os.environ["FAKE_SRUN_SLEEP"]))
    if os.environ.get("FAKE_METRICS"):
        path = os.path.join(os.environ["CRM_ROOT"], "outputs", os.environ["SLURM_JOB_ID"], "metrics.json")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(os.environ["FAKE_METRICS"])
    sys.exit(int(os.environ.get("FAKE_SRUN_RC", "0")))
# Spawn: one process per task, each in its own session (slurmstepd signals a task's processes).
nodes, per = int(os.environ["SLURM_NNODES"]), int(os.environ["SLURM_NTASKS_PER_NODE"])
n, procs = nodes * per, []
for rank in range(n):
    env = dict(os.environ, SLURM_NTASKS=str(n), SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank % per),
               SLURM_NODEID=str(rank // per), SLURM_STEP_ID="0")
    log = open(os.path.join(state, "task%d.log" % rank), "ab")
    procs.append(subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, start_new_session=True))
with open(os.path.join(state, "task.pids"), "w") as f:
    f.write("\\n".join(str(p.pid) for p in procs) + "\\n")
codes = [p.wait() for p in procs]
sys.exit(next((c if c > 0 else 128 - c for c in codes if c), 0))
'''

FAKE_SCONTROL = '''\
#!/bin/sh
d=$FAKE_SLURM_DIR
echo "$@" >> "$d/scontrol.calls"
restarts=$(cat "$d/restarts" 2>/dev/null || echo 0)
case "$1 $2" in
  "show hostnames") for host in ${FAKE_HOSTNAMES:-node-a node-b}; do echo "$host"; done ;;
  "show job") echo "JobId=$3 JobName=crm-train Requeue=1 Restarts=$restarts BatchFlag=1" ;;
  requeue*) echo $((restarts + 1)) > "$d/restarts"; exit "${FAKE_REQUEUE_RC:-0}" ;;
esac
'''


class FakeSlurm:
    """A bin dir with `srun` and `scontrol`, a fake venv, and the environment of a batch job."""

    def __init__(self, tmp: Path, job_id: int = 4242, nodes: int = 2, tasks_per_node: int = 8):
        self.dir = tmp / "slurm"
        self.bin, self.root, self.submit = self.dir / "bin", tmp / "root", tmp / "submit"
        for d in (self.bin, self.root, self.submit, tmp / "venv" / "bin"):
            d.mkdir(parents=True, exist_ok=True)
        (self.bin / "srun").write_text(FAKE_SRUN.format(python=sys.executable, env_keys=ENV_KEYS))
        (self.bin / "scontrol").write_text(FAKE_SCONTROL)
        for tool in ("srun", "scontrol"):
            (self.bin / tool).chmod(0o755)
        # The scripts `source $CRM_VENV/bin/activate`: this one puts the test's crm-* on PATH.
        self.venv = tmp / "venv"
        (self.venv / "bin" / "activate").write_text(
            f'export PATH="{Path(sys.executable).parent}:$PATH"\n')
        self.job_id = job_id
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("SLURM_", "MASTER_", "WANDB_", "FAKE_", "BENCH",
                                         "BASELINE", "CRITERIA_FILE", "LEADERBOARD_ARGS",
                                         "NCCL_", "GLOO_", "CRM_SOCKET"))}
        self.env.update(
            PATH=f"{self.bin}{os.pathsep}{os.environ['PATH']}", FAKE_SLURM_DIR=str(self.dir),
            CRM_VENV=str(self.venv), CRM_ROOT=str(self.root), SLURM_SUBMIT_DIR=str(self.submit),
            SLURM_JOB_ID=str(job_id), SLURM_JOB_NAME="crm-train", SLURM_NNODES=str(nodes),
            SLURM_NTASKS_PER_NODE=str(tasks_per_node), SLURM_JOB_NODELIST="node-[a-b]",
            SLURM_CPUS_PER_TASK="8", PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
            CRM_PLAN="0")  # crm-plan takes seconds: the one test of the plan's step turns it on

    @property
    def run_dir(self) -> Path:
        return self.root / "outputs" / str(self.job_id)

    def run(self, script: Path, *args: str, timeout: float = 180, **env: str):
        return subprocess.run(["bash", str(script), *args], env={**self.env, **env},
                              capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)

    def srun_calls(self) -> list[dict]:
        path = self.dir / "srun.calls"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def scontrol_calls(self) -> list[str]:
        path = self.dir / "scontrol.calls"
        return path.read_text().splitlines() if path.exists() else []

    def set_restarts(self, n: int) -> None:
        (self.dir / "restarts").write_text(f"{n}\n")


@pytest.fixture
def slurm(tmp_path) -> FakeSlurm:
    return FakeSlurm(tmp_path)


# -- 1. the scripts as files ----------------------------------------------------------------------

SCRIPTS = [TRAIN_SBATCH, EVAL_SBATCH, SWEEP]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_parse(script):
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def sbatch_lines(script: Path) -> list[str]:
    return [line for line in script.read_text().splitlines() if line.startswith("#SBATCH")]


@pytest.mark.parametrize("script", [TRAIN_SBATCH, EVAL_SBATCH], ids=lambda p: p.name)
def test_sbatch_directives_all_come_before_the_first_command(script):
    # sbatch stops reading #SBATCH lines at the first line that is not a comment.
    lines = script.read_text().splitlines()
    first_command = next(i for i, line in enumerate(lines)
                         if line.strip() and not line.lstrip().startswith("#"))
    last_directive = max(i for i, line in enumerate(lines) if line.startswith("#SBATCH"))
    assert last_directive < first_command


def test_train_sbatch_asks_for_what_preemption_and_fsdp_need():
    directives = {line.split()[1].split("=")[0]: line.split()[1] for line in sbatch_lines(TRAIN_SBATCH)}
    for option in ("--nodes", "--ntasks-per-node", "--gpus-per-node", "--cpus-per-task", "--time",
                   "--requeue", "--open-mode", "--signal", "--output"):
        assert option in directives, option
    assert directives["--open-mode"] == "--open-mode=append"
    assert directives["--ntasks-per-node"].split("=")[1] == directives["--gpus-per-node"].split("=")[1]
    # The signal goes to the ranks (no B:) and is the one crm's callback listens to.
    signal_spec = directives["--signal"].split("=", 1)[1]
    assert not signal_spec.startswith(("B:", "R:"))
    assert signal_spec.split("@")[0] == compose_cfg("train", []).preemption.signal
    code = [line for line in TRAIN_SBATCH.read_text().splitlines() if not line.lstrip().startswith("#")]
    assert not any("torchrun" in line or "pip install" in line for line in code)


EDIT_LINES = {
    TRAIN_SBATCH: ["--partition", "--nodes", "--ntasks-per-node", "--gpus-per-node", "--cpus-per-task",
                   "--mem", "--time", "--signal", "--output", "CRM_VENV=", "CRM_ROOT=", "name=",
                   "model.path=", "data.path=", "global_batch_size=", "stream.num_workers=",
                   "stream.max_tokens=", "gpu_memory_gib="],
    EVAL_SBATCH: ["--partition", "--gpus-per-node", "--cpus-per-task", "--mem", "--time", "--output",
                  "CRM_VENV=", "CRM_ROOT="],
    LAUNCHER_YAML: ["partition:", "account:", "timeout_min:", "cpus_per_task:", "mem_gb:"],
}


def sets(line: str, needle: str, yaml_file: bool) -> bool:
    """Whether `line` sets `needle`: an #SBATCH option, a YAML key, or a shell/array assignment."""
    if line.startswith("#SBATCH"):
        return line.split()[1].startswith(needle)
    if needle.startswith("--"):
        return False  # an sbatch option is set on an #SBATCH line only
    code = line.split("#", 1)[0]
    if yaml_file:
        return code.strip().startswith(needle)
    return re.search(rf"(^|\s){re.escape(needle)}", code) is not None


@pytest.mark.parametrize("path", list(EDIT_LINES), ids=lambda p: p.name)
def test_every_line_a_user_must_set_is_marked_edit(path):
    lines = path.read_text().splitlines()
    for needle in EDIT_LINES[path]:
        matching = [line for line in lines if sets(line, needle, path.suffix == ".yaml")]
        assert matching, f"{path.name}: no line sets {needle}"
        assert all("# EDIT:" in line for line in matching), f"{path.name}: {needle} not marked: {matching}"
    for line in lines:
        if "# EDIT:" in line:
            assert line.split("# EDIT:", 1)[1].strip(), f"{path.name}: an empty EDIT note: {line}"


# -- 2. train.sbatch runs ---------------------------------------------------------------------------

def test_train_sbatch_runs_crm_train_with_the_plans_overrides_and_the_users(slurm):
    user = ["experiment=lora", "loss=ranking", "micro_batch_size=2"]
    proc = slurm.run(TRAIN_SBATCH, *user, CRM_PLAN="1")
    assert proc.returncode == 0, proc.stderr
    (call,) = slurm.srun_calls()
    # block: ranks numbered node by node, as HSDP's mesh needs
    for option in ("--kill-on-bad-exit=1", "--wait=0", "--distribution=block"):
        assert option in call["opts"], option
    assert call["argv"][0] == "crm-train"
    overrides = call["argv"][1:]
    assert overrides[:3] == ["trainer=fsdp", "trainer.num_nodes=2", "trainer.devices=8"]
    assert overrides[-3:] == user  # the user's come last: they win
    # crm-plan planned this job's shape for the run as it composes: the run's model, rows and
    # global batch, the user's loss (pointwise: two rows a record) and experiment=lora's LoRA
    # (rank 16), and its overrides come just before the user's
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("recommend: ")]
    planned = line.split()[1:]
    assert overrides[-3 - len(planned):-3] == planned
    plan = json.loads((slurm.root / "outputs" / "plan" / str(slurm.job_id) / "plan.json").read_text())
    assert (plan["model"], plan["kind"], plan["num_nodes"], plan["devices"], plan["seq_len"],
            plan["global_batch_size"], plan["lora_rank"]) == ("qwen3-8b", "pointwise", 2, 8, 4096,
                                                              256, 16)
    assert "parallel.sharding=hsdp" in planned and "stream.max_tokens=4096" in planned
    assert "stream.packing=true" in planned and plan["packing"] is True  # the run's own stream.packing
    assert "parallel.timeout_minutes=30" in planned
    cfg = compose_cfg("train", overrides)
    assert cfg.trainer.strategy == "fsdp" and cfg.trainer.num_nodes == 2 and cfg.trainer.devices == 8
    assert cfg.loss.kind == "pointwise" and cfg.micro_batch_size == 2
    assert cfg.parallel.sharding == "hsdp" and cfg.stream.max_tokens == 4096
    assert world_size(DeviceSettings.of(cfg.trainer), "cuda") == 16
    # The plan's own micro batch divides a rank's share of the script's global batch.
    default = compose_cfg("train", overrides[:-2])
    assert default.micro_batch_size == plan["best"]["micro_batch_size"]
    assert batch_plan(default.global_batch_size, default.micro_batch_size, 16,
                      default.max_micro_batch_size)[1] == 256 // 16 // default.micro_batch_size
    assert default.model.name == "qwen3-8b" and default.data.name == "shards"
    env = call["env"]
    assert env["MASTER_ADDR"] == "node-a"  # the allocation's first node
    assert env["MASTER_PORT"] == str(15000 + slurm.job_id % 15000)
    assert env["SRUN_CPUS_PER_TASK"] == "8" and env["WANDB_MODE"] == "offline"
    assert env["CRM_ROOT"] == str(slurm.root)
    assert f"run dir {slurm.run_dir}" in proc.stdout


def test_train_sbatch_without_the_plan_runs_the_run_args_alone(slurm):
    assert slurm.run(TRAIN_SBATCH, "loss=ranking").returncode == 0
    overrides = slurm.srun_calls()[0]["argv"][1:]
    assert overrides[-1] == "loss=ranking" and not any(o.startswith("parallel.sharding") for o in overrides)
    assert compose_cfg("train", overrides).stream.max_tokens == 4096  # the real row length, not the demo's


def test_train_sbatch_gives_nccl_and_gloo_the_same_network_interface(slurm):
    # gloo (the preemption flags' group) binds by hostname otherwise: maybe 127.0.1.1
    slurm.run(TRAIN_SBATCH, CRM_SOCKET_IFNAME="ib0")
    slurm.run(TRAIN_SBATCH, NCCL_SOCKET_IFNAME="eth1")  # a site's NCCL setting: gloo follows it
    slurm.run(TRAIN_SBATCH)  # unset: each library picks its own
    envs = [call["env"] for call in slurm.srun_calls()]
    assert [(e["NCCL_SOCKET_IFNAME"], e["GLOO_SOCKET_IFNAME"]) for e in envs] == [
        ("ib0", "ib0"), ("eth1", "eth1"), (None, None)]


def test_train_sbatch_leaves_a_user_wandb_mode_alone(slurm):
    slurm.run(TRAIN_SBATCH, WANDB_MODE="online")
    assert slurm.srun_calls()[0]["env"]["WANDB_MODE"] == "online"


def test_master_port_differs_between_jobs_and_stays_below_the_ephemeral_range(tmp_path):
    ports = set()
    for job_id in (4242, 4243, 999_999):
        fake = FakeSlurm(tmp_path / str(job_id), job_id=job_id)
        assert fake.run(TRAIN_SBATCH).returncode == 0
        port = int(fake.srun_calls()[0]["env"]["MASTER_PORT"])
        assert 15000 <= port < 30000
        ports.add(port)
    assert len(ports) == 3


PREEMPTED = json.dumps({"preempted": True, "train": {"global_step": 7}}, indent=1)
FINISHED = json.dumps({"preempted": False, "train": {"global_step": 9}}, indent=1)


EXIT_CASES = [  # (case, srun exit, Restarts now, SLURM_RESTART_COUNT at start, metrics.json, exit)
    ("finished", 0, 0, None, FINISHED, 0),
    ("crashed", 1, 0, None, None, 1),
    # crm's rank 0 ran `scontrol requeue`: SLURM counts a restart and kills the step (SIGTERM).
    ("requeued-killed", 143, 1, None, PREEMPTED, 0),
    ("requeued-exited", 0, 1, None, PREEMPTED, 0),
    ("requeued-segment-crashed", 1, 1, "1", None, 1),  # a crash after a requeue is a crash
    ("requeued-segment-finished", 0, 1, "1", FINISHED, 0),
    ("saved-not-requeued", 0, 0, None, PREEMPTED, 3),
]


@pytest.mark.parametrize("case,srun_rc,restarts,restart_count,metrics,expected", EXIT_CASES,
                         ids=[c[0] for c in EXIT_CASES])
def test_train_sbatch_exit_status_tells_a_requeue_from_a_failure(slurm, case, srun_rc, restarts,
                                                                 restart_count, metrics, expected):
    slurm.set_restarts(restarts)
    env = {"FAKE_SRUN_RC": str(srun_rc)}
    if metrics:
        env["FAKE_METRICS"] = metrics
    if restart_count:
        env["SLURM_RESTART_COUNT"] = restart_count
    proc = slurm.run(TRAIN_SBATCH, **env)
    assert proc.returncode == expected, (case, proc.stdout, proc.stderr)
    if case.startswith("requeued-k") or case == "requeued-exited":
        assert "was requeued" in proc.stdout
    if case == "saved-not-requeued":
        assert f"resume={slurm.run_dir}/checkpoints/last.ckpt" in proc.stderr
    # The batch shell never requeues by itself: crm's callback is the one owner of the requeue.
    assert not any(c.startswith("requeue") for c in slurm.scontrol_calls())


def test_train_sbatch_killed_by_its_requeue_still_exits_0(slurm):
    """`scontrol requeue` ends the job with SIGTERM to the batch shell and srun alike: the shell's
    trap lets it still tell a requeue (exit 0) from a failure."""
    slurm.set_restarts(1)  # crm's rank 0 has requeued the job
    proc = subprocess.Popen(["bash", str(TRAIN_SBATCH)], env={**slurm.env, "FAKE_SRUN_SLEEP": "60"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not (slurm.dir / "srun.calls").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGTERM)  # the batch step: the shell and srun
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, (out, err)
    assert "SIGTERM" in err and "was requeued (srun exit 143)" in out


def test_train_sbatch_refuses_ntasks_without_ntasks_per_node(slurm):
    env = {k: v for k, v in slurm.env.items() if k != "SLURM_NTASKS_PER_NODE"}
    proc = subprocess.run(["bash", str(TRAIN_SBATCH)], env=env, capture_output=True, text=True)
    assert proc.returncode != 0 and "--ntasks-per-node" in proc.stderr
    assert not slurm.srun_calls()


# -- 3. eval.sbatch ---------------------------------------------------------------------------------

def test_eval_sbatch_builds_crm_eval_and_crm_leaderboard_command_lines(slurm, tmp_path):
    model = "outputs/run, one/export"
    tests = ["test/a b.jsonl", "test/it's.jsonl", "test/x=1.jsonl"]
    criteria = ["I like short, plain answers.", 'No "fluff" please', "Budget: under $5, not ${x}",
                "It's a back\\slash\\", ""]
    criteria_file = tmp_path / "criteria.txt"
    criteria_file.write_text("\n".join(criteria) + "\n", encoding="utf-8")
    proc = slurm.run(EVAL_SBATCH, model, *tests, "batch_size=64", BENCH="bench one.jsonl",
                     BASELINE="model, v2", CRITERIA_FILE=str(criteria_file),
                     LEADERBOARD_ARGS="both_orders=true")
    assert proc.returncode == 0, proc.stderr
    eval_call, lb_call = slurm.srun_calls()
    assert eval_call["argv"][0] == "crm-eval" and lb_call["argv"][0] == "crm-leaderboard"

    cfg = compose_cfg("eval", eval_call["argv"][1:])
    assert cfg.checkpoint == model and list(cfg.data.test) == tests
    assert cfg.batch_size == 64 and str(cfg.name) == str(slurm.job_id)

    cfg = compose_cfg("leaderboard", lb_call["argv"][1:])
    resolved = OmegaConf.to_container(cfg, resolve=True)
    assert resolved["checkpoint"] == model and resolved["bench"] == "bench one.jsonl"
    assert resolved["baseline"] == "model, v2" and resolved["both_orders"] is True
    assert resolved["criteria"] == [c for c in criteria if c]


def test_eval_sbatch_without_a_benchmark_only_evaluates_and_passes_on_failure(slurm):
    proc = slurm.run(EVAL_SBATCH, "outputs/1/export", "t.jsonl", FAKE_SRUN_RC="1")
    assert proc.returncode == 1
    assert [c["argv"][0] for c in slurm.srun_calls()] == ["crm-eval"]
    assert slurm.run(EVAL_SBATCH, "outputs/1/export").returncode == 2  # no test file: usage


# -- 4. sweep.sh ------------------------------------------------------------------------------------

def test_sweep_submits_one_train_job_per_point_with_overrides_that_compose(tmp_path):
    proc = subprocess.run(["bash", str(SWEEP), "loss=cls,ranking", "noise=none,add,remove", "name=abl",
                           "data.test_files=[a.jsonl,b.jsonl]", "--nodes=1"],
                          env={**os.environ, "DRY_RUN": "1"}, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    commands = [shlex.split(line) for line in proc.stdout.splitlines()]
    assert len(commands) == 6
    names = set()
    for command in commands:
        assert command[:3] == ["sbatch", "--parsable", "--nodes=1"]
        assert Path(command[3]).resolve() == TRAIN_SBATCH
        cfg = compose_cfg("train", ["trainer=fsdp", *command[4:]])
        assert list(cfg.data.test_files) == ["a.jsonl", "b.jsonl"]  # a list is never split
        assert cfg.name == f"abl-{cfg.loss.name}-{cfg.noise.name}"
        names.add(cfg.name)
    assert len(names) == 6
    assert subprocess.run(["bash", str(SWEEP), "loss=cls"], capture_output=True).returncode == 2


# -- 5. the submitit launcher ---------------------------------------------------------------------

def test_launcher_config_uses_only_the_plugins_fields():
    needs_submitit()
    from hydra_plugins.hydra_submitit_launcher.config import SlurmQueueConf

    fields = {f.name for f in dataclasses.fields(SlurmQueueConf)}
    keys = set(yaml.safe_load(LAUNCHER_YAML.read_text())) - {"defaults"}
    assert keys <= fields, keys - fields
    assert LAUNCHER_YAML.read_text().startswith("# @package hydra.launcher")


def test_hydra_launcher_slurm_composes_and_follows_the_trainer():
    needs_submitit()
    cfg = compose_cfg("train", ["hydra/launcher=slurm", "trainer=fsdp", "trainer.num_nodes=2",
                                "trainer.devices=8"], hydra_node=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_ == SUBMITIT_TARGET
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node) == (2, 8, 8)
    assert launcher.max_num_timeout == 0
    assert launcher.additional_parameters.signal == "SIGUSR1@120"
    assert launcher.additional_parameters.requeue is True
    # The sweep dir: multirun/<name>/<job num>, so a requeued task finds its checkpoint again.
    assert cfg.hydra.sweep.dir.endswith("/multirun/demo")
    assert OmegaConf.to_container(cfg.hydra.sweep)["subdir"] == "${hydra.job.num}"
    # trainer.devices=auto has no number for SLURM: the launcher refuses it.
    auto = compose_cfg("train", ["hydra/launcher=slurm", "trainer=fsdp"], hydra_node=True)
    with pytest.raises(Exception, match="trainer.devices"):
        OmegaConf.to_container(auto.hydra.launcher, resolve=True)


def render_submission(tmp_path, monkeypatch, overrides: list[str]) -> tuple[str, object]:
    """The sbatch file the submitit launcher would submit for a 2-point sweep, and the executor."""
    import submitit
    from hydra.core.plugins import Plugins

    srun = tmp_path / "bin" / "srun"  # submitit's SLURM executor insists on finding srun
    srun.parent.mkdir(parents=True)
    srun.write_text("#!/bin/sh\nexit 0\n")
    srun.chmod(0o755)
    monkeypatch.setenv("PATH", f"{srun.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("SUBMITIT_PREEMPT_SIGNAL", raising=False)
    captured = {}

    def map_array(self, fn, *args):
        captured["executor"] = self
        return []

    monkeypatch.setattr(submitit.AutoExecutor, "map_array", map_array)
    cfg = compose_cfg("train", ["hydra/launcher=slurm", f"paths.root_dir={tmp_path}", *overrides],
                      hydra_node=True)
    launcher = Plugins.instance()._instantiate(cfg.hydra.launcher)
    launcher.config = cfg
    assert launcher.launch([["loss=cls"], ["loss=ranking"]], initial_job_idx=0) == []
    executor = captured["executor"]._executor
    return executor._make_submission_file_text("python -u -m submitit.core._submit x", "uid"), executor


def test_submitit_submission_gives_the_signal_to_crm_not_submitit(tmp_path, monkeypatch):
    needs_submitit()
    text, executor = render_submission(tmp_path, monkeypatch, [
        "trainer=fsdp", "trainer.num_nodes=2", "trainer.devices=8", "hydra.launcher.partition=gpu"])
    lines = set(text.splitlines())
    for expected in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
                     "#SBATCH --cpus-per-task=8", "#SBATCH --partition=gpu", "#SBATCH --requeue",
                     "#SBATCH --signal=SIGUSR1@120", "#SBATCH --open-mode=append"):
        assert expected in lines, (expected, text)
    assert "USR2" not in text  # submitit's own signal line is replaced: one owner
    assert executor.max_num_timeout == 0  # submitit never resubmits by itself
    assert "export MASTER_PORT=$((15000 + SLURM_JOB_ID % 15000))" in lines
    assert "export SLURM_KILL_BAD_EXIT=1" in lines
    assert text.index("export MASTER_PORT") < text.index("srun ")
    # The signal follows crm's preemption.signal, and the delay signal_delay_s.
    text, _ = render_submission(tmp_path / "other", monkeypatch, [
        "preemption.signal=SIGUSR2", "hydra.launcher.signal_delay_s=300"])
    assert "#SBATCH --signal=SIGUSR2@300" in text.splitlines()


# -- 6. SLURM.md mentions only what exists ----------------------------------------------------------

def md_code_lines() -> list[str]:
    lines, inside = [], False
    for line in SLURM_MD.read_text().splitlines():
        if line.startswith("```"):
            inside = not inside
        elif inside and line.strip():
            lines.append(line.strip())
    return lines


def inline_code(text: str) -> list[str]:
    """The `spans` of the text outside fenced blocks."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return [span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", prose)]


def expand_sweeps(overrides: list[str]) -> list[list[str]]:
    """Hydra's `key=a,b` sweeps as every combination (values holding brackets or quotes stay whole)."""
    choices = []
    for o in overrides:
        key, _, value = o.partition("=")
        if "," in value and not re.search(r"[\[\]()'\"{}]", value):
            choices.append([f"{key}={v}" for v in value.split(",")])
        else:
            choices.append([o])
    return [list(c) for c in itertools.product(*choices)]


def documented_commands() -> list[tuple[str, list[str]]]:
    """(config, overrides) for every crm-* / launch command line in SLURM.md's code blocks."""
    found = []
    inline = [span for span in inline_code(SLURM_MD.read_text()) if span.startswith("crm-")]
    for line in md_code_lines() + inline:
        if not re.match(r"^(?:[A-Z_]+=\S+\s+)*(?:crm-|sbatch\s|srun\s|launch/)", line):
            continue  # not a command line (a directory listing, say)
        words = shlex.split(re.sub(r"<[^>]*>", "X", line))
        while words and re.match(r"^[A-Z_]+=", words[0]):  # VAR=value before the command
            words.pop(0)
        if words and words[0] == "srun":
            words.pop(0)
            while words and words[0].startswith("-"):
                words.pop(0)
        if not words:
            continue
        command, args = words[0], words[1:]
        overrides = [a for a in args if "=" in a and not a.startswith("-")]
        if command == "crm-train":
            submitit = "-m" in args and "hydra/launcher=slurm" in overrides
            for point in expand_sweeps(overrides):
                found.append(("train-hydra" if submitit else "train", point))
        elif command in ("crm-eval", "crm-leaderboard", "crm-plan"):
            config = {"crm-eval": "eval", "crm-leaderboard": "leaderboard", "crm-plan": "plan"}[command]
            if config != "plan":  # crm-plan's `model` is the config group
                overrides = checkpoint_argument([command, *overrides])[1:]
            found.append((config, overrides))
        elif command == "sbatch":
            while args and args[0].startswith("-"):
                args.pop(0)
            script, rest = Path(args[0]).name, args[1:]
            if script == "train.sbatch":
                found.append(("train", ["trainer=fsdp", *[a for a in rest if "=" in a]]))
            elif script == "eval.sbatch":
                tests = [a for a in rest[1:] if "=" not in a]
                found.append(("eval", [f"checkpoint={rest[0]}", f"data.test=[{','.join(tests)}]",
                                       *[a for a in rest[1:] if "=" in a]]))
        elif command.endswith("sweep.sh"):
            for point in expand_sweeps(overrides):
                found.append(("train", ["trainer=fsdp", *point]))
    return found


def test_slurm_md_command_lines_compose():
    commands = documented_commands()
    kinds = {config for config, _ in commands}
    assert {"train", "train-hydra", "eval", "plan"} <= kinds, kinds
    for config, overrides in commands:
        if config == "train-hydra":
            needs_submitit()
            cfg = compose_cfg("train", overrides, hydra_node=True)
            assert cfg.hydra.launcher._target_ == SUBMITIT_TARGET
            OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
        else:
            compose_cfg(config, overrides)


def has_key(cfg, key: str) -> bool:
    """Whether the config has `key` (a dotted path), even when its value is ??? (mandatory)."""
    node = cfg
    for part in key.split("."):
        if not OmegaConf.is_dict(node) or part not in node.keys():
            return False
        node = node._get_node(part)
    return True


FILE_SUFFIXES = (".json", ".jsonl", ".ckpt", ".md", ".py", ".yaml", ".pt", ".log", ".out", ".csv",
                 ".sbatch", ".sh", ".partial", ".old", ".txt", ".distcp")


def test_slurm_md_config_keys_and_files_exist():
    needs_submitit()
    text = SLURM_MD.read_text()
    spans = inline_code(text) + md_code_lines()
    configs = [compose_cfg("train", ["hydra/launcher=slurm"], hydra_node=True),
               compose_cfg("eval", []), compose_cfg("leaderboard", []), compose_cfg("plan", [])]
    checked = set()
    for span in spans:
        for word in span.split():
            word = word.strip(",;:()")
            if "<" in word or "==" in word or word.startswith(("-", "#", "$", "/")):
                continue
            key = word.split("=", 1)[0] if "=" in word else word
            if not re.fullmatch(r"[a-z_]+(\.[a-z_]+)*", key) or key.endswith(FILE_SUFFIXES):
                continue
            if "=" not in word and "." not in key:
                continue  # a plain word, not a key
            if key.startswith(("crm.", "outputs.")):
                continue
            if "=" in word and (REPO / "configs" / key).is_dir():  # a config group: experiment=lora
                for choice in word.split("=", 1)[1].split(","):  # a sweep names several
                    assert (REPO / "configs" / key / f"{choice}.yaml").is_file(), \
                        f"SLURM.md chooses `{word}`, which configs/{key} does not have"
                checked.add(key)
                continue
            assert any(has_key(c, key) for c in configs), \
                f"SLURM.md mentions `{key}`, which no config has"
            checked.add(key)
    assert {"trainer.devices", "trainer.num_nodes", "preemption.signal", "stream.num_workers",
            "hydra.launcher.max_num_timeout", "paths.output_dir"} <= checked
    for path in re.findall(r"\b((?:crm|configs|launch)/[\w/.-]+\.(?:py|yaml|sbatch|sh))\b", text):
        assert (REPO / path).is_file(), f"SLURM.md names {path}, which does not exist"


# -- 7. end to end: train.sbatch, preempted, requeued, resumed (slow) -------------------------------

def free_job_id() -> int:
    """A job id whose MASTER_PORT (15000 + id % 15000) is free on loopback now."""
    for job_id in range(26000 + os.getpid() % 3000, 40000):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", 15000 + job_id % 15000))
                return job_id
            except OSError:
                continue
    raise RuntimeError("no free port")


def kill_tasks(fake: FakeSlurm, signum: int) -> None:
    path = fake.dir / "task.pids"
    for pid in path.read_text().split() if path.exists() else []:
        try:
            os.killpg(int(pid), signum)  # the task and its DataLoader workers, as slurmstepd does
        except ProcessLookupError:
            pass


@pytest.mark.slow
@pytest.mark.both_cores
def test_train_sbatch_end_to_end_preempted_requeued_and_resumed(tmp_path):
    """Two ranks on CPU through the real script: SIGUSR1 to every process of every task (DataLoader
    workers too) -> last.ckpt at a step boundary, `scontrol requeue` by rank 0, the batch script
    exits 0; the requeued job (same id) resumes from last.ckpt and finishes."""
    from crm.data.demo import DemoConfig, prepare_demo

    demo = ["data.demo.n_train=386", "data.demo.n_user=0", "data.demo.n_test=20", "data.demo.n_bench=4"]
    fake = FakeSlurm(tmp_path, job_id=free_job_id(), nodes=1, tasks_per_node=2)
    cfg = compose_cfg("train", [*demo, f"paths.root_dir={fake.root}"])
    shards = prepare_demo(DemoConfig(**cfg.data.demo))  # once, before the ranks start
    overrides = [
        "model=tiny", "model.path=null", "data=demo", f"data.path={shards}", *demo,
        "model.arch.hidden_size=32", "model.arch.num_hidden_layers=2", "model.arch.intermediate_size=64",
        "model.vocab_size=300", "trainer.accelerator=cpu", "parallel.param_dtype=float32",
        "parallel.activation_checkpointing=false", "global_batch_size=8", "micro_batch_size=4",
        "stream.num_workers=1", "torch_threads=1", "logger=csv", "evaluate=false", "val_every_n_steps=1000",
        "save_every_n_steps=1000"]
    env = {"FAKE_SRUN_SPAWN": "1", "FAKE_HOSTNAMES": "127.0.0.1", "TOKENIZERS_PARALLELISM": "false"}
    first = subprocess.Popen(["bash", str(TRAIN_SBATCH), *overrides, "trainer.max_steps=400"],
                             env={**fake.env, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True)
    try:
        log = fake.dir / "task0.log"
        deadline = time.monotonic() + 240
        while "parameters," not in (log.read_text(errors="replace") if log.exists() else ""):
            assert first.poll() is None, first.stdout.read()
            assert time.monotonic() < deadline, "no model size line (crm.training.callbacks.ModelSize)"
            time.sleep(0.2)
        time.sleep(2.0)  # a few steps, with the DataLoader workers running
        kill_tasks(fake, signal.SIGUSR1)
        out, _ = first.communicate(timeout=240)
    finally:
        if first.poll() is None:
            kill_tasks(fake, signal.SIGKILL)
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    assert first.returncode == 0, out + (fake.dir / "task0.log").read_text()[-3000:]
    assert "was requeued" in out
    metrics = json.loads((fake.run_dir / "metrics.json").read_text())
    saved = metrics["train"]["global_step"]
    assert metrics["preempted"] is True and 1 <= saved < 400
    assert f"requeue {fake.job_id}" in fake.scontrol_calls()
    assert (fake.run_dir / "checkpoints" / "last.ckpt" / "meta.pt").is_file()  # sharded, complete

    # SLURM starts the same script again, with the same job id, as restart 1.
    second = fake.run(TRAIN_SBATCH, *overrides, f"trainer.max_steps={saved + 2}", timeout=300,
                      SLURM_RESTART_COUNT="1", **env)
    assert second.returncode == 0, (second.stdout + second.stderr
                                    + (fake.dir / "task0.log").read_text()[-3000:])
    metrics = json.loads((fake.run_dir / "metrics.json").read_text())
    assert metrics["preempted"] is False and metrics["train"]["global_step"] == saved + 2
    assert metrics["train"]["resumed_from"] == str(fake.run_dir / "checkpoints" / "last.ckpt")
    assert (fake.run_dir / "export" / "model.safetensors").is_file()
    assert [c for c in fake.scontrol_calls() if c.startswith("requeue")] == [f"requeue {fake.job_id}"]
