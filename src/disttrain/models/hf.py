"""Hugging Face ``transformers`` causal-LM models built from ``[model]`` (random init,
nothing downloaded), for the command line's ``model.name = gpt2 | llama`` and
``model.hf_config``. ``transformers`` is imported only when one is built (the ``hf``
extra); validation refuses these settings without it.

Their spec has no tensor plan and no pipeline cut yet: data parallelism and every ZeRO
stage apply (ZeRO's units are the model's block list); ``parallel.tp`` / ``parallel.pp``
> 1 are refused before launch.
"""

from __future__ import annotations

import dataclasses
import sys

from torch import nn

from ..config.schema import ModelConfig
from ..spec import ModelSpec, generic_spec, register_spec


def is_hf(cfg: ModelConfig) -> bool:
    return cfg.name != "gpt" or bool(cfg.hf_config)


def build_hf_model(cfg: ModelConfig) -> nn.Module:
    """The transformers model ``cfg`` names, randomly initialised (torch's seed)."""
    import transformers as tf

    if cfg.hf_config:
        config = tf.AutoConfig.from_pretrained(cfg.hf_config)
        return tf.AutoModelForCausalLM.from_config(config)
    if cfg.name == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(
            vocab_size=cfg.vocab_size, n_positions=cfg.seq_len, n_embd=cfg.d_model,
            n_layer=cfg.n_layer, n_head=cfg.n_head, resid_pdrop=cfg.dropout,
            embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout, bos_token_id=0,
            eos_token_id=0))
    return tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
        intermediate_size=4 * cfg.d_model, num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_kv_head or cfg.n_head,
        max_position_embeddings=cfg.seq_len, attention_dropout=cfg.dropout,
        bos_token_id=0, eos_token_id=0))


def hf_config_spec(cfg: ModelConfig) -> ModelSpec:
    """What validation knows of such a model before building it: no tensor plan, no
    pipeline cut (so tp / pp > 1 are refused with the fix)."""
    return ModelSpec(blocks=None, block_costs=(1.0,) * cfg.n_layer)


def matmul_flops_per_token(model: nn.Module, seq_len: int, n_layer: int,
                           d_model: int) -> int:
    """Training FLOPs per token from the model's shapes: 6 per weight of every matrix
    that multiplies activations (embedding lookups excluded, a tied output head counted)
    plus attention's scores and weighted sum, 12 T d per layer (forward and backward)."""
    matmul = sum(p.numel() for m in model.modules() if not isinstance(m, nn.Embedding)
                 for p in m.parameters(recurse=False) if p.dim() == 2)
    return int(6 * matmul + 12 * n_layer * seq_len * d_model)


def hf_dimensions(model: nn.Module, cfg: ModelConfig) -> tuple[int, int, int]:
    """(seq_len, n_layer, d_model) of a built model: from ``[model]``, or from the
    transformers config when ``model.hf_config`` chose it."""
    if not cfg.hf_config:
        return cfg.seq_len, cfg.n_layer, cfg.d_model
    c = model.config
    return cfg.seq_len, int(c.num_hidden_layers), int(c.hidden_size)


def _recognise(model: nn.Module) -> ModelSpec | None:
    """A transformers model (only if transformers is already imported: a model of it
    cannot exist otherwise): its block list for ZeRO and checkpointing, its config."""
    transformers = sys.modules.get("transformers")
    if transformers is None or not isinstance(model, transformers.PreTrainedModel):
        return None
    return dataclasses.replace(generic_spec(model),
                               config_json=model.config.to_json_string())


register_spec(_recognise)

__all__ = ["build_hf_model", "hf_config_spec", "hf_dimensions", "is_hf",
           "matmul_flops_per_token"]
