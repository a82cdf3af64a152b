"""SLURM: a task srun starts as one rank learns its place from SLURM's variables; two
such tasks (no torchrun) form a world and train; `disttrain slurm` writes a batch script
that bash accepts."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from disttrain.cli import main
from disttrain.errors import UserError
from disttrain.launch.slurm import adopt_slurm_env, first_host, sbatch_script, slurm_rank_env

DISTTRAIN = str(Path(sys.executable).with_name("disttrain"))


@pytest.mark.parametrize("nodelist, host", [
    ("node07", "node07"), ("node[07-09,12]", "node07"), ("gpu[003-004],cpu1", "gpu003"),
    ("a-b[1,3]-ib", "a-b1-ib"), ("x1,x2", "x1")])
def test_the_rendezvous_host_is_the_first_node(nodelist, host):
    assert first_host(nodelist) == host


def test_an_unreadable_node_list_is_a_user_error():
    with pytest.raises(UserError, match="node list"):
        first_host("[")


def _task(rank: int, **extra: str) -> dict[str, str]:
    return {"SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank % 4), "SLURM_NTASKS": "8",
            "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "n[1-2]",
            "SLURM_STEP_TASKS_PER_NODE": "4(x2)", **extra}


def test_a_task_of_a_multi_task_step_becomes_a_rank():
    assert slurm_rank_env(_task(5)) == {
        "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "n1", "MASTER_PORT": str(15000 + 4242)}


@pytest.mark.parametrize("change", [
    {"SLURM_NTASKS": "1"},                  # one task: disttrain launches its workers
    {"SLURM_STEP_ID": str(0xFFFFFFFE)},     # the batch script itself, not an srun step
    {"RANK": "0"},                          # torchrun (the agent) set the ranks already
    {"TORCHELASTIC_RUN_ID": "x"},
])
def test_only_srun_tasks_of_several_ranks_are_adopted(change):
    env = _task(0, **change)
    assert slurm_rank_env(env) is None and not adopt_slurm_env(env)


def test_variables_already_set_are_kept():
    env = _task(1, MASTER_PORT="1234")
    assert adopt_slurm_env(env) and env["MASTER_PORT"] == "1234" and env["RANK"] == "1"


def test_two_srun_tasks_form_a_world_and_train(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_",
                                "TORCHELASTIC_"))}
    env["DISTTRAIN_CACHE"] = str(tmp_path / "cache")
    job = str(random.randrange(1, 20000))  # a port of its own
    run_dir = tmp_path / "run"
    tiny = ["--set", "model.n_layer=1", "--set", "model.d_model=32", "--set",
            "model.n_head=2", "--set", "model.seq_len=32", "--set", "train.steps=4",
            "--set", "train.global_batch=8", "--set", "train.eval_samples=16",
            "--set", "train.log_every=2", "--set", "train.warmup_steps=1", "--quiet"]
    procs = [subprocess.Popen(
        [DISTTRAIN, "train", *tiny, "--run-dir", str(run_dir)],
        env={**env, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r), "SLURM_NTASKS": "2",
             "SLURM_STEP_ID": "0", "SLURM_JOB_ID": job, "SLURM_JOB_NODELIST": "localhost",
             "SLURM_STEP_TASKS_PER_NODE": "2"},
        stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        errs = [p.communicate(timeout=180)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], errs[0][-2000:] + errs[1][-2000:]
    assert "2 rank(s)" in errs[0]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 4


def test_the_batch_script_passes_bash_and_names_the_task_layout(tmp_path, capsys):
    assert main(["slurm", "--nodes", "2", "--gpus-per-node", "8", "--partition", "gpu",
                 "--", "--set", "train.steps=1000"]) == 0
    script = capsys.readouterr().out
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)], timeout=30).returncode == 0
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=8",
                 "#SBATCH --gpus-per-node=8", "#SBATCH --partition=gpu",
                 "#SBATCH --requeue",
                 'srun --kill-on-bad-exit=1 disttrain train --run-dir "$RUN_DIR" --set '
                 "train.steps=1000",
                 "# srun disttrain train --nnodes 2 --nproc 8",
                 'scontrol requeue "$SLURM_JOB_ID"',
                 # the tasks srun starts are the workers: the launcher's allocator, asked for
                 '# export MALLOC_MMAP_THRESHOLD_="${MALLOC_MMAP_THRESHOLD_:-131072}"'):
        assert line in script, line
    with pytest.raises(UserError):
        sbatch_script(nodes=0, gpus_per_node=8, train_args=[])
