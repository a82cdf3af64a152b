"""Every parameter under a tensor-parallel plan is classified before anything trains
(sharded, replicated with identical gradients, replicated with partial ones), an
unclassified one inside a tensor-parallel region is refused naming it, and the first
step proves the identical ones identical across the tp ranks.

The wrong plans here are the ones that trained silently before: a transformers Qwen3
(per-head RMSNorms ``q_norm`` / ``k_norm`` inside attention, whose gradients each tp rank
computes from its own heads only) declared replicated; an OLMo2 (its ``q_norm`` normalises
the whole width of ``q_proj``'s output, which no rank holds); a parameter the plan has
never heard of inside the attention.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from hf_support import padded_rows
from torch import nn

from disttrain.config.schema import ModelConfig
from disttrain.errors import ConfigError, TensorParallelGradientError
from disttrain.models import GPT, GPT_TP_PLAN
from disttrain.parallel.tensor import apply_tensor_parallel
from disttrain.spec import (
    IDENTICAL,
    PARTIAL,
    SHARDED,
    UnclassifiedParameter,
    classify_tp_params,
    spec_for,
)
from disttrain.testing import run_distributed

pytestmark = pytest.mark.slow  # spawns worlds or trains: not in the quick check

transformers = pytest.importorskip("transformers")

MODEL = {"vocab_size": 64, "seq_len": 16, "n_layer": 2, "n_head": 2, "d_model": 32}
VOCAB, SEQ = 64, 12
TRAIN = {"steps": 4, "global_batch": 8, "lr": 3e-3, "schedule": "constant",
         "warmup_steps": 0, "log_every": 2, "eval_samples": 8}


def _qwen3() -> nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0))


def _olmo2_config():
    from transformers import Olmo2Config

    return Olmo2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0,
                       pad_token_id=0)


def test_the_gpt_plan_classifies_every_parameter():
    kinds = classify_tp_params(GPT(ModelConfig(**MODEL)), GPT_TP_PLAN)
    assert kinds["blocks.0.attn.qkv.weight"] == kinds["blocks.0.mlp.up.bias"] == SHARDED
    assert kinds["blocks.0.attn.out.weight"] == SHARDED
    assert kinds["blocks.0.attn.out.bias"] == IDENTICAL  # after the all-reduce
    assert kinds["blocks.0.ln1.weight"] == kinds["pos_emb.weight"] == IDENTICAL
    assert "head.weight" not in kinds  # tied: classified once, as the embedding
    assert len(kinds) == len(list(GPT(ModelConfig(**MODEL)).parameters()))


def test_qwen3_per_head_norms_are_recognised_as_partial():
    model = _qwen3()
    spec = spec_for(model)
    assert spec.tp_refusal is None
    kinds = classify_tp_params(model, spec.tp_plan)
    assert {k for k, v in kinds.items() if v == PARTIAL} == {
        f"model.layers.{i}.self_attn.{n}.weight" for i in (0, 1) for n in ("q_norm", "k_norm")}
    assert kinds["model.layers.0.input_layernorm.weight"] == IDENTICAL


def test_a_whole_width_norm_on_a_column_parallel_output_is_refused_before_launch(tmp_path):
    """OLMo2's q_norm spans the whole of q_proj's output: no tp rank holds it. The
    command line refuses tp 2 before any worker starts: exit 2, one line naming it."""
    _olmo2_config().save_pretrained(tmp_path / "olmo2")
    done = subprocess.run(
        [sys.executable, "-m", "disttrain", "train", "--nproc", "2", "--run-dir",
         str(tmp_path / "run"), "--set", f"model.hf_config={tmp_path / 'olmo2' / 'config.json'}",
         "--set", "parallel.tp=2", "--set", f"model.seq_len={SEQ}"],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("disttrain: error")]
    assert len(lines) == 1, done.stderr
    assert "model.layers.0.self_attn.q_norm.weight" in lines[0]
    assert "whole output width" in lines[0] and "parallel.tp=1" in lines[0]
    assert not (tmp_path / "run").exists()


def test_an_unknown_parameter_inside_attention_is_refused_naming_it():
    model = GPT(ModelConfig(**MODEL))
    model.blocks[0].attn.temperature = nn.Parameter(torch.ones(2))
    with pytest.raises(UnclassifiedParameter, match=r"'blocks\.0\.attn\.temperature'"
                       r".*'blocks\.\*\.attn': 'partial'"):
        classify_tp_params(model, GPT_TP_PLAN)
    comm = SimpleNamespace(size=2, rank=0)
    with pytest.raises(ConfigError, match=r"parallel\.tp=2: parameter 'blocks\.0\.attn"
                       r"\.temperature' sits inside the tensor-parallel region"):
        apply_tensor_parallel(model, comm)
    # declared, it is classified (here as per-head, summed over tp)
    plan = {**GPT_TP_PLAN, "blocks.*.attn": "partial"}
    assert classify_tp_params(model, plan)["blocks.0.attn.temperature"] == PARTIAL


def test_sequence_parallel_norms_use_the_same_classification():
    """One mechanism: under sequence parallelism the plan's ``sequence`` norms and the
    row-parallel biases become partial, as a ``partial`` module is."""
    run_distributed(_kinds_under_sp, 2, timeout=60)


def _kinds_under_sp() -> None:
    from disttrain.comm import CollectiveLedger, Communicator

    comm = Communicator(None, CollectiveLedger(), "tp")
    for sp, want in ((False, IDENTICAL), (True, PARTIAL)):
        model = GPT(ModelConfig(**MODEL))
        tp = apply_tensor_parallel(model, comm, sequence_parallel=sp)
        assert tp.kind("blocks.0.ln1.weight") == tp.kind("blocks.0.attn.out.bias") == want
        assert tp.kind("blocks.0.attn.qkv.weight") == SHARDED
        assert tp.kind("pos_emb.weight") == IDENTICAL
        assert {id(p) for p in tp.partial_params} == (
            {id(p) for n, p in model.named_parameters() if tp.kind(n) == PARTIAL})


def _fit_qwen3(run_dir: str, plan_change: dict, parallel: dict) -> dict:
    """Qwen3 at tp 2 under its recognised plan changed by ``plan_change``: the error
    that stopped it (None if it trained) and whether the weights were still the initial
    ones then."""
    from disttrain import Trainer

    model = _qwen3()
    spec = spec_for(model)
    spec = dataclasses.replace(spec, tp_plan={**spec.tp_plan, **plan_change})
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    trainer = Trainer(model, padded_rows(32, SEQ, VOCAB), spec=spec, progress=False,
                      config={"train": TRAIN, "parallel": {"tp": 2, **parallel},
                              "checkpoint": {"every": 0}}, run_dir=run_dir)
    try:
        trainer.fit()
    except TensorParallelGradientError as e:
        kept = ("model.norm.weight", "model.layers.0.input_layernorm.weight")
        params = dict(trainer.model.named_parameters())
        return {"error": str(e),
                "unchanged": all(torch.equal(params[n], before[n]) for n in kept)}
    return {"error": None}


WRONG = {"model.layers.*.self_attn.q_norm": "replicated",
         "model.layers.*.self_attn.k_norm": "replicated"}


def test_the_first_step_proof_stops_a_per_head_norm_declared_identical(tmp_path):
    got = run_distributed(_fit_qwen3, 2, args=(str(tmp_path), WRONG, {}), timeout=180)
    for rank in got:  # every rank stops, before the optimizer changed anything
        assert rank["unchanged"], rank
        assert "at the first step" in rank["error"]
        assert "'model.layers.0.self_attn.q_norm.weight'" in rank["error"]
        assert "replicated with identical gradients" in rank["error"]
        assert "\n" not in rank["error"]
    assert not (tmp_path / "model.safetensors").exists()


def test_switched_off_the_same_wrong_plan_trains_silently(tmp_path):
    """parallel.tp_check_grads=false: nothing checks the plan, and the wrong one trains
    to the end (the failure the proof exists for)."""
    got = run_distributed(_fit_qwen3, 2, timeout=180,
                          args=(str(tmp_path), WRONG, {"tp_check_grads": False}))
    assert got[0]["error"] is None
    assert (tmp_path / "model.safetensors").exists()


def test_a_correct_plan_passes_the_proof_silently(tmp_path):
    got = run_distributed(_fit_qwen3, 2, args=(str(tmp_path), {}, {}), timeout=180)
    assert got[0]["error"] is None
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == TRAIN["steps"]
