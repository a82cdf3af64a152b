"""Context parallelism's core: each sequence split over the N ranks of a cp group,
attention computed as a ring.

- :mod:`.sequence`: the load-balanced split (chunks i and 2N-1-i on cp rank i), a
  rank's part of [B, T, ...] tensors and its tokens' global positions, and back;
- :mod:`.ring`: :func:`ring_attention`, causal attention whose keys and values travel
  the ring (point-to-point, overlapped with the block already held), merged on the
  log-sum-exp, with the backward ring carrying dk, dv home;
- :mod:`.kernels`: one block pair's attention and its gradients (torch's CPU flash
  kernels, or plain maths on any device);
- :mod:`.attention`: switching the built-in GPT or a recognised transformers causal LM
  to ring attention, and the one-line refusal for a model that cannot be;
- the dimension ``parallel.cp`` (entry ``cp`` of :data:`disttrain.dimensions.DIMENSIONS`):
  :mod:`.dimension` (what it applies to a model replica, and each rank's part of a
  micro-batch), :mod:`.check` (its refusals before launch), :mod:`.pricing` (what the
  planner asks it).
"""

from .attention import RECOGNISED_MODEL_TYPES, apply_ring_attention, ring_attention_refusal
from .kernels import KERNELS
from .ring import RingKVFwdRingDKVBwd, ring_attention
from .sequence import (
    chunk_length,
    gather_sequence,
    local_chunks,
    local_positions,
    shift_labels,
    split_sequence,
)

__all__ = ["KERNELS", "RECOGNISED_MODEL_TYPES", "RingKVFwdRingDKVBwd",
           "apply_ring_attention", "chunk_length", "gather_sequence", "local_chunks",
           "local_positions", "ring_attention", "ring_attention_refusal", "shift_labels",
           "split_sequence"]
