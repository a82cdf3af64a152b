"""The attention call of a model, as a slot a strategy can fill.

A model's attention module that derives from :class:`AttentionSlot` computes its
attention as ``self.attend(q, k, v, dropout_p, document_ids)``: torch's causal
scaled-dot-product attention unless a strategy put another function there (context
parallelism's ring attention, :mod:`disttrain.parallel.context`). The model holds no
parallelism, and the strategy recognises the slot by this class, not by an attribute's
name. It lives below both ``models/`` and ``parallel/`` and imports nothing of
disttrain, as ``targets`` does.

``document_ids`` (None: the whole row is one sequence) number the examples packed into
a row (:mod:`disttrain.data.packing`): a query attends to the keys at or before its
position that carry its own document id, so no example sees another.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


class AttentionFn(Protocol):
    """Causal attention of q [B, H, T, Dh] over k, v [B, H_kv, T, Dh] (H_kv divides H;
    query head h reads key head h // (H / H_kv)) -> [B, H, T, Dh]; ``dropout_p`` on the
    attention weights (0 outside training); ``document_ids`` [B, T] (or None): query i
    reads key j only where ``document_ids[b, j] == document_ids[b, i]``. A function that
    cannot keep documents apart raises on ids it is given, never ignores them."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 dropout_p: float, document_ids: torch.Tensor | None = None
                 ) -> torch.Tensor: ...


def document_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """The block-diagonal causal mask of rows of packed documents: ``document_ids``
    [B, T] -> bool [B, 1, T, T], True where query i may read key j (j <= i and the same
    document)."""
    t = document_ids.shape[-1]
    same = document_ids.unsqueeze(-1) == document_ids.unsqueeze(-2)
    causal = torch.ones(t, t, dtype=torch.bool, device=document_ids.device).tril()
    return (same & causal).unsqueeze(1)


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """:class:`AttentionFn` over the positions held, in order (torch SDPA: causal, or
    with :func:`document_causal_mask` when documents are given)."""
    gqa = k.shape[1] != q.shape[1]
    if document_ids is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p,
                                              enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=document_causal_mask(
        document_ids), dropout_p=dropout_p, enable_gqa=gqa)


class AttentionSlot(nn.Module):
    """A module whose attention is the function in ``attend`` (:func:`causal_sdpa`
    until a strategy swaps it; a plain attribute, so it is in no state dict), with
    ``dropout`` the probability it passes as ``dropout_p`` in training."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.attend: AttentionFn = causal_sdpa
        self.dropout = dropout
