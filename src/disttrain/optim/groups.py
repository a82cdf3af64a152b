"""Which parameters take weight decay: matrices (dim >= 2: linear and embedding weights)
only; biases, norms' gains and other vectors never (the GPT-2 / Llama recipe). Every
state (replicated, ZeRO's flat shards) and a model's own optimizer group them here."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def takes_decay(p: torch.Tensor) -> bool:
    """Whether ``p`` is decayed: a matrix (or higher), not a vector or a scalar."""
    return p.dim() >= 2


def decay_groups(params: Iterable[torch.Tensor], weight_decay: float) -> list[dict]:
    """Two optimizer groups of ``params``: the decayed ones with ``weight_decay``, the
    rest with none (either may be empty)."""
    params = list(params)
    return [{"params": [p for p in params if takes_decay(p)], "weight_decay": weight_decay},
            {"params": [p for p in params if not takes_decay(p)], "weight_decay": 0.0}]
