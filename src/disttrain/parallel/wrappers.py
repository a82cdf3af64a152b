"""State-dict names that do not see a block wrapper.

A wrapper that parallel/ puts around a block (activation checkpointing, torch.compile
per block) holds it under one attribute, so every name inside gains that segment
(:mod:`disttrain.param_names`). :func:`hide_segment` registers the state-dict hooks that drop
it from ``state_dict()`` and add it back in ``load_state_dict()``: checkpoints move
freely between runs with and without the wrapper.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import nn


def hide_segment(wrapper: nn.Module, segment: str) -> None:
    """``wrapper``'s state dict uses the names of the module it holds as ``segment``."""
    wrapper._register_state_dict_hook(functools.partial(_drop_segment, segment))
    wrapper._register_load_state_dict_pre_hook(functools.partial(_add_segment, segment))


def _drop_segment(segment: str, module: nn.Module, state: dict, prefix: str,
                  _meta: Any) -> None:
    inner = f"{prefix}{segment}."
    for key in [k for k in state if k.startswith(inner)]:
        state[prefix + key[len(inner):]] = state.pop(key)


def _add_segment(segment: str, state: dict, prefix: str, *_: Any) -> None:
    for key in [k for k in state if k.startswith(prefix)
                and not k.startswith(f"{prefix}{segment}.")]:
        state[f"{prefix}{segment}.{key[len(prefix):]}"] = state.pop(key)
