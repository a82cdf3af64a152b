"""Tensor x pipeline parallelism on one model replica: what the trainer needs from them.

:func:`apply_model_parallel` shards the GPT over the ``tp`` axis (by the GPT plan), then
cuts it into pipeline chunks over the ``pp`` axis, and returns a :class:`ModelParallel`:
the module this rank trains (its chunks), the loss, the names of its parameters in the
full model, and the pieces of each parameter's global tensor it holds. Data parallelism
(or ZeRO) is applied over ``dp`` to ``ModelParallel.module`` afterwards, unchanged.

Gradient norm over the whole model: every parameter's squared norm is counted exactly
once in a sum over all ranks - a tp-replicated parameter weighs 1/tp on each tp rank,
the last stage's copy of the tied embedding weighs 0, and dp replicas are divided out.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from ..comm import Communicator
from ..config.schema import ParallelConfig
from ..models.gpt import GPT
from ..topology import Topology
from .activation import apply_activation_checkpointing, canonical_name
from .pipeline import (PipelineChunk, Schedule, build_chunks, build_schedule,
                       chunk_param_names, plan_stages, sync_tied_grads)
from .pipeline.stages import StagePlan
from .tensor import TensorParallel, apply_tensor_parallel
from .tensor.layers import Box, whole_box


@dataclass
class ModelParallel:
    """This rank's part of the model under (pp, tp), and how to account for it.

    ``module``: what this rank trains (the model itself when pp = 1, else a ModuleList
    of its chunks). ``names``: id(parameter) -> full-model parameter name.
    ``tied_copies``: ids of parameters that duplicate one held elsewhere (the last
    stage's copy of the tied embedding): not saved, not counted in norms.
    """

    module: nn.Module
    chunks: list[PipelineChunk]
    tp: TensorParallel | None
    names: dict[int, str]
    tied_copies: set[int]
    stages: StagePlan | None
    schedule: Schedule | None
    pp_comm: Communicator
    tp_comm: Communicator
    dp_size: int
    _replicated: set[int] = field(default_factory=set)

    @property
    def is_last_stage(self) -> bool:
        return self.pp_comm.rank == self.pp_comm.size - 1

    @property
    def counts_loss(self) -> bool:
        """Whether this rank's loss enters the global sum: the last stage's tp rank 0
        (every tp rank of the last stage computes the same loss)."""
        return self.is_last_stage and self.tp_comm.rank == 0

    def activation_length(self, seq_len: int) -> int:
        """Positions per rank in the activations stages exchange: sequence parallelism
        keeps them split over tp between blocks."""
        sp = self.tp is not None and self.tp.sequence_parallel
        return seq_len // self.tp.tp_size if sp else seq_len

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(full-model name, parameter) for every parameter this rank holds."""
        seen: set[int] = set()
        for p in self.module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                yield self.names[id(p)], p

    def boxes(self, name: str, param: torch.Tensor) -> list[Box]:
        """Where ``param`` (this rank's tensor for ``name``) lies in the global tensor."""
        return self.tp.boxes(name) if self.tp is not None else whole_box(tuple(param.shape))

    def local_from_global(self, name: str, full: torch.Tensor) -> torch.Tensor:
        return self.tp.local_from_global(name, full) if self.tp is not None else full

    def writes(self, param: nn.Parameter, dp_rank: int) -> bool:
        """Whether this rank saves ``param``: dp rank 0, tp rank 0 for a tp-replicated
        parameter, never a tied copy."""
        if dp_rank != 0 or id(param) in self.tied_copies:
            return False
        return id(param) not in self._replicated or self.tp_comm.rank == 0

    def norm_weight(self, param: nn.Parameter) -> float:
        """The share of ``param``'s squared gradient norm this rank contributes."""
        if id(param) in self.tied_copies:
            return 0.0
        tp = self.tp_comm.size if id(param) in self._replicated else 1
        return 1.0 / (tp * self.dp_size)

    def finish_backward(self) -> None:
        """After a step's backward passes, before the dp reduction: partial gradients of
        sequence-parallel norms summed over tp; the tied weight's two copies summed."""
        if self.tp is not None:
            self.tp.sync_replicated_grads()
        if self.chunks:
            sync_tied_grads(self.chunks, self.pp_comm)

    def describe(self) -> str:
        """One line: this rank's coordinates, blocks and shards."""
        parts = []
        if self.stages is not None:
            spans = [f"{self.stages.bounds[c.index]}-{self.stages.bounds[c.index + 1] - 1}"
                     for c in self.chunks]
            extra = [("embedding" if c.is_first else "") + ("head" if c.is_last else "")
                     for c in self.chunks]
            parts.append("blocks " + ", ".join(s + (f" +{e}" if e else "")
                                               for s, e in zip(spans, extra)))
        if self.tp is not None:
            parts.append(f"1/{self.tp.tp_size} of each matrix (tp shard {self.tp.tp_rank})")
        return "; ".join(parts)


def apply_model_parallel(model: nn.Module, topology: Topology, parallel: ParallelConfig,
                         pp_comm: Communicator, tp_comm: Communicator, *,
                         micro_batches: int, starts: list[int] | None = None,
                         checkpointing: tuple[str, int] = ("none", 1)) -> ModelParallel:
    """Shard ``model`` (a GPT, identically initialised on every rank) over tp, wrap its
    blocks for activation checkpointing (``(mode, k)``), cut it over pp for
    ``parallel.pp_schedule`` with ``micro_batches`` per step."""
    lay = topology.layout
    if not isinstance(model, GPT):
        raise TypeError("parallel.pp and parallel.tp apply to disttrain's GPT (its plan "
                        f"is known); got {type(model).__name__}")
    cfg = model.cfg
    tp = (apply_tensor_parallel(model, tp_comm, sequence_parallel=parallel.sequence_parallel)
          if lay.tp > 1 else None)
    apply_activation_checkpointing(model, *checkpointing)  # after tp: the plan sees plain names
    chunks, stages, schedule = [], None, None
    names = {id(p): canonical_name(n) for n, p in model.named_parameters()}
    replicated = set() if tp is None else {id(p) for p in model.parameters()
                                           if not tp.is_sharded(p)}
    tied: set[int] = set()
    module: nn.Module = model
    if lay.pp > 1:
        v = parallel.pp_virtual if parallel.pp_schedule == "interleaved" else 1
        stages = plan_stages(cfg, pp=lay.pp, v=v, cuts=starts[1:] if starts else None)
        chunks = build_chunks(model, stages, pp_comm.rank)
        schedule = build_schedule(parallel.pp_schedule, pp=lay.pp, m=micro_batches, v=v)
        names = {}
        for chunk in chunks:
            full = chunk_param_names(chunk)
            for n, p in chunk.named_parameters():
                names[id(p)] = canonical_name(full[n])
                if n in chunk.tied_copies:
                    tied.add(id(p))
        module = nn.ModuleList(chunks)
    return ModelParallel(module=module, chunks=chunks, tp=tp, names=names,
                         tied_copies=tied, stages=stages, schedule=schedule,
                         pp_comm=pp_comm, tp_comm=tp_comm, dp_size=lay.dp,
                         _replicated=replicated)


def model_parallel_grad_norm(mp: ModelParallel, dp: object, world: Communicator,
                             max_norm: float) -> float:
    """Global gradient norm over every stage, tp shard and dp shard; clip the local
    gradients (ZeRO: the gradient shards) if ``max_norm > 0``."""
    sq = torch.zeros(1, dtype=torch.float64)
    grads = []
    flats = getattr(dp, "flats", None)
    if flats is not None:  # ZeRO: distinct slices over dp, so no dp division
        for f in flats:
            if f.shard.grad is None:
                continue
            grads.append(f.shard.grad)
            sq += _shard_sq(mp, f, dp.comm.rank) * mp.dp_size
    else:
        for _, p in mp.named_parameters():
            if p.grad is not None:
                grads.append(p.grad)
                sq += mp.norm_weight(p) * p.grad.detach().double().pow(2).sum().cpu()
    world.all_reduce(sq)
    norm = float(sq.sqrt())
    if max_norm > 0 and norm > max_norm:
        for g in grads:
            g.mul_(max_norm / (norm + 1e-6))
    return norm


def _shard_sq(mp: ModelParallel, flat: object, dp_rank: int) -> torch.Tensor:
    """Weighted squared norm of one ZeRO flat parameter's gradient shard: each element
    weighs what its parameter does (tp-replicated, tied copy)."""
    size = flat.shard.numel()
    start, grad = dp_rank * size, flat.shard.grad.detach().double()
    total = torch.zeros(1, dtype=torch.float64)
    for p, offset in zip(flat.params, flat.offsets):
        lo, hi = max(offset, start), min(offset + p.numel(), start + size)
        if lo < hi:
            total += mp.norm_weight(p) * grad[lo - start:hi - start].pow(2).sum().cpu()
    return total
