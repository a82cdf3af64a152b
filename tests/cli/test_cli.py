"""The command line: one-line errors with exit 2, --help, and real launches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path
from unittest import mock

import pytest
import torch
from safetensors.torch import load_file, load_model

from disttrain.config import load_config
from disttrain.config.schema import SECTIONS, config_key
from disttrain.data import collate_token_batch
from disttrain.models import GPT, token_loss
from disttrain.train import build_default_job

pytestmark = pytest.mark.slow  # spawns worlds or trains: not in the quick check

DISTTRAIN = str(Path(sys.executable).with_name("disttrain"))
TINY = ["--set", "model.n_layer=1", "--set", "model.d_model=32", "--set", "model.n_head=2",
        "--set", "model.seq_len=32", "--set", "train.eval_samples=16",
        "--set", "train.global_batch=8", "--set", "train.warmup_steps=2",
        "--set", "train.log_every=2"]


@pytest.fixture(scope="module")
def cache_env(tmp_path_factory):
    env = dict(os.environ, DISTTRAIN_CACHE=str(tmp_path_factory.mktemp("cache")))
    env.pop("RANK", None), env.pop("WORLD_SIZE", None), env.pop("TORCHELASTIC_RUN_ID", None)
    return env


def run_cli(args, env, timeout=180, cwd=None):
    return subprocess.run([DISTTRAIN, *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=cwd)


@pytest.fixture
def cli_in_process(cache_env, monkeypatch, capsys):
    """``disttrain ARGS`` as a call of the console script's ``main`` in this process
    (what the script runs, without importing torch again: ~2-4 s of CPU a call), in the
    given directory with the module's cache: returns (exit code, stdout, stderr)."""
    from disttrain.cli import main

    monkeypatch.setenv("DISTTRAIN_CACHE", cache_env["DISTTRAIN_CACHE"])
    for name in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)

    def run(args: list[str], cwd: Path) -> tuple[int, str, str]:
        monkeypatch.chdir(cwd)
        capsys.readouterr()
        try:
            code = main(args)
        except SystemExit as exc:  # argparse's usage errors and --help
            code = exc.code
        out, err = capsys.readouterr()
        return code, out, err

    return run


BAD = [
    (["train", "--set", "train.stpes=5"], "train.stpes"),
    (["train", "--set", "train.steps=many"], "train.steps"),
    (["train", "--set", "train.lr=0"], "train.lr"),
    (["train", "--nproc", "2", "--set", "parallel.dp=4"], "parallel.dp"),
    (["train", "--nproc", "2", "--set", "train.global_batch=30",
      "--set", "train.micro_batch=4"], "train.global_batch"),
    (["train", "--nproc", "2", "--nnodes", "1:3", "--set", "train.global_batch=8",
      "--set", "train.grad_accum=1"], "train.global_batch"),
    # every node must name the same job: a run directory (or a rendezvous id)
    (["train", "--nproc", "1", "--nnodes", "2"], "--run-dir"),
    (["train", "missing.toml"], "missing.toml"),
    (["train", "--set", "data.path=/no/such/place"], "data.path"),
    (["train", "--set", "noequals"], "noequals"),
    (["train", "--bogus-flag"], "--bogus-flag"),
    (["run", "no_such_script.py"], "no_such_script.py"),
    # grouped-query attention: tp must divide the key/value heads
    (["train", "--nproc", "4", "--set", "model.name=llama", "--set", "model.n_head=4",
      "--set", "model.n_kv_head=2", "--set", "parallel.tp=4"], "model.n_kv_head"),
    # a transformers model's forward reshapes by the full sequence: no sequence parallelism
    (["train", "--nproc", "2", "--set", "model.name=gpt2", "--set", "parallel.tp=2",
      "--set", "parallel.sequence_parallel=true"], "parallel.sequence_parallel"),
    (["train", "--set", "model.hf_config=/no/such/config.json"], "model.hf_config"),
    # the byte corpus is cut into full windows: no examples to pack
    (["train", "--set", "data.packing=true"], "data.packing"),
    # context parallelism: 2 x cp equal chunks, its ring with nothing compiled, and an
    # attention it recognises
    (["train", "--nproc", "2", "--set", "parallel.cp=2", "--set", "model.seq_len=30"],
     "model.seq_len"),
    (["train", "--nproc", "2", "--set", "parallel.cp=2", "--set", "train.compile=true"],
     "train.compile"),
    (["train", "--nproc", "2", "--set", "parallel.cp=2", "--set", "model.name=gpt2"],
     "parallel.cp"),
]


def _assert_one_line_exit_2(code: int, stderr: str, named: str, cwd: Path) -> None:
    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert named in lines[0] and "Traceback" not in stderr
    assert not (cwd / "runs").exists(), "nothing is started on bad input"


@pytest.mark.parametrize("args,named", BAD, ids=[" ".join(a[1:]) for a, _ in BAD])
def test_bad_input_exits_2_with_one_line(args, named, cli_in_process, tmp_path):
    code, _, err = cli_in_process(args, tmp_path)
    _assert_one_line_exit_2(code, err, named, tmp_path)


# The same through the installed command, as its own process: the exit code the shell
# sees, and a stderr of one line even with what importing torch (and transformers, for
# the second) may print. One plain case and one that loads a transformers model.
IN_A_PROCESS = [case for case in BAD if case[1] in ("train.stpes", "parallel.sequence_parallel")]


@pytest.mark.parametrize("args,named", IN_A_PROCESS, ids=["plain", "transformers"])
def test_bad_input_from_the_installed_command(args, named, cache_env, tmp_path):
    proc = run_cli(args, cache_env, timeout=60, cwd=tmp_path)
    _assert_one_line_exit_2(proc.returncode, proc.stderr, named, tmp_path)


def test_a_transformers_model_trains_from_the_command_line(cache_env, tmp_path):
    """model.name=llama (grouped-query attention) under ZeRO-2 on two workers: the
    default corpus's shifted targets, the causal-LM loss, a falling held-out loss."""
    pytest.importorskip("transformers")
    run_dir = tmp_path / "llama"
    proc = run_cli(["train", "--nproc", "2", *TINY, "--set", "model.name=llama",
                    "--set", "model.n_head=4", "--set", "model.n_kv_head=2",
                    "--set", "parallel.zero=2", "--set", "train.steps=12",
                    "--set", "checkpoint.every=0", "--run-dir", str(run_dir), "--quiet"],
                   cache_env)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]
    assert summary["model_flops_per_s"] > 0  # FLOPs per token from the model's shapes


def test_a_model_without_a_tensor_plan_is_refused_before_launch(cli_in_process, tmp_path):
    """An OPT config (attention out_proj, MLP fc1 / fc2: neither known block shape)
    with tp=2: exit 2, one line naming parallel.tp and what to pass, no worker."""
    transformers = pytest.importorskip("transformers")
    transformers.OPTConfig(vocab_size=256, hidden_size=32, num_hidden_layers=2,
                           ffn_dim=64, num_attention_heads=2, max_position_embeddings=32,
                           word_embed_proj_dim=32).save_pretrained(tmp_path / "opt")
    code, _, err = cli_in_process(["train", "--nproc", "2", "--set",
                                   f"model.hf_config={tmp_path / 'opt' / 'config.json'}",
                                   "--set", "parallel.tp=2"], tmp_path)
    _assert_one_line_exit_2(code, err, "parallel.tp", tmp_path)
    assert "plan" in err


def test_gpt2_trained_with_tensor_parallelism_exports_for_from_pretrained(cache_env,
                                                                          tmp_path):
    """model.name=gpt2 with tp=2 from the command line (its Conv1D weights sharded in
    their own layout, the tied head on vocabulary shards), then export --format hf: the
    weights load with from_pretrained and the held-out loss fell."""
    transformers = pytest.importorskip("transformers")
    run_dir = tmp_path / "gpt2"
    proc = run_cli(["train", "--nproc", "2", *TINY, "--set", "model.name=gpt2",
                    "--set", "parallel.tp=2", "--set", "train.steps=12",
                    "--set", "checkpoint.every=12", "--run-dir", str(run_dir), "--quiet"],
                   cache_env)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]
    out = tmp_path / "hf"
    proc = run_cli(["export", str(run_dir), "--format", "hf", "--out", str(out)], cache_env)
    assert proc.returncode == 0, proc.stderr
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    final = load_file(str(run_dir / "model.safetensors"))
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), final[name], atol=0, rtol=0)


def test_without_transformers_the_setting_names_the_extra(monkeypatch):
    import importlib.util

    from disttrain.errors import ConfigError
    from disttrain.run_checks import resolve

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "transformers" else real(name, *a))
    with pytest.raises(ConfigError) as info:
        resolve(load_config(overrides=["model.name=gpt2"]), 1)
    assert info.value.field == "model.name" and "pip install -e '.[hf]'" in str(info.value)


def test_train_help_documents_every_option(cli_in_process, tmp_path):
    code, out, _ = cli_in_process(["train", "--help"], tmp_path)
    assert code == 0
    for flag in ("--nproc", "--set", "--run-dir", "--nnodes", "--node-rank",
                 "--rdzv-endpoint", "--rdzv-id", "--max-restarts", "--quiet", "CONFIG"):
        assert flag in out, flag
    for section, cls in SECTIONS.items():
        for f in fields(cls):
            assert f"{section}.{config_key(f)}" in out, config_key(f)


def _check_run_dir(run_dir: Path, world_size: int, steps: int) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == world_size and summary["steps"] == steps
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(2, steps + 1, 2))
    assert all({"step", "loss", "lr", "tokens_per_s"} <= r.keys() for r in records)
    assert (run_dir / "config.toml").is_file() and (run_dir / "model.safetensors").is_file()
    return summary


def test_train_two_workers_end_to_end_then_export(cache_env, tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli(["train", "--nproc", "2", *TINY, "--set", "train.steps=10",
                    "--run-dir", str(run_dir)], cache_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = _check_run_dir(run_dir, 2, 10)
    assert "held-out loss" in proc.stderr and "step 10/10" in proc.stderr
    assert summary["layout"] == {"dp": 2, "pp": 1, "tp": 1, "cp": 1, "zero": 0}

    out = tmp_path / "model.safetensors"
    proc = run_cli(["export", str(run_dir), "--out", str(out)], cache_env, timeout=60)
    assert proc.returncode == 0 and "step 10" in proc.stdout
    # the exported file alone, in the plain model, reproduces the run's held-out loss
    config = load_config(run_dir / "config.toml")
    with mock.patch.dict(os.environ, {"DISTTRAIN_CACHE": cache_env["DISTTRAIN_CACHE"]}):
        job = build_default_job(config)
    model = GPT(config.model)
    load_model(model, str(out))
    batch = collate_token_batch([job.eval_data[i]
                                 for i in range(config.train.eval_samples)])
    with torch.no_grad():
        loss_sum, count = token_loss(model(batch["input_ids"]), batch["targets"])
    assert float(loss_sum) / count == pytest.approx(summary["final_eval_loss"], abs=1e-5)


def test_resume_is_announced_and_finished_runs_stay_finished(cache_env, tmp_path):
    run_dir = tmp_path / "run"
    args = ["train", "--nproc", "1", *TINY, "--set", "checkpoint.every=3",
            "--run-dir", str(run_dir)]
    assert run_cli([*args, "--set", "train.steps=6"], cache_env).returncode == 0
    proc = run_cli([*args, "--set", "train.steps=8"], cache_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming from step-00000006: step 6, sample 48" in proc.stderr
    assert "training steps 7-8 of 8" in proc.stderr and "done: steps 7-8 of 8" in proc.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["start_step"], summary["steps"], summary["samples_seen"]) == (6, 8, 64)
    proc = run_cli(["train", "--nproc", "1", "--run-dir", str(run_dir)], cache_env)
    assert proc.returncode == 0 and "finished run: it reached step 8" in proc.stderr
    assert json.loads((run_dir / "summary.json").read_text()) == summary


def test_same_entry_works_under_torchrun(cache_env, tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", "2", "-m", "disttrain", "train", *TINY,
           "--set", "train.steps=4", "--run-dir", str(run_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=cache_env, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_run_dir(run_dir, 2, 4)
