"""Mixed precision: autocast for the forward pass, dynamic loss scaling for fp16.

Master weights and optimizer state stay in fp32; only the forward (and the backward it
records) runs in bf16 / fp16. bf16 has fp32's exponent range and needs no loss
scaling; fp16 does: the loss is multiplied by ``scale`` before backward, the gradients
divided by it afterwards, and a step whose gradients overflowed is skipped and the
scale halved (doubled again after ``growth_interval`` good steps).
"""

from __future__ import annotations

import contextlib
import math

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[precision])


class LossScaler:
    """Dynamic loss scale (fp16); a fixed scale of 1 otherwise."""

    def __init__(self, enabled: bool, init_scale: float = 2.0**16,
                 growth_interval: int = 2000) -> None:
        self.enabled = enabled
        self.scale = init_scale if enabled else 1.0
        self.growth_interval = growth_interval
        self.good_steps = 0
        self.skipped = 0

    def update(self, grad_norm: float) -> bool:
        """After unscaling: True if the step may be taken. On overflow the scale halves
        and the step is skipped (counted in ``skipped``)."""
        if not self.enabled:
            return True
        if not math.isfinite(grad_norm):
            self.scale /= 2
            self.good_steps = 0
            self.skipped += 1
            return False
        self.good_steps += 1
        if self.good_steps % self.growth_interval == 0:
            self.scale *= 2
        return True
