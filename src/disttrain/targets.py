"""What a target token id means to every loss, whoever computes it.

The plain model's loss (models/) and the vocab-parallel loss (parallel/tensor/) must skip
the same positions, and neither may import the other, so the convention lives here,
below both, importing nothing.
"""

from __future__ import annotations

IGNORE_INDEX = -1
"""A target position with this id carries no loss and is not counted as a token."""

LABEL_IGNORE_INDEX = -100
"""The Hugging Face convention for ``labels``: positions with this id carry no loss."""
