"""launch/score.sbatch: a Ray cluster over a SLURM job's nodes, crm-leaderboard run against it with
engine=ray, the cluster stopped. Run for real under bash with a fake `srun` (it runs the command on
this machine, as each node would) and `scontrol`: two `ray start` processes, the head and one more
node, make the simulated 2-node cluster, and a board is ranked on it."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from scorers import run_cli

REPO = Path(__file__).resolve().parents[2]
SCORE_SBATCH = REPO / "launch" / "score.sbatch"

FAKE_SRUN = """#!{python}
import os, sys
args, node = sys.argv[1:], "node-a"
while args and args[0].startswith("-"):  # srun's options; -w and -x take a value
    if args[0] == "-w":
        node = args[1]
    elif args[0].startswith("--exclude"):  # the job's other node (a job of two)
        node = "node-b"
    args = args[2:] if args[0] in ("-w", "-x", "-N", "-n") else args[1:]
os.environ["SLURMD_NODENAME"] = node  # as srun tells a task its node
os.execvp(args[0], args)
"""
# `ip -4 -o addr show dev lo` on each simulated node: a loopback address of its own, so that the
# two Ray nodes meet on loopback only (Ray rewrites 127.0.0.1 itself, not 127.0.0.2 or .3).
FAKE_IP = """#!/bin/sh
case "$SLURMD_NODENAME" in node-a) n=2 ;; *) n=3 ;; esac
echo "1: lo    inet 127.0.0.$n/8 scope host lo"
"""
FAKE_SCONTROL = """#!/bin/sh
[ "$1 $2" = "show hostnames" ] && printf 'node-a\\nnode-b\\n'
"""


def test_score_sbatch_parses_and_marks_what_a_user_sets():
    assert subprocess.run(["bash", "-n", str(SCORE_SBATCH)], capture_output=True).returncode == 0
    lines = SCORE_SBATCH.read_text().splitlines()
    first_command = next(i for i, line in enumerate(lines)
                         if line.strip() and not line.lstrip().startswith("#"))
    assert max(i for i, line in enumerate(lines) if line.startswith("#SBATCH")) < first_command
    for needle in ("--partition", "--nodes", "--gpus-per-node", "--cpus-per-task", "--mem", "--time",
                   "--output", "CRM_VENV=", "CRM_ROOT=", "CRM_SOCKET_IFNAME="):
        matching = [line for line in lines if line.startswith(f"#SBATCH {needle}")
                    or (not needle.startswith("-")
                        and re.match(rf"(export )?{needle}", line) is not None)]
        assert matching and all("# EDIT:" in line for line in matching), needle


def ports_free(first: int, count: int) -> bool:
    for port in range(first, first + count):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def free_job_id() -> int:
    """A job id whose head port (30000 + id % 2700) and the five after it are free."""
    for job_id in range(os.getpid() % 2700, os.getpid() % 2700 + 2700):
        if ports_free(30000 + job_id % 2700, 6):
            return job_id
    raise RuntimeError("no free port")


def kill_leftovers(marker: str) -> list[str]:
    """Processes of this test's Ray (their command lines name its temp dir), killed by pid: the
    command lines of those the script left."""
    left = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            left.append(cmdline.replace("\0", " ")[:200])
            try:
                os.kill(int(proc.name), signal.SIGKILL)
            except ProcessLookupError:
                pass
    return left


@pytest.mark.slow
def test_a_two_node_ray_cluster_from_score_sbatch_ranks_a_board(length_crm, demo_root, tmp_path):
    from crm.cli.leaderboard import run

    export, _ = length_crm
    bench = demo_root / ".cache" / "demo" / "raw" / "bench.jsonl"
    board = [f"checkpoint={export}", f"bench={bench}", "baseline=baseline", "progress=false",
             'criteria=["I prefer short, to-the-point answers."]']
    local = run_cli("leaderboard", run, board, tmp_path / "local")

    bin_dir, venv, root = tmp_path / "bin", tmp_path / "venv", tmp_path / "root"
    for d in (bin_dir, venv / "bin", root):
        d.mkdir(parents=True)
    (bin_dir / "srun").write_text(FAKE_SRUN.format(python=sys.executable))
    (bin_dir / "scontrol").write_text(FAKE_SCONTROL)
    (bin_dir / "ip").write_text(FAKE_IP)
    for tool in ("srun", "scontrol", "ip"):
        (bin_dir / tool).chmod(0o755)
    (venv / "bin" / "activate").write_text(f'export PATH="{Path(sys.executable).parent}:$PATH"\n')
    ray_tmp = tempfile.mkdtemp(prefix="crm-ray-", dir="/tmp")  # short: Unix socket paths
    job_id = free_job_id()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "RAY_", "NCCL_", "GLOO_", "CRM_"))}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", CRM_VENV=str(venv), CRM_ROOT=str(root),
               SLURM_SUBMIT_DIR=str(tmp_path), SLURM_JOB_ID=str(job_id), SLURM_NNODES="2",
               SLURM_JOB_NODELIST="node-[a-b]", SLURM_CPUS_PER_TASK="1", CRM_SOCKET_IFNAME="lo",
               CRM_RAY_LOOPBACK="1",
               CRM_RAY_TMPDIR=ray_tmp, CRM_RAY_WAIT="120", OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore")
    try:
        proc = subprocess.run(
            ["bash", str(SCORE_SBATCH), "crm-leaderboard", *board, "engine.workers=2",
             "engine.block_prompts=1"], env=env, capture_output=True, text=True, timeout=240,
            stdin=subprocess.DEVNULL)
    finally:
        left = kill_leftovers(ray_tmp)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert left == []  # the script stopped both nodes
    assert re.search(r"crm: 2 Ray node\(s\) joined [\d.]+:\d+", proc.stdout)
    run_dir = root / "outputs" / "leaderboard" / str(job_id)
    result = json.loads((run_dir / "leaderboard.json").read_text())
    assert result["boards"] == json.loads(json.dumps(local["boards"]))
    engine = json.loads((run_dir / "engine.json").read_text())
    assert engine["address"].endswith(f":{30000 + job_id % 2700}")
    assert len({w["node_id"] for w in engine["workers"]}) == 2  # one worker on each node
