"""The planner against published runs (pure Python, no training): the recomputation
choice of every llm-foundry row, the rank of published layouts on small clusters, and
one definition of the FLOPs per token and of the activation bytes, shared by the
models, the metrics and the planner.

The published figures are never fitted to (:mod:`disttrain.plan.published`); these
tests hold what the planner gets right today so that a change to the time or memory
model that loses it fails. bench/plan.py prints every table's figures.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from disttrain.config.schema import ModelConfig
from disttrain.dimensions import Role
from disttrain.models import GPT, flops_per_token
from disttrain.plan import PRESETS, ModelShape, Options, PlannedLayout, estimate, gpt_shape
from disttrain.plan.memory import gpt_activation_bytes
from disttrain.plan.published import LLM_FOUNDRY_A100, LLM_FOUNDRY_H100, LLM_FOUNDRY_TABLES
from disttrain.plan.published_check import check_row
from disttrain.plan.published_layouts import LAYOUT_TABLES, megatron_h100_rows


@pytest.mark.parametrize("table", LLM_FOUNDRY_TABLES, ids=lambda t: t.name)
def test_every_llm_foundry_recomputation_choice_is_the_planners(table):
    """Where the authors checkpointed whole blocks, the same micro-batch without it
    does not fit in the planner's memory model; where they did not, it fits (at a
    micro-batch, no recomputation is always the faster)."""
    wrong = []
    for row in table.rows:
        check = check_row(row, rank=False)
        if not check.recompute_right:
            wrong.append((row.label, row.layout.recompute, check.recompute_pick))
    assert not wrong


def _row(runs, model: str, seq: int, gpus: int):
    return next(r.row() for r in runs if (r.model, r.seq, r.gpus) == (model, seq, gpus))


@pytest.mark.parametrize("row", [
    _row(LLM_FOUNDRY_A100, "7b", 2048, 8), _row(LLM_FOUNDRY_H100, "13b", 4096, 8),
    _row(LLM_FOUNDRY_H100, "760m", 2048, 8),
    # 48 GPUs: a search of about 10 s
    pytest.param(megatron_h100_rows()[0], marks=pytest.mark.slow),
], ids=lambda r: r.label)
def test_published_degrees_rank_in_the_planners_top_three(row):
    check = check_row(row)
    assert check.rank is not None and check.rank <= 3, (check.rank, check.candidates)
    assert check.candidates > 3  # a ranking among several, not a lone candidate


def test_tables_name_their_sources_and_what_they_leave_out():
    for table in (*LLM_FOUNDRY_TABLES, *LAYOUT_TABLES):
        assert table.rows and "@" in table.source and table.left_out, table.name
        for row in table.rows:  # each row's batch splits over its replicas
            assert row.global_batch % row.layout.role(Role.SAMPLES) == 0, row.label


# one FLOPs formula -----------------------------------------------------------------

def _counted_flops(model: torch.nn.Module, ids: torch.Tensor) -> float:
    """torch's own count of a forward and backward, per token (math attention, so the
    counter sees the scores and the weighted sum as matmuls)."""
    counter = FlopCounterMode(display=False)
    with counter, sdpa_kernel(SDPBackend.MATH):
        out = model(ids)
        (out.logits if hasattr(out, "logits") else out).float().sum().backward()
    return counter.get_total_flops() / ids.numel()


def test_the_gpt_counts_its_flops_with_the_planners_formula():
    cfg = ModelConfig(vocab_size=96, seq_len=16, n_layer=3, n_head=4, d_model=32)
    by_hand = ModelShape(layers=3, hidden=32, heads=4, seq=16, vocab=96, positions=16,
                         qkv_bias=False)
    assert flops_per_token(cfg) == by_hand.model_flops_per_token()
    counted = _counted_flops(GPT(cfg), torch.randint(0, 96, (2, 16)))
    # the formula leaves out what is not a matmul (norms, softmax, the loss): a few %
    assert counted == pytest.approx(by_hand.model_flops_per_token(), rel=0.05)


def test_a_transformers_llama_counts_its_flops_with_the_planners_formula():
    transformers = pytest.importorskip("transformers")
    from disttrain.models.hf import matmul_flops_per_token

    cfg = transformers.LlamaConfig(vocab_size=80, hidden_size=32, intermediate_size=48,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    seq = 24
    by_hand = ModelShape(layers=2, hidden=32, heads=4, kv_heads=2, ffn=48, gated=True,
                         seq=seq, vocab=80, bias=False, qkv_bias=False, norm="rmsnorm",
                         tied=False)
    assert matmul_flops_per_token(model, seq, 2, 32) == by_hand.model_flops_per_token()
    # the same from the built model's weights: 6 per matrix weight, 12 s d per layer
    weights = sum(p.numel() for n, p in model.named_parameters()
                  if p.dim() == 2 and "embed_tokens" not in n)
    assert 6 * weights + 12 * 2 * seq * 32 == by_hand.model_flops_per_token()
    counted = _counted_flops(model, torch.randint(0, 80, (2, seq)))
    assert counted == pytest.approx(by_hand.model_flops_per_token(), rel=0.05)


# one activation model ----------------------------------------------------------------

@pytest.mark.parametrize("precision, b", [("fp32", 1), ("bf16", 3)])
def test_the_gpts_activation_estimate_is_the_planners(precision, b):
    """memory.gpt_activation_bytes (the launcher's screen) and the planner's estimate
    of one stage at one rank are one model: the same bytes."""
    cfg = ModelConfig(vocab_size=96, seq_len=16, n_layer=3, n_head=4, d_model=32)
    shape = gpt_shape(cfg)
    est = estimate(shape, PRESETS["a100-80gb"], PlannedLayout(mbs=b), b,
                   Options(precision=precision, accounting="disttrain"), memory_only=True)
    assert est.stage_memory(0).activations == pytest.approx(
        gpt_activation_bytes(cfg, micro_batch=b, precision=precision), abs=0.5)


def test_framework_overlaps_hide_only_communication():
    """Megatron-LM's overlaps (tp collectives pipelined with matmuls, ZeRO-1's gather
    behind the next forward) shorten the step by what they hide and nothing else."""
    from dataclasses import replace

    shape = ModelShape(layers=8, hidden=8192, heads=64, seq=4096, vocab=131072,
                       tied=False)
    cluster = replace(PRESETS["h100-80gb"], nodes=2)
    lay = PlannedLayout(tp=8, dp=2, mbs=1, zero=1)
    plain = estimate(shape, cluster, lay, 8, Options(accounting="mixed"))
    hidden = estimate(shape, cluster, lay, 8, Options(accounting="mixed",
                                                        layer_comm_overlap=True,
                                                        param_gather_overlap=True))
    saved = {k: plain.split[k] - hidden.split[k] for k in plain.split}
    assert saved["tp_comm"] > 0 and saved["dp_all_gather"] > 0
    assert all(v == pytest.approx(0, abs=1e-12) for k, v in saved.items()
               if k not in ("tp_comm", "dp_all_gather"))
    assert plain.step_time_s - hidden.step_time_s == pytest.approx(sum(saved.values()))
    assert sum(hidden.split.values()) == pytest.approx(hidden.step_time_s)
