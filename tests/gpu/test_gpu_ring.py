"""Ring attention on a GPU: two ranks on the one GPU in the shared-GPU test mode (Gloo,
the point-to-point messages staged through pinned host memory), each holding its half of
a causal sequence as CUDA tensors, with the device's default block kernel (plain maths
off the CPU). Output and dq, dk, dv against torch SDPA on the whole sequence on the same
GPU, in fp32 and bf16, with grouped-query heads. The CPU dry run
(``DISTTRAIN_GPU_SET_ON_CPU=1``) runs the same on the CPU with host staging.

Tolerance: fp32 rtol/atol 1e-4 (the GPU's SDPA kernels and the ring's matmuls add in
other orders; a wrong block or mask moves values by 1e-2 or more); bf16 against the
fp32 reference 3e-2 (bf16 keeps 8 bits: 4e-3 relative per rounding, a few roundings
deep).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from gpu_training import GPU_SET, ON_CPU, shared_env

from disttrain.testing import run_distributed

pytestmark = GPU_SET


def _ring_on_rank() -> list[str]:
    """Every mismatch of this rank's part, as text (empty: all equal)."""
    from disttrain.comm import CollectiveLedger, Communicator
    from disttrain.parallel.context import ring_attention, split_sequence

    comm = Communicator(None, CollectiveLedger(), name="cp")
    device = comm.device
    problems = []
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        g = torch.Generator().manual_seed(11)
        q = torch.randn(2, 8, 256, 64, generator=g)
        k, v = (torch.randn(2, 2, 256, 64, generator=g) for _ in range(2))
        dout = torch.randn(2, 8, 256, 64, generator=g)
        full = [t.to(device).detach().requires_grad_() for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=True)
        ref_grads = torch.autograd.grad(ref, full, dout.to(device))
        mine = [split_sequence(t, comm.size, comm.rank, dim=2).to(device, dtype).detach()
                .requires_grad_() for t in (q, k, v)]
        out = ring_attention(*mine, comm)
        out.backward(split_sequence(dout, comm.size, comm.rank, dim=2).to(device, dtype))
        pairs = [("out", out, ref)] + [(f"d{n}", t.grad, r) for n, t, r in
                                       zip("qkv", mine, ref_grads, strict=True)]
        for name, got, want in pairs:
            try:
                torch.testing.assert_close(
                    got.float(), split_sequence(want.detach(), comm.size, comm.rank, dim=2),
                    rtol=tol, atol=tol)
            except AssertionError as e:
                problems.append(f"{dtype} {name}: {e}")
    return problems


def test_ring_attention_on_the_gpu_equals_sdpa():
    ranks = run_distributed(_ring_on_rank, 2, timeout=240, backend="gloo",
                            env=shared_env(), start_method=None if ON_CPU else "spawn")
    problems = [f"rank {r}: {p}" for r, found in enumerate(ranks) for p in found]
    assert not problems, "\n".join(problems)
