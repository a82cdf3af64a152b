"""The GPU set's shared oracle: the plain loop's result per precision, computed once."""

from __future__ import annotations

import functools

import pytest
import torch
from gpu_training import ON_CPU, plain_loop


@pytest.fixture(scope="session")
def plain_oracle():
    """(precision, parts) -> (weights, fp16 scaling) of the plain loop on GPU 0 (the CPU
    on the dry run); each computed on first use."""
    device = torch.device("cpu") if ON_CPU else torch.device("cuda", 0)
    return functools.lru_cache(maxsize=None)(
        lambda precision, parts: plain_loop(precision, parts, device))
