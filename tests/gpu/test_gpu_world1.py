"""Every strategy path that runs on one rank, on one GPU through NCCL.

Each case trains through the Trainer (train.device = auto, so the runtime itself must
pick cuda and NCCL) and must end on the weights of a plain PyTorch loop on the same GPU
(see gpu_training.py): data parallelism, ZeRO-1/2/3, accumulation, activation
checkpointing, local SGD, train.compile (blocks through inductor), bf16, and fp16 with
dynamic loss scaling (the same steps skipped on overflow as torch's GradScaler, the same
final scale). The sync modes whose single
replica does not reduce to the plain loop (diloco's outer step, fedavg's partitions)
must follow the same case trained on the CPU with Gloo. Pipeline and tensor parallelism
need two ranks: test_gpu_multi.py.
"""

from __future__ import annotations

import pytest
from gpu_training import (GPU_SET, Case, assert_follows_plain_loop, assert_ran_on_the_device,
                          assert_weights_close, train_case)

pytestmark = GPU_SET

PLAIN_CASES = [
    Case("ddp-fp32"),
    Case("ddp-fp32-accum2", grad_accum=2),
    Case("zero1-fp32-accum2", zero=1, grad_accum=2),
    Case("zero2-fp32-accum2", zero=2, grad_accum=2),
    Case("zero3-fp32-accum2", zero=3, grad_accum=2),
    Case("ddp-fp32-activation-checkpointing", train={"activation_checkpointing": "full"}),
    Case("local_sgd-fp32", train={"sync": "local_sgd", "sync_every": 3}),
    Case("ddp-bf16", precision="bf16"),
    Case("zero3-bf16-accum2", zero=3, precision="bf16", grad_accum=2),
    Case("ddp-fp16", precision="fp16"),
    Case("zero2-fp16", zero=2, precision="fp16"),
    Case("zero3-fp16-accum2", zero=3, precision="fp16", grad_accum=2),
    Case("ddp-fp32-compile", train={"compile": True}),
    Case("zero3-bf16-accum2-compile", zero=3, precision="bf16", grad_accum=2,
         train={"compile": True}),
]

CPU_ORACLE_CASES = [
    Case("diloco-fp32", train={"sync": "diloco", "sync_every": 3}),
    Case("fedavg-fp32", train={"sync": "fedavg", "sync_every": 3}),
]


@pytest.mark.parametrize("case", [c.param() for c in PLAIN_CASES])
def test_one_gpu_follows_the_plain_loop(case, plain_oracle, tmp_path):
    got = train_case(case, tmp_path)
    assert_follows_plain_loop(case, got, plain_oracle(case.precision, case.parts))


@pytest.mark.parametrize("case", [c.param() for c in CPU_ORACLE_CASES])
def test_one_gpu_sync_mode_follows_its_cpu_run(case, tmp_path):
    got = train_case(case, tmp_path / "device")
    on_cpu = train_case(case, tmp_path / "cpu", backend="gloo")
    assert_ran_on_the_device(got)
    assert on_cpu.rank0["device"] == "cpu"
    assert_weights_close(got.weights, on_cpu.weights, case.precision, case.name)
