"""Context parallelism's pieces that need no process group: the load-balanced split of a
sequence and its inverse, the global positions of a rank's tokens, the shifted labels,
and which models ring attention refuses (one line naming the module), checked in
process against plain indexing and hand-written expectations."""

from __future__ import annotations

import pytest
import torch
from support import TINY_MODEL

from disttrain.config.schema import ModelConfig
from disttrain.errors import ConfigError, UserError
from disttrain.models import GPT
from disttrain.parallel.context import (
    apply_ring_attention,
    chunk_length,
    gather_sequence,
    local_chunks,
    local_positions,
    ring_attention,
    ring_attention_refusal,
    shift_labels,
    split_sequence,
)
from disttrain.parallel.context.attention import _hf_ring_function

# ---- the split ------------------------------------------------------------------------


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_a_rank_holds_chunks_i_and_2n_minus_1_minus_i(cp):
    seq = 4 * cp
    c = seq // (2 * cp)
    x = torch.arange(seq).unsqueeze(0)
    for rank in range(cp):
        first, second = local_chunks(cp, rank)
        assert (first, second) == (rank, 2 * cp - 1 - rank)
        expected = list(range(rank * c, (rank + 1) * c)) + list(
            range(second * c, (second + 1) * c))
        assert split_sequence(x, cp, rank).squeeze(0).tolist() == expected
        assert local_positions(seq, cp, rank).tolist() == expected


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("dim", [1, 2])
def test_split_then_gather_gives_the_sequence_back(cp, dim):
    x = torch.randn(2, 3, 16, 5).movedim(2, dim)  # the sequence on dim
    parts = [split_sequence(x, cp, r, dim=dim) for r in range(cp)]
    assert all(p.shape[dim] == 16 // cp for p in parts)
    assert torch.equal(gather_sequence(parts, dim=dim), x)
    # every position exactly once over the ranks
    held = torch.cat([local_positions(16, cp, r) for r in range(cp)])
    assert sorted(held.tolist()) == list(range(16))


def test_causal_work_is_the_same_on_every_rank():
    """Key positions each rank's queries attend to (the causal work) are equal, where
    the contiguous split would give the last rank 2N-1 times as much as the first."""
    seq, cp = 64, 4
    work = [int((local_positions(seq, cp, r) + 1).sum()) for r in range(cp)]
    assert len(set(work)) == 1
    contiguous = [int((torch.arange(r * 16, (r + 1) * 16) + 1).sum()) for r in range(cp)]
    assert contiguous[-1] > 5 * contiguous[0]


@pytest.mark.parametrize("seq, cp", [(10, 4), (6, 4), (7, 1), (12, 8)])
def test_a_length_not_a_multiple_of_2cp_names_the_value_and_the_fix(seq, cp):
    with pytest.raises(ConfigError) as e:
        chunk_length(seq, cp)
    msg = str(e.value)
    assert f"={seq}" in msg and f"multiple of {2 * cp}" in msg and "\n" not in msg
    with pytest.raises(ConfigError, match="sequence dim"):
        split_sequence(torch.zeros(1, seq), cp, 0)


def test_labels_shift_before_the_split():
    labels = torch.arange(16).view(1, 16) + 100
    targets = shift_labels(labels)
    assert targets[0, :-1].tolist() == list(range(101, 116)) and targets[0, -1] == -100
    # rank 0 of cp 2 holds positions 0-3 and 12-15: its targets are the next tokens of
    # those positions (not the rank's own next slot, which jumps from 3 to 12)
    assert split_sequence(targets, 2, 0).tolist() == [[101, 102, 103, 104,
                                                       113, 114, 115, -100]]


# ---- refusals ---------------------------------------------------------------------------


def test_the_gpt_runs_without_attention_dropout_and_is_refused_with_it():
    assert ring_attention_refusal(GPT(ModelConfig(**TINY_MODEL))) is None
    line = ring_attention_refusal(GPT(ModelConfig(**TINY_MODEL, dropout=0.1)))
    assert line is not None and "blocks.0.attn (CausalSelfAttention)" in line
    assert "model.dropout = 0" in line and "\n" not in line
    with pytest.raises(UserError, match="attention dropout 0.1"):
        apply_ring_attention(GPT(ModelConfig(**TINY_MODEL, dropout=0.1)), None)


def test_ring_attention_refuses_dropout_and_shapes_it_cannot_split():
    q = torch.zeros(1, 4, 8, 8)
    with pytest.raises(ValueError, match="dropout_p=0.1.*attention dropout to 0"):
        ring_attention(q, q, q, None, dropout_p=0.1)
    with pytest.raises(ValueError, match="divides the query heads"):
        ring_attention(q, torch.zeros(1, 3, 8, 8), torch.zeros(1, 3, 8, 8), None)
    with pytest.raises(ValueError, match="two chunks.*split_sequence"):
        odd = torch.zeros(1, 4, 7, 8)
        ring_attention(odd, odd, odd, None)
    with pytest.raises(ValueError, match="'fused' does not run on meta"):
        on_meta = torch.zeros(1, 4, 8, 8, device="meta")
        ring_attention(on_meta, on_meta, on_meta, None, kernel="fused")


def _hf(family: str, **config):
    transformers = pytest.importorskip("transformers")
    values = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 64, **config}
    configs = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config",
               "qwen3": "Qwen3Config", "gpt2": "GPT2Config", "gemma2": "Gemma2Config"}
    cfg = getattr(transformers, configs[family])(**values)
    with torch.device("meta"):  # the check reads the structure only
        return transformers.AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize("family, config", [
    ("llama", {}), ("mistral", {"sliding_window": None}), ("qwen2", {}), ("qwen3", {}),
    ("mistral", {"sliding_window": 64}),  # a window as long as the sequence is causal
])
def test_recognised_families_run(family, config):
    assert ring_attention_refusal(_hf(family, **config), seq_len=64) is None


@pytest.mark.parametrize("family, config, seq, expected", [
    ("mistral", {"sliding_window": 8}, 64,
     r"model.layers.0.self_attn \(MistralAttention\): sliding window 8 shorter"),
    ("mistral", {"sliding_window": 8}, None, "sliding window 8 shorter than the sequence"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}, 64,
     r"model.layers.1.self_attn \(Qwen2Attention\): sliding window 8"),
    ("llama", {"attention_dropout": 0.1}, 64, "attention_dropout 0.1"),
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0,
                                   "rope_theta": 10000.0}}, 64, "rope_type 'dynamic'"),
    ("gpt2", {"n_embd": 32, "n_layer": 1, "n_head": 4}, 64,
     "GPT2LMHeadModel: context parallelism needs an attention it recognises"),
    ("gemma2", {"head_dim": 8}, 64, "Gemma2ForCausalLM: .* this is gemma2"),
])
def test_other_attention_is_refused_naming_the_module(family, config, seq, expected):
    line = ring_attention_refusal(_hf(family, **config), seq_len=seq)
    assert line is not None and "\n" not in line
    assert pytest.importorskip("re").search(expected, line), line


def test_a_mask_softcap_or_short_window_at_run_time_is_refused():
    run = _hf_ring_function(None, None)  # refused before any message
    module, q = torch.nn.Module(), torch.zeros(1, 4, 8, 8)
    with pytest.raises(ValueError, match="no attention_mask"):
        run(module, q, q, q, torch.ones(1, 8))
    with pytest.raises(ValueError, match="softcapping 50.0"):
        run(module, q, q, q, None, softcap=50.0)
