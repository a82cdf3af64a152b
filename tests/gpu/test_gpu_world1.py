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
from gpu_training import (
    GPU_SET,
    ON_CPU,
    Case,
    assert_follows_plain_loop,
    assert_ran_on_the_device,
    assert_weights_close,
    train_case,
    train_without_syncs,
)

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


@pytest.mark.skipif(ON_CPU, reason="a CUDA side stream and pinned buffers: GPU only")
def test_async_checkpoint_snapshots_gpu_tensors_before_the_update(tmp_path):
    """The pinned, non_blocking snapshot on the side stream: the checkpoint holds the
    values at save time although the update is queued right after before_update()
    (the training stream waits for the copy's event, the CPU does not)."""
    import torch

    from disttrain.checkpoint.manager import CheckpointManager, find_checkpoint, open_checkpoint

    weight = torch.randn(2048, 2048, device="cuda")
    moment = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    want = {"w": weight.cpu(), "m": moment.cpu()}
    manager = CheckpointManager(tmp_path, 0, 1, keep=2, async_save=True)
    for step in (1, 2):  # the second save reuses the pinned buffers
        manager.save(step, {"w": weight, "m": moment}, {"w": 0, "m": 0}, {"step": step})
        manager.before_update()
        weight.mul_(0.5).add_(1.0)  # the optimizer's change, queued after the copy
        moment.zero_()
        manager.wait()
        ckpt = open_checkpoint(find_checkpoint(tmp_path, print))
        assert ckpt.step == step
        for name, tensor in want.items():
            torch.testing.assert_close(ckpt.reader.tensor(name), tensor, rtol=0, atol=0)
        want = {"w": weight.cpu(), "m": moment.cpu()}
    assert all(buf.is_pinned() for buf in manager._host.values())



STEADY_CASES = [Case("ddp-fp32"),
                Case("zero3-bf16-accum2", zero=3, precision="bf16", grad_accum=2),
                Case("ddp-fp16", precision="fp16")]


@pytest.mark.parametrize("case", [c.param() for c in STEADY_CASES])
def test_steady_state_steps_never_wait_for_the_gpu(case, plain_oracle, tmp_path):
    """No step after the first synchronises the host with the GPU (issue 38), and the
    run still ends on the plain loop's weights."""
    got = train_case(case, tmp_path, body=train_without_syncs)
    assert_follows_plain_loop(case, got, plain_oracle(case.precision, case.parts))
