"""FLOPs per token of a transformers causal LM: the planner's formula for the GPT-2
and Llama families, else from its modules' shapes."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from ...config.schema import ModelConfig
from .common import as_causal_lm


def matmul_flops_per_token(model: nn.Module, seq_len: int, n_layer: int,
                           d_model: int) -> int:
    """Training FLOPs per token: for the GPT-2 and Llama families the planner's formula
    of the model's config at ``seq_len`` (:func:`~disttrain.shape.hf_config_shape`,
    :meth:`~disttrain.shape.ModelShape.model_flops_per_token`); for another model,
    from its shapes: 6 per weight of every matrix that multiplies activations
    (embedding lookups excluded, a tied output head counted) plus attention's scores
    and weighted sum, 12 T d per layer (forward and backward)."""
    shape = _planner_shape(model, seq_len)
    if shape is not None:
        return int(shape.model_flops_per_token())
    matmul = sum(p.numel() for m in model.modules() if not isinstance(m, nn.Embedding)
                 for p in m.parameters(recurse=False) if p.dim() == 2)
    return int(6 * matmul + 12 * n_layer * seq_len * d_model)


# transformers' model_type of the families the planner's formula describes
_PLANNED_FAMILIES = ("gpt2", "llama", "mistral", "qwen2")


def _planner_shape(model: nn.Module, seq_len: int) -> Any:
    """The planner's shape (a ``ModelShape``) of a GPT-2 or Llama-family transformers
    model at ``seq_len``, or None for another model."""
    from ...errors import UserError
    from ...shape import hf_config_shape

    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if config is None or kind not in _PLANNED_FAMILIES:
        return None
    try:
        return dataclasses.replace(hf_config_shape(config.to_dict(), kind), seq=seq_len)
    except (UserError, TypeError, ValueError):
        return None


def hf_flops_per_token(model: nn.Module, seq_len: int) -> int | None:
    """:func:`matmul_flops_per_token` of a transformers model at ``seq_len`` (its layers
    and width from its config); None for any other model."""
    config = getattr(model, "config", None)
    if not type(model).__module__.startswith("transformers.") or config is None:
        return None
    try:
        return matmul_flops_per_token(model, seq_len, int(config.num_hidden_layers),
                                      int(config.hidden_size))
    except (AttributeError, TypeError, ValueError):
        return None


def hf_dimensions(model: nn.Module, cfg: ModelConfig) -> tuple[int, int, int]:
    """(seq_len, n_layer, d_model) of a built model: from ``[model]``, or from the
    transformers config when ``model.hf_config`` chose it."""
    if not cfg.hf_config:
        return cfg.seq_len, cfg.n_layer, cfg.d_model
    c = as_causal_lm(model).config
    return cfg.seq_len, int(c.num_hidden_layers), int(c.hidden_size)
