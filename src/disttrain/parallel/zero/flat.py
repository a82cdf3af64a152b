"""ZeRO's flat sharded buffers: units of parameters, flattened, padded, split over dp.

A :class:`Unit` is a group of parameters that is gathered, reduced and freed together:
a block of the model's block list, or a *root* unit (parameters outside the blocks,
gathered for the whole step), in one backward *scope* (the whole model, or one pipeline
chunk). Each unit's trainable parameters of one weight-decay class become a
:class:`FlatParam`: one flat buffer padded to a multiple of dp, of which dp rank r owns
elements ``[r*S, (r+1)*S)``. The model's parameters become views into the flat buffers,
so the model runs unchanged. Parameters that do not train (``requires_grad=False``)
are in no gradient buffer and have no optimizer state: stages 1-2 keep them whole,
stage 3 shards them in a flat buffer of their own per unit (``frozen``), gathered with
the unit's others.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence, Set
from dataclasses import dataclass, field

import torch
from torch import nn

from ...optim import takes_decay
from ...weights.materialize import give_storage


@dataclass(frozen=True)
class Unit:
    """Parameters gathered, reduced and freed together.

    ``module``: the block whose forward and backward use them (stage 3 gathers around
    it), or None for a root unit (gathered when its scope's module starts its forward,
    kept until the step ends). ``params``: the trainable ones, ``frozen``: those with
    ``requires_grad=False``. ``scope``: the backward scope (pipeline chunk) that
    produces their gradients. ``entry``: the module whose forward starts the scope.
    """

    module: nn.Module | None
    params: tuple[tuple[str, nn.Parameter], ...]
    scope: int
    entry: nn.Module
    frozen: tuple[tuple[str, nn.Parameter], ...] = ()


def build_units(scopes: Sequence[tuple[int, nn.Module, Sequence[nn.Module]]],
                separate: Set[int] = frozenset()) -> list[Unit]:
    """Units per scope, given ``(scope id, scope module, its blocks in forward order)``
    (the id: the pipeline chunk's index, 0 without a pipeline): one per block, then a
    root unit with the scope's other parameters, then one root unit per parameter in
    ``separate`` (ids; a weight whose gradient is exchanged between pipeline stages
    needs a shard layout of its own, identical on both sides)."""
    units: list[Unit] = []
    seen: set[int] = set()
    for scope, entry, blocks in scopes:
        for block in blocks:
            named = _fresh(block.named_parameters(), seen)
            units.append(_unit(block, named, scope, entry))
        rest = _fresh(entry.named_parameters(), seen)
        root = [(n, p) for n, p in rest if id(p) not in separate]
        if root:
            units.append(_unit(None, root, scope, entry))
        units += [_unit(None, [(n, p)], scope, entry) for n, p in rest if id(p) in separate]
    return units


def _fresh(named: Iterator[tuple[str, nn.Parameter]], seen: set[int]
           ) -> list[tuple[str, nn.Parameter]]:
    out = []
    for n, p in named:
        if id(p) not in seen:
            seen.add(id(p))
            out.append((n, p))
    return out


def _unit(module: nn.Module | None, named: list[tuple[str, nn.Parameter]], scope: int,
          entry: nn.Module) -> Unit:
    """The unit of ``named``: the trainable ones, and apart those that do not train."""
    return Unit(module, tuple((n, p) for n, p in named if p.requires_grad), scope, entry,
                frozen=tuple((n, p) for n, p in named if not p.requires_grad))


@dataclass
class FlatParam:
    """One unit's trainable parameters of one decay class, or (``frozen``) its
    parameters that do not train (stage 3 only).

    full: [padded] fp32 (stage 3: storage freed between uses); shard: [padded / dp],
    this rank's master copy (an ``nn.Parameter`` the optimizer updates; a frozen one's
    is in no optimizer group and gets no gradient); grad_full: stage 1's persistent full
    gradient; grad_flat: stage 3's unsharded gradient [padded] during the unit's
    backward (the parameters' ``.grad`` are views of it; freed once reduce-scattered);
    grad_sum: the reduced shard gradients of this step, unscaled.
    """

    unit: int
    params: list[nn.Parameter]
    names: list[str]
    offsets: list[int]
    full: torch.Tensor
    shard: nn.Parameter
    decay: bool
    scope: int = 0
    root: bool = False
    grad_full: torch.Tensor | None = None
    ready: set[int] = field(default_factory=set)
    grad_sum: torch.Tensor | None = None
    frozen: bool = False
    grad_flat: torch.Tensor | None = None

    @property
    def padded(self) -> int:
        return self.full.numel()

    @property
    def numel(self) -> int:
        """Real elements: the parameters' (the rest of ``padded`` is padding)."""
        return self.offsets[-1] + self.params[-1].numel()

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[o:o + p.numel()].view(p.shape)
                for p, o in zip(self.params, self.offsets, strict=True)]

    def shard_range(self, rank: int) -> tuple[int, int]:
        n = self.shard.numel()
        return rank * n, (rank + 1) * n

    def pieces(self, rank: int) -> Iterator[tuple[int, nn.Parameter, str, int, int]]:
        """(slot, parameter, name, start, stop) of each parameter's part inside rank
        ``rank``'s shard; start/stop index the parameter's flattening."""
        lo, hi = self.shard_range(rank)
        placed = zip(self.params, self.names, self.offsets, strict=True)
        for slot, (p, name, off) in enumerate(placed):
            a, b = max(lo, off), min(hi, off + p.numel())
            if a < b:
                yield slot, p, name, a - off, b - off

    def in_shard(self, rank: int, slot: int, start: int, stop: int) -> slice:
        """Where elements [start, stop) of parameter ``slot`` lie in rank's shard."""
        base = self.offsets[slot] - self.shard_range(rank)[0]
        return slice(base + start, base + stop)


def flatten_unit(unit: Unit, index: int, decay: bool | None, names: dict[int, str],
                 rank: int, size: int, stage: int, device: torch.device | None = None
                 ) -> FlatParam | None:
    """The FlatParam of ``unit``'s trainable parameters of one decay class, or (``decay``
    None) of its frozen ones (None if it has none); the parameters become views of its
    full buffer. Parameters on the meta device get their storage here, on ``device``,
    with undefined values (filled by loading a source): stage 3 then never holds more
    than its shard of them."""
    frozen = decay is None
    params = ([p for _, p in unit.frozen] if frozen
              else [p for _, p in unit.params if takes_decay(p) == decay])
    if not params:
        return None
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += p.numel()
    padded = -(-total // size) * size
    n = padded // size
    fresh = params[0].is_meta
    where = device if fresh else params[0].device
    if fresh:
        full = torch.empty(padded, dtype=params[0].dtype, device=where)
    else:
        full = torch.zeros(padded, dtype=params[0].dtype, device=where)
        with torch.no_grad():
            for p, o in zip(params, offsets, strict=True):
                full[o:o + p.numel()].copy_(p.detach().reshape(-1))
    # stages 1-2: the shard is this rank's slice of the full parameters (no second copy);
    # stage 3 frees the full buffer, so the shard is its own tensor
    if stage == 3:
        shard = nn.Parameter(torch.empty(n, dtype=full.dtype, device=where) if fresh
                             else full[rank * n:(rank + 1) * n].clone(),
                             requires_grad=not frozen)
    else:
        shard = nn.Parameter(full[rank * n:(rank + 1) * n], requires_grad=not frozen)
    flat = FlatParam(unit=index, params=params, names=[names[id(p)] for p in params],
                     offsets=offsets, full=full, shard=shard, decay=bool(decay),
                     scope=unit.scope, root=unit.module is None, frozen=frozen)
    for p, view in zip(params, flat.views(full), strict=True):
        give_storage(p, view)
    if fresh and stage == 3:  # never written: its pages were never touched
        free(full)
    if stage == 1 and not frozen:
        flat.grad_full = torch.zeros_like(full)
        for p, view in zip(params, flat.views(flat.grad_full), strict=True):
            p.grad = view
    return flat


def free(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


def materialize(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(t.numel() * t.element_size())


def is_freed(t: torch.Tensor) -> bool:
    return t.untyped_storage().size() == 0
