"""Switching a model's attention to ring attention, and saying when it cannot be.

- A model whose attention modules derive from :class:`~disttrain.attention.AttentionSlot`
  (the built-in GPT): each slot's ``attend`` becomes ring attention over the cp group.
- A transformers causal LM of a family whose attention is recognised (Llama, Mistral,
  Qwen2, Qwen3: q/k/v/o projections, rotary positions, grouped-query heads, the
  attention called through transformers' ``AttentionInterface``): a ring attention
  function is registered with ``AttentionInterface`` under a name of its own per cp
  group and selected on the model's config (``set_attn_implementation``).

Either way the model's code is unchanged and the caller passes what a rank holds: its
part of the input ids (:func:`.sequence.split_sequence`) and their global positions as
``position_ids`` (:func:`.sequence.local_positions`; the GPT's learned positions and
transformers' rotary ones are read at those indices). :func:`ring_attention_refusal`
says, in one line naming the module, why a model cannot run this way; it only reads
the model, so validation can call it on a model built on the meta device.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol, cast

import torch
from torch import nn

from ...attention import AttentionSlot
from ...comm.collectives import Communicator
from ...errors import UserError
from .ring import ring_attention

# transformers model types whose attention modules this adapter has been checked
# against: q_proj/k_proj/v_proj/o_proj, rotary positions from position_ids, the
# attention called through AttentionInterface with (scaling, dropout, sliding_window)
RECOGNISED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# rotary variants that pick their frequencies from the largest position a rank holds
_POSITION_DEPENDENT_ROPE = ("dynamic", "longrope")
_HF_PREFIX = "disttrain_ring"


class _SwappableAttention(Protocol):
    """What this module calls on a transformers ``PreTrainedModel``."""

    def set_attn_implementation(self, attn_implementation: str) -> None: ...


def apply_ring_attention(model: nn.Module, comm: Communicator, *,
                         seq_len: int | None = None, kernel: str | None = None) -> None:
    """Make every attention of ``model`` ring attention over ``comm`` (the cp group);
    refuse (:class:`~disttrain.errors.UserError`, exit code 2, with
    :func:`ring_attention_refusal`'s line) a model it does not fit.
    ``seq_len``: the global sequence length, when known (a sliding window at least that
    long is plain causal attention)."""
    refusal = ring_attention_refusal(model, seq_len)
    if refusal is not None:
        raise UserError(refusal)
    attend = functools.partial(_slot_ring, comm=comm, kernel=kernel)
    slots = [m for m in model.modules() if isinstance(m, AttentionSlot)]
    for slot in slots:
        slot.attend = attend
    if not slots:
        cast(_SwappableAttention, model).set_attn_implementation(
            _register_hf_ring(comm, kernel))


def _slot_ring(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
               document_ids: torch.Tensor | None = None, *, comm: Communicator,
               kernel: str | None) -> torch.Tensor:
    """An :class:`~disttrain.attention.AttentionFn` that is ring attention over ``comm``
    (causal over the whole sequence: packed documents are refused)."""
    if document_ids is not None:
        raise ValueError("ring attention is causal over the whole sequence and cannot keep "
                         "packed documents apart; packing needs parallel.cp = 1")
    return ring_attention(q, k, v, comm, dropout_p=dropout_p, kernel=kernel)


def ring_attention_refusal(model: nn.Module, seq_len: int | None = None) -> str | None:
    """None if ``model``'s attention can run as ring attention, else one line saying
    which module stops it and what to do."""
    slots = [(n, m) for n, m in model.named_modules() if isinstance(m, AttentionSlot)]
    if slots:
        return _slot_refusal(slots)
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if config is None or model_type not in RECOGNISED_MODEL_TYPES:
        return (f"{type(model).__name__}: context parallelism needs an attention it "
                f"recognises (the built-in GPT, or a transformers "
                f"{', '.join(RECOGNISED_MODEL_TYPES)} model; this is "
                f"{model_type or 'not a transformers model'}); use parallel.cp = 1")
    return _hf_refusal(model, config, seq_len)


def _slot_refusal(slots: list[tuple[str, AttentionSlot]]) -> str | None:
    for name, m in slots:
        if m.dropout > 0:
            return (f"{name} ({type(m).__name__}): attention dropout {m.dropout} is not "
                    "supported under context parallelism; set it to 0 (the built-in "
                    "GPT: model.dropout = 0)")
    return None


def _attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules holding q_proj, k_proj, v_proj and o_proj (a transformers model's
    self-attention layers)."""
    parts = ("q_proj", "k_proj", "v_proj", "o_proj")
    return [(n, m) for n, m in model.named_modules()
            if all(isinstance(getattr(m, p, None), nn.Module) for p in parts)]


def _hf_refusal(model: nn.Module, config: Any, seq_len: int | None) -> str | None:
    """The first reason a recognised transformers family's model cannot run the ring."""
    kind = type(model).__name__
    attention = _attention_modules(model)
    if not attention:
        return f"{kind}: no q_proj/k_proj/v_proj/o_proj attention found; use parallel.cp = 1"
    can_set = getattr(model, "_can_set_attn_implementation", None)
    if can_set is None or not can_set():
        return (f"{kind}: its attention is not called through transformers' "
                "AttentionInterface, so it cannot be swapped; use parallel.cp = 1")
    if float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0:
        return (f"{kind}: attention_dropout {config.attention_dropout} is not supported "
                "under context parallelism; set the config's attention_dropout = 0")
    rope = _rope_types(config)
    for rope_type in rope:
        if any(p in rope_type for p in _POSITION_DEPENDENT_ROPE):
            return (f"{kind}: rope_type {rope_type!r} picks its frequencies from the largest "
                    "position a rank holds, which differs between cp ranks; use "
                    "parallel.cp = 1 or a rope type without it")
    for name, m in attention:
        reason = _module_refusal(m, config, seq_len)
        if reason:
            return f"{name} ({type(m).__name__}): {reason}"
    return None


def _rope_types(config: Any) -> list[str]:
    """The rope_type of every rotary setting in ``config`` (one, or one per layer type)."""
    params = getattr(config, "rope_parameters", None) or {}
    if "rope_type" in params or "type" in params:
        return [str(params.get("rope_type", params.get("type")))]
    return [str(p.get("rope_type", "default")) for p in params.values() if isinstance(p, dict)]


def _module_refusal(m: nn.Module, config: Any, seq_len: int | None) -> str | None:
    if getattr(m, "is_causal", True) is not True:
        return "not causal; ring attention is causal attention only (use parallel.cp = 1)"
    softcap = getattr(m, "attn_logit_softcapping", None) or getattr(
        config, "attn_logit_softcapping", None)
    if softcap:
        return (f"attention softcapping {softcap} is not supported under context "
                "parallelism; use parallel.cp = 1")
    window = _sliding_window(m, config)
    if window is not None and (seq_len is None or seq_len > window):
        need = "the sequence length" if seq_len is None else f"the sequence ({seq_len})"
        return (f"sliding window {window} shorter than {need}; ring attention attends to "
                "the whole causal past: set the config's sliding_window to None (or at "
                "least the sequence length) or use parallel.cp = 1")
    return None


def _sliding_window(m: nn.Module, config: Any) -> int | None:
    """The window the module's attention passes on (Qwen: per layer, on the module;
    Mistral: the config's), or None."""
    window: Any = getattr(m, "sliding_window", None) if hasattr(m, "sliding_window") \
        else getattr(config, "sliding_window", None)
    return int(window) if window else None


def _register_hf_ring(comm: Communicator, kernel: str | None) -> str:
    """Register a ring attention over ``comm`` with transformers' AttentionInterface;
    its name (one per cp group: the function closes over the group)."""
    from transformers import AttentionInterface

    name = f"{_HF_PREFIX}_{comm.name}_{id(comm):x}"
    AttentionInterface.register(name, _hf_ring_function(comm, kernel))
    return name


def _hf_ring_function(comm: Communicator, kernel: str | None) -> Callable[..., Any]:
    def ring_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                               value: torch.Tensor, attention_mask: torch.Tensor | None,
                               scaling: float | None = None, dropout: float = 0.0,
                               sliding_window: int | None = None,
                               softcap: float | None = None, **kwargs: Any
                               ) -> tuple[torch.Tensor, None]:
        """transformers' attention function signature: query [B, H, 2c, Dh], key /
        value [B, H_kv, 2c, Dh] -> ([B, 2c, H, Dh], no weights)."""
        where = type(module).__name__
        if attention_mask is not None:
            raise ValueError(f"{where}: ring attention takes no attention_mask (it is "
                             "causal over the whole sequence); under context parallelism "
                             "pass unpadded sequences without a mask")
        if softcap:
            raise ValueError(f"{where}: attention softcapping {softcap} is not supported "
                             "under context parallelism")
        total = query.shape[2] * comm.size
        if sliding_window is not None and sliding_window < total:
            raise ValueError(f"{where}: sliding window {sliding_window} is shorter than "
                             f"the sequence ({total}); ring attention is not windowed")
        out = ring_attention(query, key, value, comm, scale=scaling, dropout_p=dropout,
                             kernel=kernel)
        return out.transpose(1, 2).contiguous(), None

    return ring_attention_forward
