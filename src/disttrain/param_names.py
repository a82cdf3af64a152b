"""Canonical parameter names: the layout-free names checkpoints and optimizers key on.

Wrappers that parallel/ puts around a model's blocks (activation checkpointing,
torch.compile per block) add a segment to every parameter name inside them, and so does
a LoRA adapter around the linear layer it adapts (:mod:`disttrain.adapters`). Both
parallel/ (which adds it) and checkpoint/ (which must save names that do not depend on
it) need the same rule, so it lives here, below both, importing nothing.
"""

from __future__ import annotations

WRAPPED = "checkpointed"  # activation checkpointing's wrapper holds the block here
COMPILED = "compiled"     # torch.compile's per-block wrapper holds the block here
ADAPTED = "base_layer"    # a LoRA adapter holds the linear layer it adapts here
_SEGMENTS = (f".{WRAPPED}.", f".{COMPILED}.", f".{ADAPTED}.")


def canonical_name(name: str) -> str:
    """``blocks.0.checkpointed.compiled.mlp.up.weight`` -> ``blocks.0.mlp.up.weight``;
    ``blocks.0.mlp.up.base_layer.weight`` -> ``blocks.0.mlp.up.weight``."""
    for segment in _SEGMENTS:
        name = name.replace(segment, ".")
    return name
