"""The pre-launch capacity check prices the loss as it will run: with the fused linear +
cross-entropy (``train.fused_loss``, the default) a micro-batch whose full fp32 logits
alone exceed the memory is accepted; the same run with ``train.fused_loss=false``, or a
transformers model whose config changes the head's output (so the fused loss stays
off), is refused naming the batch and the fix."""

from __future__ import annotations

import json

import pytest

from disttrain.config import load_config
from disttrain.errors import ConfigError
from disttrain.plan.capacity import RankMemory, check_batch_fits, check_model_fits
from disttrain.run_checks import resolve

GIB = 2**30
MEMORY = RankMemory(bytes=GIB, source="test")
# micro-batches of 8 x 1024 tokens over a 50,304-word vocabulary: their fp32 logits are
# 4 x 8192 x 50304 B = 1.54 GiB, above the 1 GiB a rank has here; one narrow block
# (d 64) and its model states (~3.3M parameters, 53 MB) are a few % of it
BIG_VOCAB = ["model.vocab_size=50304", "model.seq_len=1024", "model.d_model=64",
             "model.n_head=2", "model.n_layer=1", "train.global_batch=8",
             "train.grad_accum=1"]


def _check(overrides: list[str]) -> None:
    config = load_config(overrides=overrides)
    check_model_fits(config, 1, 1, MEMORY)
    check_batch_fits(config, resolve(config, 1), 1, MEMORY)


def test_a_batch_that_fits_only_with_the_fused_loss_is_accepted_with_it():
    _check(BIG_VOCAB)  # the fused loss: two gradients and one 256 MiB chunk: ~0.3 GiB
    with pytest.raises(ConfigError, match=r"train.global_batch=8: needs ~1\.[6-9] GiB per "
                       r"rank .*the full logits' included.*train.fused_loss=true"):
        _check([*BIG_VOCAB, "train.fused_loss=false"])


def test_a_transformers_head_the_fused_loss_cannot_take_is_priced_on_its_logits(tmp_path):
    """A Llama config of the same vocabulary, with and without a soft cap on the logits
    (Gemma 2's key: the fused loss stays off for it)."""
    def llama(name: str, **extra: object) -> str:
        path = tmp_path / name
        path.write_text(json.dumps({
            "model_type": "llama", "num_hidden_layers": 1, "hidden_size": 64,
            "num_attention_heads": 2, "intermediate_size": 256, "vocab_size": 50304,
            "max_position_embeddings": 1024, **extra}))
        return f"model.hf_config={path}"

    _check([*BIG_VOCAB, llama("plain.json")])
    with pytest.raises(ConfigError, match="the full logits' included"):
        _check([*BIG_VOCAB, llama("capped.json", final_logit_softcapping=30.0)])
