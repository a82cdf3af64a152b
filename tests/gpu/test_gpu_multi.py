"""The multi-rank strategies on two (or four) GPUs through NCCL, rank r on GPU r.

Each case trains through the Trainer and must end on the weights of the single-process
plain loop on GPU 0 (see gpu_training.py): dp = 2 (fp32 with accumulation, bf16, fp16
with loss scaling), ZeRO-3 at dp = 2, tensor parallelism at tp = 2 (also with sequence
parallelism), pipelines at pp = 2 under every schedule, train.compile under ZeRO-1 and
in a pipeline, and with four GPUs the hybrid (2, 2, 1) and (2, 1, 2) layouts. Skipped unless
the machine has enough GPUs.
"""

from __future__ import annotations

import pytest
from gpu_training import GPU_SET, Case, assert_follows_plain_loop, train_case

pytestmark = GPU_SET

TWO_GPU_CASES = [
    Case("dp2-fp32-accum2", (2, 1, 1), grad_accum=2),
    Case("dp2-bf16", (2, 1, 1), precision="bf16"),
    Case("dp2-fp16", (2, 1, 1), precision="fp16"),
    Case("dp2-zero3-fp32-accum2", (2, 1, 1), zero=3, grad_accum=2),
    Case("dp2-zero3-bf16", (2, 1, 1), zero=3, precision="bf16"),
    Case("tp2-fp32", (1, 1, 2)),
    Case("tp2-sequence-parallel-bf16", (1, 1, 2), precision="bf16",
         parallel={"sequence_parallel": True}),
    Case("pp2-gpipe", (1, 2, 1), grad_accum=4, parallel={"pp_schedule": "gpipe"}),
    Case("pp2-1f1b", (1, 2, 1), grad_accum=4, parallel={"pp_schedule": "1f1b"}),
    Case("pp2-interleaved", (1, 2, 1), grad_accum=4,
         parallel={"pp_schedule": "interleaved"}),
    Case("dp2-zero1-fp32-compile", (2, 1, 1), zero=1, train={"compile": True}),
    Case("pp2-1f1b-bf16-compile", (1, 2, 1), precision="bf16", grad_accum=4,
         train={"compile": True}, parallel={"pp_schedule": "1f1b"}),
]

FOUR_GPU_CASES = [
    Case("dp2-pp2-1f1b-zero1", (2, 2, 1), zero=1, grad_accum=4,
         parallel={"pp_schedule": "1f1b"}),
    Case("dp2-tp2-zero2-bf16", (2, 1, 2), zero=2, precision="bf16"),
]


@pytest.mark.parametrize("case", [c.param() for c in TWO_GPU_CASES + FOUR_GPU_CASES])
def test_multi_gpu_run_follows_the_plain_loop(case, plain_oracle, tmp_path):
    got = train_case(case, tmp_path)
    assert_follows_plain_loop(case, got, plain_oracle(case.precision, case.parts))
