"""Running under SLURM: one task per device started by ``srun``, or one task per node
running the elastic agent; ``disttrain slurm`` writes the batch script for either.

One task per device (``srun --ntasks-per-node=G disttrain train ...``): no torchrun.
Each task's rank, local rank and the world size come from SLURM's variables
(``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NTASKS``), the rendezvous host is the
first node of the job's node list, and the port is derived from the job id, so every
task computes the same address and two jobs on one node do not meet.
:func:`adopt_slurm_env` sets the torchrun-style variables (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) from them, and
only where they are not set already, so torchrun inside an allocation wins.

It applies only in a job step started by ``srun`` with more than one task: in the batch
script itself, or in a one-task step, ``disttrain train`` launches its own ``--nproc``
workers as anywhere else; and a ``disttrain train`` given ``--nnodes`` or
``--rdzv-endpoint`` is the elastic agent of its node (one task per node), whose
workers torchrun starts.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Mapping, MutableMapping

from ..errors import UserError
from .allocator import ALLOCATOR_ENV

PORT_BASE, PORT_SPAN = 15000, 20000  # MASTER_PORT = PORT_BASE + job id % PORT_SPAN
_SPECIAL_STEPS = 0xFFFFFFF0  # batch, extern and interactive steps have ids above this


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``node[07-09,12],gpu3`` -> ``node07``."""
    text = nodelist.strip()
    match = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?([^,]*)", text)
    if not text or match is None or not (match.group(1) or match.group(2)):
        raise UserError(f"cannot read the SLURM node list {nodelist!r}")
    prefix, ranges, suffix = match.groups()
    if ranges is None:
        return prefix + suffix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first + suffix


def _tasks_on_first_node(spec: str) -> int | None:
    """``SLURM_STEP_TASKS_PER_NODE``-style ``4(x2),3`` -> 4."""
    match = re.match(r"\s*(\d+)", spec or "")
    return int(match.group(1)) if match else None


def slurm_rank_env(env: Mapping[str, str]) -> dict[str, str] | None:
    """The torchrun-style variables of a task that ``srun`` started as one rank of a
    multi-task job step; None when ``env`` is not such a task."""
    needed = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_ID", "SLURM_JOB_ID")
    if any(k not in env for k in needed) or "RANK" in env or "TORCHELASTIC_RUN_ID" in env:
        return None
    try:
        step, tasks = int(env["SLURM_STEP_ID"]), int(env["SLURM_NTASKS"])
        rank, job = int(env["SLURM_PROCID"]), int(env["SLURM_JOB_ID"])
        local = int(env.get("SLURM_LOCALID", "0"))
    except ValueError:
        return None
    if step >= _SPECIAL_STEPS or tasks < 2:
        return None
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or \
        env.get("SLURM_NODELIST", "")
    per_node = _tasks_on_first_node(env.get("SLURM_STEP_TASKS_PER_NODE", "")) or \
        _tasks_on_first_node(env.get("SLURM_NTASKS_PER_NODE", "")) or tasks
    return {"RANK": str(rank), "WORLD_SIZE": str(tasks), "LOCAL_RANK": str(local),
            "LOCAL_WORLD_SIZE": str(per_node),
            "MASTER_ADDR": first_host(nodelist) if nodelist else "127.0.0.1",
            "MASTER_PORT": str(PORT_BASE + job % PORT_SPAN)}


def adopt_slurm_env(env: MutableMapping[str, str] | None = None) -> bool:
    """Set the torchrun-style variables from SLURM's for a task ``srun`` started as
    one rank (see the module docstring); True if it did. Variables already set stay."""
    env = os.environ if env is None else env
    found = slurm_rank_env(env)
    if found is None:
        return False
    for key, value in found.items():
        env.setdefault(key, value)
    return True


# ----------------------------------------------------------------- the batch script

def sbatch_script(*, nodes: int, gpus_per_node: int, train_args: list[str],
                  partition: str = "", time: str = "", job_name: str = "disttrain",
                  run_dir: str = "") -> str:
    """A batch script for ``sbatch``: one task per GPU (the active line) or one elastic
    agent per node (the commented alternative); a preempted run (SIGTERM, which
    ``--signal`` sends two minutes ahead) saves, exits 143 and is requeued."""
    if nodes < 1 or gpus_per_node < 1:
        raise UserError("--nodes and --gpus-per-node must be at least 1")
    run_dir = run_dir or "runs/slurm-${SLURM_JOB_ID}"
    args = " ".join(shlex.quote(a) for a in train_args)
    args = f" {args}" if args else ""
    header = [f"#SBATCH --job-name={job_name}", f"#SBATCH --nodes={nodes}",
              f"#SBATCH --ntasks-per-node={gpus_per_node}",
              f"#SBATCH --gpus-per-node={gpus_per_node}",
              "#SBATCH --signal=TERM@120", "#SBATCH --requeue",
              "#SBATCH --output=%x-%j.out"]
    header += [f"#SBATCH --partition={partition}"] if partition else []
    header += [f"#SBATCH --time={time}"] if time else []
    return "\n".join([
        "#!/bin/bash", *header, "",
        "# The run directory must be on a filesystem every node sees; a requeued job",
        "# resumes from its latest checkpoint there.",
        f'RUN_DIR="{run_dir}"',
        "# If the nodes have several networks, name the one the ranks talk over:",
        "# export NCCL_SOCKET_IFNAME=ib0 GLOO_SOCKET_IFNAME=ib0",
        "# Memory-bound CPU runs (ZeRO-3): freed buffers back to the system, at some step",
        "# time (what DISTTRAIN_MALLOC=return asks disttrain's launcher for):",
        *(f'# export {k}="${{{k}:-{v}}}"' for k, v in ALLOCATOR_ENV.items()),
        "",
        "# One task per GPU: srun starts every rank; disttrain reads its rank, local rank",
        "# and the world size from SLURM, the rendezvous host is the first node, the",
        "# port is derived from the job id.",
        f'srun --kill-on-bad-exit=1 disttrain train --run-dir "$RUN_DIR"{args}',
        "code=$?",
        "",
        "# Or one task per node, each running torch's elastic agent for its GPUs (node",
        "# failures restart the worker group with --max-restarts). Use it instead of the",
        "# line above with: #SBATCH --ntasks-per-node=1",
        '# HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"# srun disttrain train --nnodes {nodes} --nproc {gpus_per_node} "
        f'--rdzv-endpoint "$HEAD:29500" --rdzv-id "$SLURM_JOB_ID" --run-dir "$RUN_DIR"'
        f"{args}",
        "# code=$?",
        "",
        "# 143: stopped by SIGTERM after saving the current step (preemption, or the",
        "# time limit's warning): requeue, and the job resumes where it stopped.",
        'if [ "$code" -eq 143 ]; then scontrol requeue "$SLURM_JOB_ID"; fi',
        'exit "$code"', ""])
