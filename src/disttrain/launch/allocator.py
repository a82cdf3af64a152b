"""The C allocator's settings a worker starts with: freed memory goes back to the system.

glibc's ``malloc`` serves a request of at least ``M_MMAP_THRESHOLD`` bytes with its own
``mmap`` (returned by ``munmap`` when freed) and smaller ones from its heap (kept
resident after ``free`` unless the heap's free top exceeds ``M_TRIM_THRESHOLD``). By
default the threshold is dynamic: each freed mmap-ed block raises it to that block's
size (up to 32 MiB on 64-bit), so after the first step a training process serves its
activations, autograd's per-parameter gradients and its communication buffers from the
heap and keeps them resident once freed. A ZeRO-3 rank's resident set then stays at
its largest phase's peak for the rest of the run, well above the tensors it holds
(``bench/startup_memory.py``: 1.41x the whole fp32 model at world 8, against 0.98x
with the threshold fixed).

``MALLOC_MMAP_THRESHOLD_`` fixes the threshold (which also stops its growth and keeps
the trim threshold at its 128 KiB default), so every buffer of 128 KiB or more is
unmapped when freed. It costs step time on the CPU (each such buffer's pages are zeroed
again as they are touched: +21% for a ZeRO-3 step at world 4 here), so it is asked for:
``DISTTRAIN_MALLOC=return`` makes the launcher set it for the workers it starts
(:func:`allocator_env`; glibc reads it once, as the process starts), a variable the
user set winning. By default the workers keep glibc's defaults. Other allocators
(jemalloc or tcmalloc through ``LD_PRELOAD``) ignore these variables.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

# fixed at glibc's initial default (128 KiB): from there on, every tensor storage of
# 32K fp32 elements or more is its own mapping, returned as it is freed
ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}
# "return": the workers return freed buffers (ALLOCATOR_ENV); anything else, or unset:
# glibc's defaults (the dynamic threshold)
ALLOCATOR_CHOICE_ENV = "DISTTRAIN_MALLOC"
ALLOCATOR_RETURN = "return"


def allocator_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables to add to ``env`` (default: this process's environment) for the
    workers it starts: with ``DISTTRAIN_MALLOC=return``, :data:`ALLOCATOR_ENV`'s but
    those ``env`` already sets; otherwise none."""
    env = os.environ if env is None else env
    if env.get(ALLOCATOR_CHOICE_ENV, "") != ALLOCATOR_RETURN:
        return {}
    return {k: v for k, v in ALLOCATOR_ENV.items() if k not in env}
