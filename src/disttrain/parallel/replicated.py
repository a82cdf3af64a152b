"""The training state of replicas: whole parameters (or tp boxes), their optimizer state
and the persistent buffers, held identically by every dp rank.

Parameters that do not train (``requires_grad=False``) have no optimizer state and are
in no checkpoint (they come from the run's initial source: :meth:`ReplicatedState.
frozen_pieces` gives them to the final weights). Each tensor is saved once: the dp ranks
split the tensors between them by size
(:func:`~disttrain.checkpoint.state.assign_owners`, the same choice on every rank);
among tp ranks a replicated tensor is written by tp rank 0, and a tied weight's
second copy (pipelines) by nobody. Loading takes any layout's checkpoint and cuts this
rank's part out of each global tensor.
"""

from __future__ import annotations

import torch
from torch import nn

from ..checkpoint.state import MODEL, OPTIM, assign_owners, restore_named, restore_optimizer
from ..config.layout import Layout
from ..config.schema import Config
from ..errors import ConfigError
from ..names import SYNC_EVERY_STEP
from ..optim import decay_groups
from .activation import canonical_name
from .interfaces import TensorSource, rank_local_state
from .placement import Placement, StatePiece, range_pieces, tensor_pieces
from .strategy import Check


class ReplicatedState:
    """:class:`~disttrain.parallel.interfaces.ShardedState` of a replica: ``module`` is
    this rank's part of the model, ``placement`` its names and boxes; ``dp_rank`` of
    ``dp_size`` replicas."""

    def __init__(self, module: nn.Module, placement: Placement, dp_rank: int = 0,
                 dp_size: int = 1) -> None:
        self.module, self.placement = module, placement
        self.dp_rank, self.dp_size = dp_rank, dp_size

    def optimizer_groups(self, weight_decay: float) -> list[dict]:
        return decay_groups((p for p in self.module.parameters() if p.requires_grad),
                            weight_decay)

    def _parameters(self) -> list[tuple[str, nn.Parameter]]:
        seen: set[int] = set()
        out = []
        for p in self.module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append((self.placement.name(p), p))
        return out

    def state_pieces(self, optimizer: torch.optim.Optimizer) -> list[StatePiece]:
        candidates: list[StatePiece] = []
        for name, p in self._parameters():
            if not (p.requires_grad and self.placement.writes(p)):
                continue
            boxes = self.placement.boxes(name, p)
            tensors = [(MODEL + name, p.detach())]
            for key, value in optimizer.state.get(p, {}).items():
                t = value if isinstance(value, torch.Tensor) else torch.tensor(value)
                if t.dim() == 0:  # a scalar (Adam's step): once, from the group's rank 0
                    if self.placement.leads:
                        candidates.append(StatePiece(f"{OPTIM}{name}/{key}", t.detach(),
                                                     (), ()))
                else:
                    tensors.append((f"{OPTIM}{name}/{key}", t.detach()))
            for full, t in tensors:
                candidates += tensor_pieces(full, boxes, t)
        if self.placement.leads:
            candidates += [StatePiece(MODEL + n, b.detach(), tuple(b.shape),
                                      (0,) * b.dim(), eager=True)
                           for n, b in self.buffers().items()]
        return self._mine(candidates) + self._rank_pieces(optimizer)

    def frozen_pieces(self) -> list[StatePiece]:
        """The frozen parameters (their tensor-parallel boxes), from dp rank 0."""
        if self.dp_rank != 0:
            return []
        return [piece for name, p in self._parameters()
                if not p.requires_grad and self.placement.writes(p)
                for piece in tensor_pieces(MODEL + name, self.placement.boxes(name, p),
                                           p.detach())]

    def _rank_pieces(self, optimizer: torch.optim.Optimizer) -> list[StatePiece]:
        """State that differs between dp ranks (1-bit Adam's residuals), written by
        each rank itself: ``rank_state`` tensors as row ``dp_rank`` of a global
        [dp, *shape] tensor, ``range_state`` [start, stop) ranges as boxes of a global
        tensor of the parameter's shape (the dp ranks' ranges tile it)."""
        local = rank_local_state(optimizer)
        if local is None:
            return []
        out = []
        for name, p in self._parameters():
            if not (p.requires_grad and self.placement.writes(p)):
                continue
            for key, t in local.rank_state(p).items():
                out += rank_row_pieces(self.placement, name, p, key, t, self.dp_rank,
                                       self.dp_size)
            boxes = self.placement.boxes(name, p)
            for key, (start, stop, data) in local.range_state(p).items():
                out += range_pieces(f"{OPTIM}{name}/{key}", boxes, tuple(p.shape), start,
                                    stop, data)
        return out

    def _mine(self, pieces: list[StatePiece]) -> list[StatePiece]:
        """The pieces this dp rank writes (all replicas hold the same list)."""
        sizes = {_key(p): p.tensor.numel() * p.tensor.element_size() for p in pieces}
        owners = assign_owners(sizes, self.dp_size)
        return [p for p in pieces if owners[_key(p)] == self.dp_rank]

    def buffers(self) -> dict[str, torch.Tensor]:
        """Persistent buffers by their full-model name (a chunk keeps the model's paths)."""
        persistent = set(self.module.state_dict().keys())
        return {canonical_name(n): b for n, b in self.module.named_buffers()
                if canonical_name(n) in persistent}

    def load_state(self, source: TensorSource, optimizer: torch.optim.Optimizer) -> None:
        """Every trainable parameter and its optimizer state, the buffers, and the
        frozen parameters ``source`` holds (an initial source does, a checkpoint does
        not: they are left as they are)."""
        params = {MODEL + n: p for n, p in self._parameters()
                  if p.requires_grad or MODEL + n in source.names(MODEL + n)}
        restore_named(source, params, self.placement.to_local)
        restore_named(source, {MODEL + n: b for n, b in self.buffers().items()})
        local = rank_local_state(optimizer)
        rank_keys = local.rank_keys if local is not None else ()
        range_keys = local.range_keys if local is not None else ()
        restore_optimizer(source, self.module, optimizer, self.placement.names,
                          self.placement.to_local, skip=rank_keys + range_keys)
        if local is None:
            return  # the optimizer keeps all its state in optimizer.state
        for name, p in self._parameters():
            if not p.requires_grad:
                continue
            for key in rank_keys + range_keys:
                full = f"{OPTIM}{name}/{key}"
                if full not in source.names(full):
                    continue  # saved before the optimizer kept it: it starts at zero
                per_rank = key in rank_keys
                if per_rank:
                    t = read_rank_row(source, full, MODEL + name, self.dp_rank, self.dp_size)
                else:
                    _check_residual_shape(source, full, MODEL + name, per_rank=False)
                    t = source.tensor(full)
                load = local.load_rank_state if per_rank else local.load_range_state
                load(p, key, self.placement.to_local(name, t))


def rank_row_pieces(placement: Placement, name: str, p: torch.Tensor, key: str,
                    t: torch.Tensor, dp_rank: int, dp_size: int) -> list[StatePiece]:
    """``t`` (state of parameter ``p`` that differs on every dp rank, ``p``-shaped) as
    row ``dp_rank`` of the global [dp, *shape] tensor ``optim/<name>/<key>``."""
    return [StatePiece(g.name, g.tensor.unsqueeze(0), (dp_size, *g.global_shape),
                       (dp_rank, *g.offsets))
            for g in tensor_pieces(f"{OPTIM}{name}/{key}", placement.boxes(name, p),
                                   t.view(p.shape))]


def read_rank_row(source: TensorSource, full: str, model_name: str, dp_rank: int,
                  dp_size: int) -> torch.Tensor:
    """This dp rank's row of a saved [ranks, *shape] tensor (checked against its
    parameter's shape); saved at another dp size, the mean of the rows (what the ranks
    owed, in total)."""
    _check_residual_shape(source, full, model_name, per_rank=True)
    t = source.tensor(full)
    return t[dp_rank] if t.shape[0] == dp_size else t.mean(0)


def _check_residual_shape(source: TensorSource, full: str, model_name: str,
                          per_rank: bool) -> None:
    """A residual's saved shape must be its parameter's ([ranks, *shape] per rank), or
    the checkpoint is not one this run can read (checked before anything is copied)."""
    shape, want = tuple(source.shape(full)), tuple(source.shape(model_name))
    ok = (len(shape) == len(want) + 1 and shape[0] >= 1 and shape[1:] == want) if per_rank \
        else shape == want
    if not ok:
        expected = f"[ranks, {', '.join(map(str, want))}]" if per_rank else list(want)
        raise ValueError(f"{full}: checkpoint shape {list(shape)} does not fit its "
                         f"parameter (expected {expected})")


def _key(p: StatePiece) -> str:
    return f"{p.name}@{','.join(map(str, p.offsets))}"


def check_replica(name: str, wants_local: bool) -> Check:
    """A strategy keeping whole replicas: no ZeRO stage, and (``wants_local``) a sync
    mode other than every_step, or (not) every_step."""
    def check(config: Config, layout: Layout) -> None:
        if config.parallel.zero:
            raise ConfigError("parallel.zero", config.parallel.zero,
                              f"shards the state, which parallel.strategy={name} keeps "
                              "whole", "set parallel.strategy=auto or zero")
        if (config.train.sync != SYNC_EVERY_STEP) != wants_local:
            raise ConfigError("parallel.strategy", name,
                              f"does not fit train.sync={config.train.sync}",
                              "set parallel.strategy=auto")
    return check
