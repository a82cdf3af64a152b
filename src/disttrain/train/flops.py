"""Training FLOPs per token (per position the loss runs over) of a model without a
formula, counted on a pass of its own.

torch's ``FlopCounterMode`` cannot watch a real training step without changing it: it
runs every op that has no FLOP formula through that op's decomposition (``silu_backward``
becomes ``sigmoid``, ``mul``, ``add``, ..., rounded differently from the fused kernel),
and while any dispatch mode is active, ATen's composite ops and backward formulas take
the paths they keep for tensor subclasses (``isTensorSubclassLike`` is true for every
tensor). Counting inside the first step moved its gradients by up to ~1e-6 (a SwiGLU
MLP, as in Llama).

So the count is one forward and backward of a micro-batch apart from training, before
the strategies wrap the model: through ``torch.func.functional_call`` on detached
aliases of the parameters (the same storage: no copy; the gradients accumulate on the
aliases and are dropped as they arrive, the parameters' ``.grad`` never see them) and
on copies of the buffers (running statistics stay as they are), with the random number
generators restored afterwards (dropout masks of the first step stay the same).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ..errors import UserError
from .batch import Batch, LossFn, loss_sum_and_terms
from .precision import autocast


def count_flops_per_token(model: nn.Module, batch: Batch, loss_fn: LossFn | None,
                         precision: str, device: torch.device) -> float:
    """FLOPs of one training forward and backward of ``model`` on ``batch``, divided by
    the positions the loss runs over (:meth:`~.batch.Batch.positions`: every token,
    trained or not, since the model computes them all; samples for a per-sample loss).
    Leaves the model's parameters, gradients, buffers and the RNG state as they
    were."""
    params = {name: p.detach().requires_grad_(p.requires_grad)
              for name, p in model.named_parameters()}
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    with _rng_kept(device), FlopCounterMode(display=False) as counter:
        with autocast(precision, device):
            outputs = torch.func.functional_call(model, {**params, **buffers},
                                                 batch.args, batch.kwargs)
            loss_sum, _, _ = loss_sum_and_terms(loss_fn, outputs, batch)
        _backward_dropping_grads(loss_sum.float(),
                                 [p for p in params.values() if p.requires_grad])
    return counter.get_total_flops() / max(batch.positions(), 1)


def _backward_dropping_grads(loss: torch.Tensor, leaves: list[torch.Tensor]) -> None:
    """Backward into ``leaves``, each gradient released once accumulated (at most one
    parameter's gradient is alive beyond what autograd holds anyway)."""
    if not leaves or not loss.requires_grad:
        return
    for leaf in leaves:
        leaf.register_post_accumulate_grad_hook(_drop_grad)
    loss.backward(inputs=leaves)


def _drop_grad(leaf: torch.Tensor) -> None:
    leaf.grad = None


def _rng_kept(device: torch.device) -> contextlib.AbstractContextManager:
    """The CPU generator, and ``device``'s when it is an accelerator, restored on exit."""
    if device.type == "cpu":
        return torch.random.fork_rng(devices=[])
    return torch.random.fork_rng(devices=[device], device_type=device.type)


def shape_flops_per_token(model: nn.Module, batch: Batch) -> float:
    """Training FLOPs per token of a transformers causal LM without values (built on
    the meta device), from its shapes and the batch's sequence length; other models
    on meta need ``flops_per_token`` given."""
    from ..models.hf import hf_flops_per_token

    ids = batch.kwargs.get("input_ids") if batch.kwargs else None
    if ids is None and batch.args:
        ids = batch.args[0]
    flops = hf_flops_per_token(model, int(ids.shape[-1])) if ids is not None else None
    if flops is None:
        raise UserError(f"the model ({type(model).__name__}) is on the meta device, so its "
                        "FLOPs cannot be counted by running it (pass flops_per_token= to "
                        "the Trainer)")
    return float(flops)
