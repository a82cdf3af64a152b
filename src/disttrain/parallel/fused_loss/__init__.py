"""A fused linear + cross-entropy loss: the output head's logits computed chunk by chunk
inside the loss, never whole, forward or backward.

``functions`` holds the maths (:func:`linear_cross_entropy`, vocabulary-parallel with a
tp group), ``head`` the swap of a model's output head for a :class:`HiddenStatesHead`
and the :class:`FusedHead` handle whose ``token_loss`` the step's default loss calls.
"""

from .functions import CHUNK_LOGIT_BYTES, default_chunk_tokens, linear_cross_entropy
from .head import (
    FusedHead,
    HiddenStatesHead,
    fuse_output_head,
    head_refusal,
    loss_line,
    replace_submodule,
)

__all__ = ["CHUNK_LOGIT_BYTES", "FusedHead", "HiddenStatesHead", "default_chunk_tokens",
           "fuse_output_head", "head_refusal", "linear_cross_entropy", "loss_line",
           "replace_submodule"]
