"""A rank's pipeline chunks built from the model (:func:`build_chunks`), their
parameters' full-model names, and the cut checked once against the whole model before
training (:func:`check_cut`: a pipeline that runs the model's own forward on each chunk,
``spec.inject``, must compute what the model computes)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...spec import ModelSpec, output_logits
from ...weights.materialize import on_meta
from .chunks import (
    BlockSlice,
    PipelineChunk,
    _call,
    _pipeline_blocks,
    _Received,
    _shell,
    _stand_ins,
)
from .cuts import StagePlan


def check_cut(model: nn.Module, spec: ModelSpec) -> None:
    """Refuse (ValueError) a ``spec.inject`` cut whose stand-ins change what the model
    computes, checked on ``spec.probe`` in eval mode: the first chunk's part before
    the blocks must yield what the first block receives; later chunks' stand-ins must
    hand the received activation to their first block unchanged; the last chunk's part
    after the blocks must turn the last block's output into the model's logits. (A
    model that rescales its embeddings inside its forward, for instance, fails here.)
    Call it on every rank of a tp group together (the model may hold tp shards)."""
    if spec.inject is None or spec.probe is None:
        return
    path, blocks = _pipeline_blocks(model, spec)
    device = next(model.parameters()).device
    probe = _Inputs({k: v.to(device) if isinstance(v, torch.Tensor) else v
                     for k, v in spec.probe.items()})
    seen: dict[str, torch.Tensor] = {}

    def first_in(_m: nn.Module, args: tuple, kwargs: dict) -> None:
        seen.setdefault("first", _hidden(args, kwargs))

    def last_out(_m: nn.Module, _args: tuple, out: Any) -> None:
        seen.setdefault("last", output_logits(out))

    hooks = [blocks[0].register_forward_pre_hook(first_in, with_kwargs=True),
             blocks[-1].register_forward_hook(last_out)]
    training = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            full = output_logits(_call(model, probe))
            pieces: dict[tuple[bool, bool], torch.Tensor] = {}
            for first, last in ((True, False), (False, False), (False, True)):
                received = _Received()
                subs = {path: BlockSlice(),
                        **_stand_ins(model, spec, received, first=first, last=last)}
                shell, _ = _shell(model, subs)
                received.value = seen["last"] if last else seen["first"]
                pieces[first, last] = output_logits(_call(shell, probe))
    finally:
        for hook in hooks:
            hook.remove()
        for m, mode in training:
            m.training = mode
    where = {(True, False): "the modules before the blocks on the first stage",
             (False, False): "the stand-ins on a middle stage",
             (False, True): "the modules after the blocks on the last stage"}
    want = {(True, False): seen["first"], (False, False): seen["first"],
            (False, True): full}
    for key, got in pieces.items():
        if got.shape != want[key].shape or not torch.allclose(got, want[key], rtol=1e-5,
                                                                  atol=1e-6):
            raise ValueError(f"this model cannot be cut for pipeline parallelism as its "
                             f"spec says: {where[key]} do not reproduce the whole model "
                             "(its forward does more between the embeddings, the blocks "
                             "and the head); pass a ModelSpec with embed/finish functions")


@dataclass(frozen=True)
class _Inputs:
    kwargs: Mapping[str, Any]
    args: tuple[Any, ...] = ()


def _hidden(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> torch.Tensor:
    """The hidden state a block is called with (first positional, or by keyword)."""
    if args:
        return args[0]
    return kwargs["hidden_states"]


def build_chunks(model: nn.Module, spec: ModelSpec, plan: StagePlan,
                 rank: int) -> list[PipelineChunk]:
    """The chunks living on pp rank ``rank`` (global indices ``plan.chunks_of(rank)``)."""
    if not spec.can_pipeline:
        raise ValueError("this model's spec does not say how to cut it (blocks, before/"
                         "after modules, embed/finish); pass a ModelSpec that does")
    _, blocks = _pipeline_blocks(model, spec)
    if len(blocks) != plan.bounds[-1]:
        raise ValueError(f"the plan cuts {plan.bounds[-1]} blocks but the model has "
                         f"{len(blocks)}; plan with the model's own spec")
    if not on_meta(model):
        check_cut(model, spec)
    elif spec.inject is not None:  # no values to run: the check runs on a small twin
        twin = spec.twin() if spec.twin is not None else None
        if twin is None:
            raise ValueError("this model is on the meta device and its pipeline cut can "
                             "only be checked by running it; build it with values, or "
                             "pass a ModelSpec with embed/finish functions")
        check_cut(*twin)
    return [PipelineChunk(model, spec, plan, c) for c in plan.chunks_of(rank)]


def chunk_param_names(chunk: PipelineChunk) -> dict[str, str]:
    """Parameter name in ``chunk`` -> the full model's parameter name (identical except
    a tied copy, which is named after its owner)."""
    owners = {c: o for o, c in chunk.spec.tied}
    return {name: (owners[name] if name in chunk.tied_copies else name)
            for name, _ in chunk.named_parameters()}
