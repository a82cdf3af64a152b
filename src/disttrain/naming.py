"""Canonical parameter names: the layout-free names checkpoints and optimizers key on.

Wrappers that parallel/ puts around a model's blocks (activation checkpointing) add a
segment to every parameter name inside them. Both parallel/ (which adds it) and
checkpoint/ (which must save names that do not depend on it) need the same rule, so it
lives here, below both, importing nothing.
"""

from __future__ import annotations

WRAPPED = "checkpointed"
_SEGMENT = f".{WRAPPED}."


def canonical_name(name: str) -> str:
    """``blocks.0.checkpointed.mlp.up.weight`` -> ``blocks.0.mlp.up.weight``."""
    return name.replace(_SEGMENT, ".")
