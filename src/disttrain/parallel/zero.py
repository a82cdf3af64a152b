"""ZeRO: data parallelism without redundant model state, in three stages over dp.

Parameters are grouped per *unit* (each block of the model's block list, plus a root
unit for everything else) and per weight-decay class into :class:`FlatParam` s: one flat
fp32 buffer, padded to a multiple of dp, of which dp rank r owns elements
``[r*S, (r+1)*S)``. The optimizer only ever sees the shards.

- stage 1: full parameters and full gradients (views into flat buffers, as in plain
  data parallelism); gradients are reduce-scattered, each rank updates its shard, and
  the parameters are all-gathered.
- stage 2: gradients are reduce-scattered unit by unit as backward produces them and
  the full gradient is freed; only the gradient shard is kept.
- stage 3: the full parameters of a block exist only while it runs: all-gathered just
  before its forward and again before its backward (the next block prefetched), freed
  after; the root unit is gathered for the whole forward + backward.

Collectives are issued in the same order on every rank: reductions launch in unit
order, gathers follow the (deterministic) order of module hooks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from ..comm.collectives import Communicator, TrackedWork


@dataclass
class FlatParam:
    """One unit's parameters of one decay class.

    full: [padded] fp32 (stage 3: storage freed between uses); shard: [padded / dp],
    this rank's master copy (an ``nn.Parameter`` the optimizer updates); grad_shard:
    [padded / dp] the reduced gradient of the shard.
    """

    unit: int
    params: list[nn.Parameter]
    names: list[str]
    offsets: list[int]
    full: torch.Tensor
    shard: nn.Parameter
    decay: bool
    grad_full: torch.Tensor | None = None  # stage 1 only: the persistent full gradient
    ready: set[int] = field(default_factory=set)
    grad_sum: torch.Tensor | None = None   # reduced shard gradients of this step, unscaled

    @property
    def padded(self) -> int:
        return self.full.numel()

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[o:o + p.numel()].view(p.shape) for p, o in zip(self.params, self.offsets)]


def _units(model: nn.Module) -> list[tuple[nn.Module | None, list[tuple[str, nn.Parameter]]]]:
    """[(module or None for the root, [(name, param)])] with blocks in forward order and
    the root (parameters outside the block list) last."""
    blocks = next((m for m in model.modules() if isinstance(m, nn.ModuleList)), None)
    seen: set[int] = set()
    units = []
    if blocks is not None:
        prefix = next(n for n, m in model.named_modules() if m is blocks)
        for i, block in enumerate(blocks):
            named = [(f"{prefix}.{i}.{n}", p) for n, p in block.named_parameters()
                     if p.requires_grad and id(p) not in seen]
            seen.update(id(p) for _, p in named)
            units.append((block, named))
    root = [(n, p) for n, p in model.named_parameters()
            if p.requires_grad and id(p) not in seen]
    units.append((None, root))
    return units


class ZeroDataParallel:
    """The data-parallel handle for ZeRO stage 1, 2 or 3 (same interface as
    :class:`~disttrain.parallel.data.DataParallel`, plus the optimizer's shards)."""

    def __init__(self, model: nn.Module, comm: Communicator, stage: int,
                 names: dict[int, str], reduce_dtype: torch.dtype | None = None) -> None:
        self.model, self.comm, self.stage = model, comm, stage
        self.reduce_dtype = reduce_dtype  # the gradient wire dtype; None = the params'
        self.flats: list[FlatParam] = []
        self.unit_modules: list[nn.Module | None] = []
        for index, (module, named) in enumerate(_units(model)):
            self.unit_modules.append(module)
            for decay in (True, False):
                group = [(n, p) for n, p in named if (p.dim() >= 2) == decay]
                if group:
                    self.flats.append(self._flatten(index, group, decay, names))
        self._sync = True
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                       for f in self.flats for p in f.params]
        self._slot = {id(p): (f, i) for f in self.flats for i, p in enumerate(f.params)}
        root = len(self.unit_modules) - 1
        # backward produces the last block's gradients first and the root's (embeddings)
        # last: reductions launch in that order on every rank
        self._order = sorted(self.flats, key=lambda f: (f.unit == root, -f.unit))
        self._next_launch = 0
        self._in_flight: list[tuple[FlatParam, TrackedWork, torch.Tensor, torch.Tensor]] = []
        self._backward_prefetch: tuple[int, int] | None = None  # (freed unit, next unit)
        if stage == 3:
            self._install_stage3_hooks()

    # ------------------------------------------------------------------ layout
    def _flatten(self, unit: int, named: list[tuple[str, nn.Parameter]], decay: bool,
                 names: dict[int, str]) -> FlatParam:
        params = [p for _, p in named]
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += p.numel()
        size = self.comm.size
        padded = -(-total // size) * size
        full = torch.zeros(padded, dtype=params[0].dtype, device=params[0].device)
        with torch.no_grad():
            for p, o in zip(params, offsets):
                full[o:o + p.numel()].copy_(p.detach().reshape(-1))
        shard_size = padded // size
        mine = full[self.comm.rank * shard_size:(self.comm.rank + 1) * shard_size]
        # stages 1-2: the shard is this rank's slice of the full parameters (no second
        # copy); stage 3 frees the full buffer, so the shard is its own tensor
        shard = nn.Parameter(mine.clone() if self.stage == 3 else mine)
        flat = FlatParam(unit=unit, params=params, names=[names[id(p)] for p in params],
                         offsets=offsets, full=full, shard=shard, decay=decay)
        for p, view in zip(params, flat.views(full)):
            p.data = view
        if self.stage == 1:
            flat.grad_full = torch.zeros_like(full)
            for p, view in zip(params, flat.views(flat.grad_full)):
                p.grad = view
        return flat

    def param_groups(self, weight_decay: float) -> list[dict]:
        """Optimizer parameter groups over this rank's shards."""
        return [{"params": [f.shard for f in self.flats if f.decay],
                 "weight_decay": weight_decay},
                {"params": [f.shard for f in self.flats if not f.decay],
                 "weight_decay": 0.0}]

    def broadcast_parameters(self) -> None:
        """Every rank starts from dp rank 0's values (shards included); stage 3 then
        frees the full parameters."""
        with torch.no_grad():
            for f in self.flats:
                self.comm.broadcast(f.full, src=0)
                if self.stage == 3:
                    f.shard.copy_(self._my_part(f.full, f.shard.numel()))
            for b in self.model.buffers():
                self.comm.broadcast(b.data, src=0)
        if self.stage == 3:
            for f in self.flats:
                _free(f.full)

    def _my_part(self, flat: torch.Tensor, n: int) -> torch.Tensor:
        return flat[self.comm.rank * n:(self.comm.rank + 1) * n]

    # ------------------------------------------------------------------ gradients
    def _on_grad_ready(self, param: nn.Parameter) -> None:
        flat, slot = self._slot[id(param)]
        if not self._sync and self.stage == 1:
            return
        flat.ready.add(slot)
        self._launch_ready()

    def _launch_ready(self) -> None:
        order = self._order
        while self._next_launch < len(order):
            flat = order[self._next_launch]
            if len(flat.ready) < len(flat.params):
                return
            self._reduce(flat)
            self._next_launch += 1

    def _reduce(self, flat: FlatParam) -> None:
        """Reduce-scatter ``flat``'s gradient; stages 2-3 free the full gradient."""
        if self.stage == 1:
            source = flat.grad_full
        else:
            source = torch.zeros(flat.padded, dtype=flat.full.dtype, device=flat.full.device)
            for p, view in zip(flat.params, flat.views(source)):
                if p.grad is not None:
                    view.copy_(p.grad)
                    p.grad = None
            if self.stage == 3 and self.unit_modules[flat.unit] is not None:
                _free(flat.full)
                self._prefetch_after(flat.unit)
        if self.reduce_dtype is not None and self.reduce_dtype != source.dtype:
            source = source.to(self.reduce_dtype)  # the shard is cast back on arrival
        out = torch.empty(flat.shard.numel(), dtype=source.dtype, device=source.device)
        work = self.comm.reduce_scatter(out, source, async_op=True)
        self._in_flight.append((flat, work, out, source))
        if self.stage > 1:  # at most two full-size gradients alive: this one, the previous
            self._drain(keep=1)

    def _drain(self, keep: int = 0) -> None:
        """Wait for all but ``keep`` in-flight reductions, adding their shards up."""
        while len(self._in_flight) > keep:
            flat, work, out, _source = self._in_flight.pop(0)
            work.wait()
            out = out.to(flat.shard.dtype)
            if flat.grad_sum is None:
                flat.grad_sum = out
            else:
                flat.grad_sum.add_(out)

    def defer_reductions(self) -> None:
        """Stage 1: from now on hooks only record and :meth:`finish_gradient_sync`
        reduce-scatters everything. Stages 2-3 cannot wait (they keep no full
        gradient)."""
        if self.stage > 1:
            raise ValueError(f"ZeRO stage {self.stage} reduces during backward and cannot "
                             "defer its reductions; use stage 1")
        self._sync = False

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Stage 1 accumulates full gradients locally; stages 2-3 reduce every
        micro-batch (accumulating into the shard), keeping no full gradient."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous
            if self.stage > 1:
                self._end_backward()

    def _end_backward(self) -> None:
        """Launch what is left (unused parameters) in order, reset for the next pass."""
        for f in self._order[self._next_launch:]:
            f.ready = set(range(len(f.params)))
        self._launch_ready()
        for f in self.flats:
            f.ready.clear()
        self._next_launch = 0
        if self.stage == 3:
            self._backward_prefetch = None
            self._free_root()

    def finish_gradient_sync(self, scale: float = 1.0) -> None:
        """Reduce what is left, then set each shard's gradient to ``scale`` x its sum."""
        self._end_backward()
        self._drain()
        for f in self.flats:
            grad = f.grad_sum if f.grad_sum is not None else torch.zeros_like(f.shard)
            if f.grad_full is not None:  # stage 1: into this rank's slice of the full one
                mine = self._my_part(f.grad_full, f.shard.numel())
                grad = mine.copy_(grad)
            f.shard.grad = grad.mul_(scale)
            f.grad_sum = None

    def zero_grad(self) -> None:
        for f in self.flats:
            f.shard.grad, f.grad_sum = None, None
            if f.grad_full is not None:
                f.grad_full.zero_()
                for p, view in zip(f.params, f.views(f.grad_full)):
                    p.grad = view

    def clip_grad_norm(self, max_norm: float) -> float:
        """Global norm over every rank's gradient shard; clip if ``max_norm > 0``."""
        sq = torch.zeros(1, dtype=torch.float64, device=self.flats[0].full.device)
        for f in self.flats:
            if f.shard.grad is not None:
                sq += f.shard.grad.double().pow(2).sum()
        self.comm.all_reduce(sq)
        norm = float(sq.sqrt())
        if max_norm > 0 and norm > max_norm:
            for f in self.flats:
                if f.shard.grad is not None:
                    f.shard.grad.mul_(max_norm / (norm + 1e-6))
        return norm

    def after_optimizer_step(self) -> None:
        """Stages 1-2: all-gather the updated shards into the full parameters."""
        if self.stage == 3:
            return
        with torch.no_grad():
            for f in self.flats:  # the shard is a slice of full: send a copy of it
                self.comm.all_gather_into(f.full, f.shard.detach().clone())

    # ------------------------------------------------------------------ stage 3
    def _install_stage3_hooks(self) -> None:
        self._by_unit: dict[int, list[FlatParam]] = {}
        for f in self.flats:
            self._by_unit.setdefault(f.unit, []).append(f)
        self._gathers: dict[int, list[TrackedWork]] = {}
        self._hooks.append(self.model.register_forward_pre_hook(
            lambda m, a: self._gather_root()))
        blocks = [m for m in self.unit_modules if m is not None]
        for i, block in enumerate(blocks):
            self._hooks += [
                block.register_forward_pre_hook(
                    lambda m, a, i=i: self._gather_unit(i, prefetch=i + 1)),
                block.register_forward_hook(lambda m, a, o, i=i: self._free_unit(i)),
                block.register_full_backward_pre_hook(
                    lambda m, g, i=i: self._gather_for_backward(i))]

    def _start_gather(self, unit: int) -> None:
        if unit in self._gathers or unit not in self._by_unit:
            return
        works = []
        for f in self._by_unit[unit]:
            if f.full.untyped_storage().size() == 0:
                _materialize(f.full)
                works.append(self.comm.all_gather_into(f.full, f.shard.detach(),
                                                       async_op=True))
        self._gathers[unit] = works

    def _gather_unit(self, unit: int, prefetch: int) -> None:
        self._start_gather(unit)
        if 0 <= prefetch < len(self.unit_modules) - 1:
            self._start_gather(prefetch)
        for w in self._gathers.pop(unit, []):
            w.wait()

    def _gather_for_backward(self, unit: int) -> None:
        """Gather ``unit`` for its backward; the previous block is prefetched once this
        one's parameters are freed (see :meth:`_prefetch_after`), not now: at the start
        of backward the activations are at their largest, and two gathered blocks on
        top of them would set the peak."""
        self._gather_unit(unit, prefetch=-1)
        self._backward_prefetch = (unit, unit - 1)

    def _prefetch_after(self, unit: int) -> None:
        """``unit``'s full parameters were just freed in backward: start gathering the
        block whose backward comes next, overlapping this unit's reduce-scatter."""
        pending = self._backward_prefetch
        if pending is not None and pending[0] == unit:
            self._backward_prefetch = None
            if pending[1] >= 0:
                self._start_gather(pending[1])

    def _gather_root(self) -> None:
        self._gather_unit(len(self.unit_modules) - 1, prefetch=0)

    def _free_unit(self, unit: int) -> None:
        for f in self._by_unit.get(unit, []):
            _free(f.full)

    def _free_root(self) -> None:
        self._free_unit(len(self.unit_modules) - 1)

    def model_state_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Bytes this rank holds now for parameters, gradients and optimizer state
        (full buffers count only while materialised; a shard that is a slice of the full
        buffer is not counted twice)."""
        def nbytes(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.untyped_storage().nbytes()
        params = sum(nbytes(f.full) + (nbytes(f.shard) if self.stage == 3 else 0)
                     for f in self.flats)
        grads = sum(nbytes(f.grad_full) if f.grad_full is not None  # shard grad: a slice
                    else 0 if f.shard.grad is None
                    else f.shard.grad.numel() * f.shard.grad.element_size()
                    for f in self.flats)
        optim = sum(v.numel() * v.element_size() for f in self.flats
                    for v in optimizer.state.get(f.shard, {}).values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0)
        return {"params": params, "grads": grads, "optimizer": optim}

    # ------------------------------------------------------------------ checkpoints
    def _pieces(self, f: FlatParam) -> Iterator[tuple[str, int, int, int]]:
        """(name, param offset in flat, start, stop) of each parameter's part inside
        this rank's shard; start/stop index the parameter's flattening."""
        lo, hi = self.comm.rank * f.shard.numel(), (self.comm.rank + 1) * f.shard.numel()
        for p, name, off in zip(f.params, f.names, f.offsets):
            a, b = max(lo, off), min(hi, off + p.numel())
            if a < b:
                yield name, off, a - off, b - off

    def checkpoint_pieces(self, optimizer: torch.optim.Optimizer
                          ) -> dict[str, tuple[torch.Tensor, str, tuple, tuple[int, int] | None]]:
        """What this rank saves: ``key -> (tensor, global name, global shape, flat
        range)`` for its parts of every parameter and of their optimizer state, under
        the same global names a plain replica uses (so any layout loads it)."""
        out = {}
        for f in self.flats:
            lo = self.comm.rank * f.shard.numel()
            state = optimizer.state.get(f.shard, {})
            shapes = {n: tuple(p.shape) for n, p in zip(f.names, f.params)}
            for name, off, a, b in self._pieces(f):
                piece = slice(off + a - lo, off + b - lo)
                out[f"model/{name}@{a}"] = (f.shard.detach()[piece], f"model/{name}",
                                            shapes[name], (a, b))
                for key, value in state.items():
                    if isinstance(value, torch.Tensor) and value.dim() > 0:
                        out[f"optim/{name}/{key}@{a}"] = (value[piece],
                                                           f"optim/{name}/{key}",
                                                           shapes[name], (a, b))
                    elif a == 0:  # a scalar (Adam's step): once, by the first part's owner
                        t = value if isinstance(value, torch.Tensor) else torch.tensor(value)
                        out[f"optim/{name}/{key}"] = (t, f"optim/{name}/{key}", (), None)
        return out

    def load_checkpoint(self, reader: object, optimizer: torch.optim.Optimizer) -> None:
        """Fill this rank's shards (and their optimizer state) from any checkpoint:
        each parameter is read whole by its global name and cut to the shard."""
        for f in self.flats:
            lo = self.comm.rank * f.shard.numel()
            state: dict[str, torch.Tensor] = {}
            with torch.no_grad():
                for name, off, a, b in self._pieces(f):
                    piece = slice(off + a - lo, off + b - lo)
                    f.shard[piece] = reader.tensor(f"model/{name}").reshape(-1)[a:b]
                    for full_name in reader.names(f"optim/{name}/"):
                        key = full_name.rsplit("/", 1)[1]
                        value = reader.tensor(full_name)
                        if value.dim() == 0:
                            state[key] = value
                            continue
                        state.setdefault(key, torch.zeros_like(f.shard))[piece] = \
                            value.reshape(-1)[a:b]
            if state:
                optimizer.state[f.shard] = state
        if self.stage < 3:
            self.after_optimizer_step()  # rebuild the full parameters from the shards

    def finalize(self) -> None:
        """End of training: every rank keeps the full parameters (stage 3 gathers them
        once more) and the hooks are removed, so the model is a plain model again."""
        if self.stage == 3:
            with torch.no_grad():
                for unit in range(len(self.unit_modules)):
                    self._gather_unit(unit, prefetch=-1)
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def _free(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


def _materialize(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(t.numel() * t.element_size())


def apply_zero(model: nn.Module, comm: Communicator, stage: int,
               names: dict[int, str], reduce_dtype: torch.dtype | None = None
               ) -> ZeroDataParallel:
    """Shard ``model``'s training state over ``comm``'s group; ``names`` maps id(param)
    to its canonical name (for checkpoints); gradients are reduce-scattered in
    ``reduce_dtype`` (None: the parameters' dtype) and summed into fp32 shards."""
    zero = ZeroDataParallel(model, comm, stage, names, reduce_dtype)
    zero.broadcast_parameters()
    return zero
