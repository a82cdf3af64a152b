"""The planner's time for the fused loss against the full logits' (``head_work``):
checked against a measurement no figure of the model came from, the H200 run of
``bench/gpu_mfu.py`` (``bench/results/gpu/2026-11-27-h200/3-fused-loss-kernels``: GPT-2
small, bf16, eager, one GPU): the fused loss's tokens/s over the full logits' was
373,059 / 340,177 = 1.097 at micro-batch 16 and 403,545 / 368,800 = 1.094 at 32.

Tolerance: the predicted ratio within 1.05-1.15 (the measured 1.094-1.097 give or take
the 5% the plain loop moved between runs there; pricing the fused loss like the full
logits predicts 1.00, counting no pass over the logits at all 1.2 and more)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from disttrain.plan import ModelShape, Options
from disttrain.plan.cluster import PRESETS
from disttrain.plan.estimate import estimate
from disttrain.plan.layout import PlannedLayout
from disttrain.plan.work import head_work

GPT2_SMALL = ModelShape(name="gpt2", layers=12, hidden=768, heads=12, seq=1024,
                        vocab=50304)


@pytest.mark.parametrize("micro_batch", [16, 32])
def test_the_fused_loss_speeds_the_gpt2_step_as_measured_on_an_h200(micro_batch):
    cluster = replace(PRESETS["h200"], gpus_per_node=1)
    layout = PlannedLayout(mbs=micro_batch)
    full, fused = (estimate(GPT2_SMALL, cluster, layout, micro_batch,
                            Options(precision="bf16", fused_loss=on))
                   for on in (False, True))
    assert 1.05 <= fused.tokens_per_s / full.tokens_per_s <= 1.15


def test_on_a_cpu_the_fused_loss_makes_more_passes_in_place():
    """The CPU's in-place path (six passes over fp32 logits) costs more memory traffic
    than the full logits' three, where a GPU's kernels over bf16 logits cost less."""
    cpu = replace(PRESETS["a100"], async_dispatch=False)
    gpu = PRESETS["a100"]
    for cluster, precision, slower in ((cpu, "fp32", True), (gpu, "bf16", False)):
        full, fused = (head_work(GPT2_SMALL, cluster, 8, precision, fused=on).memory
                       for on in (False, True))
        assert (fused > full) == slower
