"""The output head handed over to the fused loss: which models it applies to, the swap,
and the token loss the step's default loss then calls.

Where it applies (the step's loss is the default causal-LM loss, ``train.fused_loss``
is on, the spec names the head: an ``nn.Linear`` whose output is the model's logits,
nothing applied after it), :func:`fuse_output_head` swaps that head, where this rank
runs it, for a :class:`HiddenStatesHead`: the same weight Parameter (and bias) under
the same names, returning its input. State-dict keys, tying, checkpoints, ZeRO's units
and tensor-parallel boxes are those of the head it replaces. The model's output is then
the hidden states [B, T, d] where the logits were, and :meth:`FusedHead.token_loss`
computes the loss from them and the head's weight (:func:`.functions.linear_cross_entropy`).
:meth:`FusedHead.restore` puts the heads back (the end of ``fit()``): the model gives
logits again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from ...comm.collectives import Communicator
from ...spec import ModelSpec, output_logits
from ...weights.materialize import on_meta
from ..tensor.functions import copy_to_tp_region, gather_from_sequence_region
from ..tensor.layers import VocabParallelHead
from .functions import CHUNK_LOGIT_BYTES, linear_cross_entropy

# (path, new module) -> the module it replaced: puts a module in place where a rank runs it
Replace = Callable[[str, nn.Module], nn.Module]


class HiddenStatesHead(nn.Module):
    """Stands in for the output head while the fused loss computes the logits from its
    weight: returns its input, the hidden states [B, T, d].

    ``weight`` [V, d] (a vocabulary-parallel head's [V/tp, d] rows) and ``bias`` are the
    head's own Parameters. With ``comm`` (the head's vocabulary is sharded over tp) the
    input passes through :func:`copy_to_tp_region` (identity forward, gradient summed
    over tp: each rank's loss gradient covers only its own rows), or under sequence
    parallelism [B, T/tp, d] is all-gathered along T (gradient reduce-scattered), as the
    vocabulary-parallel head's input is."""

    weight: nn.Parameter
    bias: nn.Parameter | None

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None,
                 comm: Communicator | None = None, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.weight = weight
        self.register_parameter("bias", bias)  # None too, as nn.Linear registers it
        self.comm, self.sequence_parallel = comm, sequence_parallel

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.comm is None:
            return hidden
        if self.sequence_parallel:
            return gather_from_sequence_region(hidden, self.comm)
        return copy_to_tp_region(hidden, self.comm)

    def extra_repr(self) -> str:
        rows, d = self.weight.shape
        tp = f", tp={self.comm.size}" if self.comm is not None else ""
        return f"vocabulary_rows={rows}, hidden={d}{tp} (logits computed in the loss)"


@dataclass
class _Swap:
    replace: Replace
    path: str
    original: nn.Module
    stand_in: HiddenStatesHead


class FusedHead:
    """The head this rank swapped for the fused loss (None on a pipeline stage without
    it); :meth:`token_loss` is the batch's default token loss over it."""

    def __init__(self, swap: _Swap | None, chunk_tokens: int | None = None) -> None:
        self._swap = swap
        self.chunk_tokens = chunk_tokens
        self.restored = False

    def token_loss(self, hidden: torch.Tensor, targets: torch.Tensor, ignore: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed cross-entropy, counted positions) of the logits of hidden states
        [B, T, d] (the swapped head's output) against targets [B, T] (global ids),
        positions equal to ``ignore`` left out: a :data:`~disttrain.train.batch.TokenLoss`
        whose logits are never whole. The count is a 0-dim device tensor."""
        if self._swap is None:
            raise RuntimeError("this rank holds no output head: the fused loss runs where "
                               "the model's last piece runs")
        head = self._swap.stand_in
        return linear_cross_entropy(hidden, head.weight, targets, bias=head.bias,
                                    ignore_index=ignore, chunk_tokens=self.chunk_tokens,
                                    comm=head.comm)

    def restore(self) -> None:
        """Put the original head back (again: nothing)."""
        if self._swap is not None and not self.restored:
            self._swap.replace(self._swap.path, self._swap.original)
        self.restored = True


def replace_submodule(root: nn.Module, path: str, new: nn.Module) -> nn.Module:
    """Set ``new`` at dotted ``path`` under ``root``; returns the module it replaced."""
    parent, _, leaf = path.rpartition(".")
    holder = root.get_submodule(parent) if parent else root
    old = holder.get_submodule(leaf)
    setattr(holder, leaf, new)
    return old


def head_refusal(model: nn.Module, spec: ModelSpec) -> str | None:
    """Why the fused loss cannot stand in for ``model``'s head (None: it can): the spec
    names no head, or says why its head's output is not the logits, or the head is no
    linear layer, or (a spec with a ``probe``, e.g. a transformers model's) its forward
    was seen changing the head's output. Call it on the unchanged model."""
    if spec.head is None:
        return spec.head_refusal or "the model's spec names no output head"
    head = model.get_submodule(spec.head)
    if type(head) is not nn.Linear:
        return f"its head {spec.head!r} is a {type(head).__name__}, not an nn.Linear"
    if spec.probe is None:
        return None  # a spec that names its head says nothing follows it (the GPT's)
    twin = spec.twin() if spec.twin is not None else None
    if twin is None and on_meta(model):
        return ("its forward cannot be checked (on the meta device, with no small twin "
                "to run)")
    probe_model, probe_spec = twin if twin is not None else (model, spec)
    return _changes_head_output(probe_model, probe_spec)


def _changes_head_output(model: nn.Module, spec: ModelSpec) -> str | None:
    """Run ``spec.probe`` through ``model`` (eval, no grad) and check that the logits it
    returns are its head's output tensor, unchanged (None), else say so."""
    if spec.head is None or spec.probe is None:
        return "the model's spec names no output head"
    head = model.get_submodule(spec.head)
    seen: dict[str, Any] = {}

    def keep(_m: nn.Module, args: tuple[Any, ...], out: Any) -> None:
        seen["in"], seen["out"] = args[0], out

    device = next(model.parameters()).device
    probe = {k: v.to(device) if isinstance(v, torch.Tensor) else v
             for k, v in spec.probe.items()}
    hook = head.register_forward_hook(keep)
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            logits = output_logits(model(**probe))
    finally:
        hook.remove()
        for m, mode in modes:
            m.training = mode
    linear = cast(nn.Linear, head)
    if "out" not in seen or logits is not seen["out"] or not torch.equal(
            logits, F.linear(seen["in"], linear.weight, linear.bias)):
        return (f"its forward changes the output of its head {spec.head!r} before "
                "returning the logits (a scale, a soft cap, a mask)")
    return None


def fuse_output_head(path: str, holder: tuple[nn.Module, Replace] | None, *,
                     chunk_tokens: int | None = None) -> FusedHead:
    """Swap the head at ``path`` for a :class:`HiddenStatesHead` in ``holder``: the
    module holding it where this rank runs it (the whole model, or the last pipeline
    chunk) and how to replace a module there; None on a stage without the head. A
    :class:`VocabParallelHead` keeps its tp group and sequence parallelism; an
    ``nn.Linear`` (a replicated one under tp too) computes the whole vocabulary."""
    if holder is None:
        return FusedHead(None, chunk_tokens)
    module, replace = holder
    stand_in = _stand_in(module.get_submodule(path), path)
    return FusedHead(_Swap(replace, path, replace(path, stand_in), stand_in), chunk_tokens)


def _stand_in(head: nn.Module, path: str) -> HiddenStatesHead:
    comm: Communicator | None = None
    sequence_parallel = False
    if isinstance(head, VocabParallelHead):
        comm, sequence_parallel = head.comm, head.sequence_parallel
    elif type(head) is not nn.Linear:
        raise TypeError(f"the output head {path!r} is a {type(head).__name__}: the fused "
                        "loss stands in for an nn.Linear or a VocabParallelHead")
    # nn.Module types registered parameters as Tensor | Module: these are Parameters
    return HiddenStatesHead(cast(nn.Parameter, head.weight),
                            cast("nn.Parameter | None", head.bias), comm, sequence_parallel)


def loss_line(path: str | None, refusal: str | None) -> str:
    """The start-up banner's line for the loss: fused over the head at ``path``, or on
    the full logits and why (``refusal``)."""
    if refusal is not None:
        return f"loss: on the full logits (fused linear + cross-entropy off: {refusal})"
    return (f"loss: fused linear + cross-entropy over the head {path!r} (its logits "
            f"computed in chunks of at most {CHUNK_LOGIT_BYTES // 2**20} MiB, never "
            "whole; train.fused_loss=false turns it off)")
