"""A tensor-parallel layer's fused backward node under a split (zero-bubble) backward:
B computes its input gradient only (one all-reduce), W its weight and bias gradients
only (no collective, no read of the weight, which ZeRO-3 frees between them), and
together they equal plain autograd's gradients of the same maths. Before the node
asked which of its outputs the running pass needs, W computed the input gradient again
(a second all-reduce per layer and micro-batch) and read a weight ZeRO-3 had freed.

Tolerance: exact (1e-6 relative): the same matmuls in the same order as F.linear's
backward, at tp 1 (the all-reduce sums one rank).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from disttrain.testing import run_distributed


def _split_on_rank(sequence_parallel: bool) -> dict:
    from disttrain.comm import CollectiveLedger, Communicator
    from disttrain.parallel.pipeline.split_backward import backward_input, backward_weight
    from disttrain.parallel.tensor.functions import column_parallel_linear
    from disttrain.parallel.zero.flat import free

    comm = Communicator(None, CollectiveLedger(), name="tp")
    g = torch.Generator().manual_seed(0)
    x0, w0, b0 = (torch.randn(2, 4, 8, generator=g), torch.randn(6, 8, generator=g),
                  torch.randn(6, generator=g))
    upstream = torch.randn(2, 4, 6, generator=g)
    # plain autograd: the reference
    rx, rw, rb = (t.clone().requires_grad_() for t in (x0, w0, b0))
    F.linear(rx.tanh(), rw, rb).sigmoid().backward(upstream)
    # the split backward of the same chunk through the tensor-parallel node
    x, w, b = (t.clone().requires_grad_() for t in (x0, w0, b0))
    out = column_parallel_linear(x.tanh(), w, b, comm,
                                 sequence_parallel=sequence_parallel).sigmoid()
    start = comm.ledger.seq
    dx, kept = backward_input(out, upstream, x, [w, b])
    in_b = comm.ledger.seq - start
    weight = w.detach().clone()
    free(w)  # as ZeRO-3 frees a chunk's weights once its B is done
    start = comm.ledger.seq
    backward_weight(kept)
    in_w = comm.ledger.seq - start
    return {"b_collectives": in_b, "w_collectives": in_w, "dx": dx, "grad_w": w.grad,
            "grad_b": b.grad, "ref": (rx.grad, rw.grad, rb.grad), "weight": weight}


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_b_computes_the_input_gradient_and_w_the_weights_only(sequence_parallel):
    got = run_distributed(_split_on_rank, 1, args=(sequence_parallel,), timeout=120)[0]
    assert got["b_collectives"] == 1, "B: the input gradient's one collective"
    assert got["w_collectives"] == 0, "W: no collective (the input gradient again)"
    ref_x, ref_w, ref_b = got["ref"]
    for name, actual, expected in (("dx", got["dx"], ref_x), ("grad_w", got["grad_w"], ref_w),
                                   ("grad_b", got["grad_b"], ref_b)):
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")
