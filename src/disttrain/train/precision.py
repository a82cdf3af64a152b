"""Mixed precision: autocast for the forward pass, dynamic loss scaling for fp16.

Master weights and optimizer state stay in fp32; only the forward (and the backward it
records) runs in bf16 / fp16. bf16 has fp32's exponent range and needs no loss
scaling; fp16 does: the loss is multiplied by ``scale`` before backward, the gradients
divided by it afterwards, and a step whose gradients overflowed is skipped and the
scale halved (doubled again after ``growth_interval`` good steps).
"""

from __future__ import annotations

import contextlib

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[precision])


class LossScaler:
    """Dynamic loss scale (fp16) kept on the device, so no step waits for the host to
    decide it; disabled (bf16, fp32): no scale at all.

    ``scale`` (float32, 0-dim) multiplies the loss before backward; :meth:`update`
    halves it after a step whose gradients overflowed (that step's update is skipped
    on the device) and doubles it after ``growth_interval`` good steps in a row.
    ``skipped`` counts the overflowed steps once the host has read their flags
    (:meth:`count_skipped`)."""

    def __init__(self, enabled: bool, device: torch.device | None = None,
                 init_scale: float = 2.0**16, growth_interval: int = 2000) -> None:
        self.enabled = enabled
        device = device or torch.device("cpu")
        self.scale: torch.Tensor | None = (
            torch.full((), init_scale, dtype=torch.float32, device=device) if enabled else None)
        self.good_steps = torch.zeros((), dtype=torch.int64, device=device)
        self.growth_interval = growth_interval
        self.skipped = 0

    def update(self, overflow: torch.Tensor, counted: torch.Tensor) -> None:
        """After a step: ``overflow`` (bool, 0-dim) its gradients held a nan / inf;
        ``counted`` (bool, 0-dim) the step counts for the scale at all (a step whose
        loss itself is non-finite is a divergence, not an overflow, and changes
        nothing). All on the device."""
        if self.scale is None:
            return
        good = torch.where(overflow, 0, self.good_steps + 1)
        grow = good >= self.growth_interval
        scale = torch.where(overflow, self.scale / 2,
                            torch.where(grow, self.scale * 2, self.scale))
        self.scale.copy_(torch.where(counted, scale, self.scale))
        self.good_steps.copy_(torch.where(counted, torch.where(grow, 0, good),
                                          self.good_steps))

    def count_skipped(self, overflowed: bool) -> None:
        """The host has read a step's flag: one more skipped step if it overflowed."""
        self.skipped += int(self.enabled and overflowed)
