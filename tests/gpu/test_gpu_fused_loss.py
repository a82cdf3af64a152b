"""The fused loss's compiled CUDA kernels on a GPU, one step after another with a
different token count each (chat data unpacked): every step's loss and gradients
against ``F.cross_entropy`` on the full logits in the same precision, and each of the
two kernels compiled at most twice (the first shape static, then the rows symbolic),
not once per token count. The CPU dry run (``DISTTRAIN_GPU_SET_ON_CPU=1``) runs the same
steps through the fused path eagerly, compiling nothing.

Tolerance: fp32 1e-4 (the chunked sums add in another order); bf16 logits 2e-2 relative
on the loss and gradients (bf16 keeps 8 bits: 4e-3 per rounding, the matmuls and the
gradient written in bf16 a few roundings deep; a wrong column or scale is off by far more).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gpu_training import DEVICE_TYPE, GPU_SET, ON_CPU

from disttrain.parallel.fused_loss import functions as fused_functions
from disttrain.parallel.fused_loss import linear_cross_entropy
from disttrain.targets import IGNORE_INDEX

pytestmark = GPU_SET


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_kernels_follow_the_full_logits_at_every_token_count(dtype, monkeypatch):
    if ON_CPU:  # the fused path's arithmetic, eagerly: nothing compiles on the CPU
        monkeypatch.setattr(fused_functions, "KERNEL_DEVICES", ("cpu", "cuda"))
    device = torch.device(DEVICE_TYPE, 0) if DEVICE_TYPE == "cuda" else torch.device("cpu")
    torch._dynamo.reset()
    monkeypatch.setattr(fused_functions, "_COMPILED", {})
    counters = torch._dynamo.utils.counters
    counters.clear()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    g = torch.Generator().manual_seed(5)
    d, vocab = 64, 1000
    weight = (torch.randn(vocab, d, generator=g) / d ** 0.5).to(device, dtype)
    for n in (384, 200, 517, 96, 256, 333):
        hidden = torch.randn(n, d, generator=g).to(device, dtype)
        targets = torch.randint(0, vocab, (n,), generator=g).to(device)
        targets[:7] = IGNORE_INDEX
        h, w = (t.detach().clone().requires_grad_() for t in (hidden, weight))
        loss, _ = linear_cross_entropy(h, w, targets, label_smoothing=0.1, chunk_tokens=128)
        loss.backward()
        rh, rw = (t.detach().clone().requires_grad_() for t in (hidden, weight))
        ref = F.cross_entropy((rh @ rw.t()).float(), targets, ignore_index=IGNORE_INDEX,
                              reduction="sum", label_smoothing=0.1)
        ref.backward()
        for name, got, want in (("loss", loss.detach(), ref.detach()),
                                ("hidden grad", h.grad, rh.grad),
                                ("weight grad", w.grad, rw.grad)):
            torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol,
                                       msg=lambda m, n=n, name=name: f"{n} tokens: {name}: {m}")
    graphs = counters["stats"]["unique_graphs"]
    if ON_CPU:
        assert graphs == 0
    else:
        assert 2 <= graphs <= 4, f"{graphs} graphs for 2 kernels over six token counts"
    torch._dynamo.reset()
