"""``disttrain slurm``: print an sbatch script that runs ``disttrain train`` (written by
:func:`disttrain.launch.slurm.sbatch_script`)."""

from __future__ import annotations

import argparse

from ..launch.slurm import sbatch_script


def add_slurm_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "slurm", help="write a SLURM batch script that runs disttrain train",
        description="Print an sbatch script: one task per GPU (srun starts every rank), "
        "with the one-task-per-node elastic agent as a commented alternative. Options "
        "after the script's own are passed to disttrain train, e.g. "
        "disttrain slurm --nodes 2 --gpus-per-node 8 -- --set train.steps=1000 "
        "> job.sbatch")
    p.add_argument("--nodes", type=int, required=True, metavar="N")
    p.add_argument("--gpus-per-node", type=int, required=True, metavar="G")
    p.add_argument("--partition", default="", metavar="NAME")
    p.add_argument("--time", default="", metavar="D-HH:MM:SS", help="time limit")
    p.add_argument("--job-name", default="disttrain", metavar="NAME")
    p.add_argument("--run-dir", default="", metavar="DIR",
                   help="on a shared filesystem (default runs/slurm-$SLURM_JOB_ID)")
    p.add_argument("train_args", nargs=argparse.REMAINDER,
                   help="disttrain train options (after --)")
    return p


def run_slurm(ns: argparse.Namespace) -> int:
    args = ns.train_args[1:] if ns.train_args[:1] == ["--"] else list(ns.train_args)
    print(sbatch_script(nodes=ns.nodes, gpus_per_node=ns.gpus_per_node, train_args=args,
                        partition=ns.partition, time=ns.time, job_name=ns.job_name,
                        run_dir=ns.run_dir), end="")
    return 0
