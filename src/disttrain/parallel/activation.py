"""Activation checkpointing per block: recompute a block's activations in backward
instead of keeping them, trading compute for memory.

:func:`apply_activation_checkpointing` wraps the children of the model's block list
(the first ``nn.ModuleList`` found, e.g. GPT's ``blocks``): all of them (``full``) or
every k-th (``every_k``). The wrapper runs ``torch.utils.checkpoint`` (non-reentrant).
Parameter and state-dict names are unchanged outside the model: :func:`canonical_name`
drops the wrapper's segment, and state-dict hooks do the same for ``state_dict()`` and
``load_state_dict()``, so checkpoints move freely between runs with and without it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

# the rule lives below checkpoint/, which needs it too; re-exported for this module's users
from ..param_names import WRAPPED
from ..param_names import canonical_name as canonical_name
from .wrappers import hide_segment


class CheckpointedBlock(nn.Module):
    """Recomputes ``checkpointed`` (the wrapped block) in backward."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.checkpointed = block
        hide_segment(self, WRAPPED)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.checkpointed(*args, **kwargs)
        return checkpoint(self.checkpointed, *args, use_reentrant=False, **kwargs)


def _block_list(model: nn.Module) -> nn.ModuleList | None:
    return next((m for m in model.modules() if isinstance(m, nn.ModuleList)), None)


def apply_activation_checkpointing(model: nn.Module, mode: str, every_k: int = 1, *,
                                   blocks: nn.ModuleList | None = None) -> int:
    """Wrap blocks in place; returns how many were wrapped. ``mode``: none | full |
    every_k (blocks 0, k, 2k, ... are checkpointed); ``blocks``: the model's block list
    (default: its first ``nn.ModuleList``)."""
    if mode == "none":
        return 0
    blocks = blocks if blocks is not None else _block_list(model)
    if blocks is None:
        raise ValueError("activation checkpointing needs the model's blocks in an "
                         "nn.ModuleList")
    step = 1 if mode == "full" else every_k
    wrapped = 0
    for i in range(0, len(blocks), step):
        if not isinstance(blocks[i], CheckpointedBlock):
            blocks[i] = CheckpointedBlock(blocks[i])
            wrapped += 1
    return wrapped
