"""The attention call of a model, as a slot a strategy can fill.

A model's attention module that derives from :class:`AttentionSlot` computes its
attention as ``self.attend(q, k, v, dropout_p)``: torch's causal scaled-dot-product
attention unless a strategy put another function there (context parallelism's ring
attention, :mod:`disttrain.parallel.context`). The model holds no parallelism, and the
strategy recognises the slot by this class, not by an attribute's name. It lives below
both ``models/`` and ``parallel/`` and imports nothing of disttrain, as ``targets``
does.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


class AttentionFn(Protocol):
    """Causal attention of q [B, H, T, Dh] over k, v [B, H_kv, T, Dh] (H_kv divides H;
    query head h reads key head h // (H / H_kv)) -> [B, H, T, Dh]; ``dropout_p`` on the
    attention weights (0 outside training)."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 dropout_p: float) -> torch.Tensor: ...


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                dropout_p: float) -> torch.Tensor:
    """:class:`AttentionFn` over the positions held, in order (torch SDPA, causal)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p,
                                          enable_gqa=k.shape[1] != q.shape[1])


class AttentionSlot(nn.Module):
    """A module whose attention is the function in ``attend`` (:func:`causal_sdpa`
    until a strategy swaps it; a plain attribute, so it is in no state dict), with
    ``dropout`` the probability it passes as ``dropout_p`` in training."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.attend: AttentionFn = causal_sdpa
        self.dropout = dropout
