"""ZeRO: data parallelism without redundant model state, in three stages over dp.

Parameters are grouped per *unit* (each block of the model's block list, plus root units
for everything else, per backward scope: the whole model, or each pipeline chunk) and
per weight-decay class into flat fp32 buffers (:mod:`.flat`), padded to a multiple of dp,
of which dp rank r owns slice r. The optimizer only ever sees the shards.

- stage 1: full parameters and full gradients (views into flat buffers, as in plain
  data parallelism); gradients are reduce-scattered in the synchronising backward, each
  rank updates its shard, and the parameters are all-gathered.
- stage 2: gradients are reduce-scattered unit by unit as every backward produces them,
  and the full gradient is freed; only the gradient shard is kept.
- stage 3: the full parameters of a block exist only while it runs (:mod:`.hooks`).

Under a pipeline each chunk is a scope of its own: its backward passes reduce its units
in their order, whatever the schedule interleaves between them. The state is saved as
pieces of the global tensors (:mod:`.state`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from ...comm.codecs import CAST_DTYPES
from ...comm.collectives import Communicator, TrackedWork
from ...names import STRATEGY_ZERO
from ...spec import block_list, generic_spec
from ..clipping import clip_to_global_norm, squared_norm
from ..interfaces import TensorSource, grad_of
from ..placement import Placement, StatePiece
from ..strategy import WIRE_DTYPES, DataParallelStrategy, StrategyContext
from .check import check_zero
from .flat import FlatParam, Unit, build_units, flatten_unit, free
from .hooks import ShardReducer, Stage3Gathers, cpu_forms, gather_flat
from .state import (
    load_frozen,
    load_rank_state,
    load_shards,
    rank_pieces,
    shard_pieces,
    whole_pieces,
)


class ZeroDataParallel:
    """Gradient sync and sharded state for ZeRO stage 1, 2 or 3 over ``comm`` (the dp
    group); implements :class:`~disttrain.parallel.interfaces.GradSync` and
    :class:`~disttrain.parallel.interfaces.ShardedState`."""

    grad_replicas = 1  # every dp rank holds a different slice of the gradient

    def __init__(self, units: list[Unit], comm: Communicator, stage: int,
                 placement: Placement, reduce_dtype: torch.dtype | None = None, *,
                 gather_at_end: bool = True, prefetch: int = 1) -> None:
        self.comm, self.stage, self.placement = comm, stage, placement
        self.gather_at_end = gather_at_end
        self.modules = list({id(u.entry): u.entry for u in units}.values())
        # parameters on meta get their storage here, only this rank's part of them
        device = comm.device if any(p.is_meta for u in units for _, p in u.params) else None
        self.flats: list[FlatParam] = [
            flat for index, unit in enumerate(units) for decay in (True, False)
            if (flat := flatten_unit(unit, index, decay, placement.names, comm.rank,
                                     comm.size, stage, device)) is not None]
        # parameters that do not train: no gradient, no optimizer state; stage 3 shards
        # them (gathered with their unit), stages 1-2 keep them whole
        self.frozen_flats: list[FlatParam] = [
            flat for index, unit in enumerate(units) if stage == 3
            if (flat := flatten_unit(unit, index, None, placement.names, comm.rank,
                                     comm.size, stage, device)) is not None]
        self.frozen_whole = [] if stage == 3 else [p for u in units for _, p in u.frozen]
        # stage 3: at most 1 + prefetch blocks gathered at once; a block's backward
        # first frees the unsharded gradients whose reduction is done, and on a CPU
        # group waits for the one still travelling: it shares the cores with the
        # backward, so letting it overlap buys little, while it stays a third block
        # beside the running block's parameters and gradient
        overlap = not cpu_forms(comm)
        self.gathers = (Stage3Gathers(units, self.flats + self.frozen_flats, comm, prefetch,
                                      release=lambda: self.reducer.drain(done_only=overlap))
                        if stage == 3 else None)
        self.reducer = ShardReducer(self.flats, comm, stage, reduce_dtype,
                                    self.gathers.launched if self.gathers else lambda f: None)
        self._sync = True
        self._slot = {id(p): (f, i) for f in self.flats for i, p in enumerate(f.params)}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                       for f in self.flats for p in f.params]

    def broadcast_parameters(self) -> None:
        """Every rank starts from dp rank 0's values (shards included); stage 3 then
        frees the full parameters."""
        with torch.no_grad():
            for f in self.flats + self.frozen_flats:
                self.comm.broadcast(f.full, src=0)
                if self.stage == 3:
                    lo, hi = f.shard_range(self.comm.rank)
                    f.shard.copy_(f.full[lo:hi])
            for p in self.frozen_whole:
                self.comm.broadcast(p.data, src=0)
            for m in self.modules:
                for b in m.buffers():
                    self.comm.broadcast(b.data, src=0)
        if self.stage == 3:
            for f in self.flats + self.frozen_flats:
                free(f.full)

    # ------------------------------------------------------------------ gradients
    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if not self._sync and self.stage == 1:
            return
        flat, slot = self._slot[id(param)]
        self.reducer.ready(flat, slot)

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
                self.reducer.end_all()

    @contextlib.contextmanager
    def backward(self, scope: int, last: bool) -> Iterator[None]:
        """One backward pass of pipeline chunk ``scope``; stage 1 reduces only in the
        chunk's ``last`` one, stages 2-3 in each, ending the scope's reductions after."""
        previous = self._sync
        self._sync = last
        try:
            yield
        finally:
            self._sync = previous
            if self.stage > 1 or last:
                self.reducer.end_scope(scope)

    def reduce_loss_totals(self, totals: torch.Tensor) -> TrackedWork:
        return self.comm.all_reduce(totals, async_op=True)

    def finish_gradient_sync(self, scale: float | torch.Tensor = 1.0) -> None:
        """Reduce what is left, then set each shard's gradient to ``scale`` x its sum."""
        self.reducer.end_all()
        self.reducer.drain()
        if self.gathers is not None:
            self.gathers.end_step()
        for f in self.flats:
            grad = f.grad_sum if f.grad_sum is not None else torch.zeros_like(f.shard)
            if f.grad_full is not None:  # stage 1: into this rank's slice of the full one
                lo, hi = f.shard_range(self.comm.rank)
                grad = f.grad_full[lo:hi].copy_(grad)
            f.shard.grad = grad.mul_(scale)
            f.grad_sum = None

    def gradient_pieces(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(parameter, its part of this rank's gradient shard) after the sync."""
        return [(p, f.shard.grad[f.in_shard(self.comm.rank, slot, a, b)])
                for f in self.flats if f.shard.grad is not None
                for slot, p, _, a, b in f.pieces(self.comm.rank)]

    def whole_flats(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]]:
        """Stage 1 only, which keeps every rank's whole unreduced gradient: per flat
        buffer (this rank's shard, the whole buffer [padded], the whole local gradient
        [padded], its real elements). What a step that skips the reduction (1-bit Adam
        once it compresses) works on."""
        if self.stage != 1:
            raise ValueError(f"whole local gradients are kept by ZeRO-1, not stage "
                             f"{self.stage}")
        out: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]] = []
        for f in self.flats:
            if f.grad_full is None:  # never: ZeRO-1 keeps each flat's full gradient
                raise RuntimeError(f"ZeRO-1 flat of unit {f.unit} has no grad_full")
            out.append((f.shard, f.full, f.grad_full, f.numel))
        return out

    def whole_gradients(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """Stage 1: (parameter, this rank's whole unreduced gradient, a view of its flat
        buffer's)."""
        if self.stage != 1:
            raise ValueError(f"whole local gradients are kept by ZeRO-1, not stage "
                             f"{self.stage}")
        return [(p, grad_of(p)) for f in self.flats for p in f.params]

    def zero_grad(self) -> None:
        self.reducer.new_step()
        for f in self.flats:
            f.shard.grad, f.grad_sum, f.grad_flat = None, None, None
            if f.grad_full is not None:
                f.grad_full.zero_()
                for p, view in zip(f.params, f.views(f.grad_full), strict=True):
                    p.grad = view

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Global norm over every rank's gradient shard (a 0-dim tensor on the device);
        clip if ``max_norm > 0``."""
        grads = [f.shard.grad for f in self.flats if f.shard.grad is not None]
        sq = squared_norm(grads, self.comm.device)
        return clip_to_global_norm(grads, sq, self.comm, max_norm)

    def after_optimizer_step(self) -> None:
        """Stages 1-2: all-gather the updated shards (unchanged after a skipped step)
        into the full parameters."""
        if self.stage == 3:
            return
        with torch.no_grad():
            for f in self.flats:  # the shard is a slice of full, sent from where it is
                for work in gather_flat(self.comm, f.full, f.shard.detach()):
                    work.wait()

    def model_state_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Bytes this rank holds now for parameters, gradients and optimizer state
        (full buffers count only while materialised; a shard that is a slice of the full
        buffer is not counted twice)."""
        def nbytes(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.untyped_storage().nbytes()
        params = sum(nbytes(f.full) + (nbytes(f.shard) if self.stage == 3 else 0)
                     for f in self.flats + self.frozen_flats)
        params += sum(p.numel() * p.element_size() for p in self.frozen_whole)
        grads = sum(nbytes(f.grad_full) if f.grad_full is not None  # shard grad: a slice
                    else 0 if f.shard.grad is None
                    else f.shard.grad.numel() * f.shard.grad.element_size()
                    for f in self.flats)
        optim = sum(v.numel() * v.element_size() for f in self.flats
                    for v in optimizer.state.get(f.shard, {}).values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0)
        return {"params": params, "grads": grads, "optimizer": optim}

    def comm_stats(self) -> dict[str, float]:
        return {}

    def finalize(self) -> None:
        """End of training: the hooks are removed, and every rank keeps the full
        parameters (stage 3 gathers them once more, unless built without
        ``gather_at_end``: a model built on the meta device stays sharded, as no rank
        may hold it whole)."""
        if self.gathers is not None:
            if self.gather_at_end:
                self.gathers.gather_all()
            else:  # the root units an evaluation left gathered, before the final weights
                self.gathers.end_step()
            self.gathers.remove()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    # ------------------------------------------------------------------ state
    def optimizer_groups(self, weight_decay: float) -> list[dict]:
        """Optimizer parameter groups over this rank's shards."""
        return [{"params": [f.shard for f in self.flats if f.decay],
                 "weight_decay": weight_decay},
                {"params": [f.shard for f in self.flats if not f.decay],
                 "weight_decay": 0.0}]

    param_groups = optimizer_groups

    def state_pieces(self, optimizer: torch.optim.Optimizer) -> list[StatePiece]:
        return (shard_pieces(self.flats, self.comm.rank, self.placement, optimizer)
                + rank_pieces(self.flats, self.placement, optimizer, self.comm.rank,
                              self.comm.size))

    def frozen_pieces(self) -> list[StatePiece]:
        """Stage 3: this rank's shard of every frozen parameter it writes; stages 1-2:
        the whole frozen parameters, from dp rank 0."""
        if self.stage == 3:
            return shard_pieces(self.frozen_flats, self.comm.rank, self.placement, None)
        if self.comm.rank != 0:
            return []
        return whole_pieces(self.frozen_whole, self.placement)

    def load_state(self, source: TensorSource, optimizer: torch.optim.Optimizer) -> None:
        """Fill this rank's shards (and their optimizer state) from any checkpoint, and
        the frozen parameters the source holds (an initial source does, a checkpoint
        does not); the full parameters are rebuilt from the shards (stages 1-2)."""
        load_shards(self.flats, self.comm.rank, self.placement, source, optimizer)
        load_rank_state(self.flats, self.placement, source, optimizer, self.comm.rank,
                        self.comm.size)
        load_frozen(self.frozen_flats, self.frozen_whole, self.comm.rank, self.placement,
                    source)
        self.after_optimizer_step()


def model_units(model: nn.Module) -> list[Unit]:
    """One scope (the whole model): its block list's blocks, then the root."""
    spec = generic_spec(model)
    found = block_list(model, spec) if spec.blocks else None
    blocks = list(found) if found is not None else []
    return build_units([(0, model, blocks)])


def apply_zero(model: nn.Module, comm: Communicator, stage: int, names: dict[int, str],
               reduce_dtype: torch.dtype | None = None, *,
               units: list[Unit] | None = None, placement: Placement | None = None,
               fresh: bool = False, prefetch: int = 1) -> ZeroDataParallel:
    """Shard ``model``'s training state over ``comm``'s group; ``names`` maps id(param)
    to its canonical name (for checkpoints); gradients are reduce-scattered in
    ``reduce_dtype`` (None: the parameters' dtype) and summed into fp32 shards.
    ``units`` (default: :func:`model_units`) and ``placement`` come from the
    composition under pipeline and tensor parallelism; ``fresh``: the values are filled
    afterwards alike on every rank (nothing broadcast, the shards kept at the end);
    ``prefetch``: stage 3's blocks gathered ahead of the running one."""
    placement = placement or Placement(names=names)
    zero = ZeroDataParallel(model_units(model) if units is None else units, comm, stage,
                            placement,
                            reduce_dtype, gather_at_end=not fresh, prefetch=prefetch)
    if not fresh:
        zero.broadcast_parameters()
    return zero


def build_zero(ctx: StrategyContext) -> tuple[ZeroDataParallel, ZeroDataParallel]:
    """The registry's builder: :func:`apply_zero` on the composition's units."""
    wire = CAST_DTYPES.get(ctx.comm.codec, WIRE_DTYPES[ctx.parallel.grad_reduce_dtype])
    zero = apply_zero(ctx.module, ctx.replicas, ctx.parallel.zero, ctx.placement.names, wire,
                      units=ctx.units, placement=ctx.placement, fresh=ctx.fresh,
                      prefetch=ctx.parallel.zero_prefetch)
    return zero, zero


ZERO = DataParallelStrategy(STRATEGY_ZERO, build_zero, check_zero, allocates=True)

__all__ = ["ZERO", "FlatParam", "Unit", "ZeroDataParallel", "apply_zero", "build_units",
           "build_zero", "model_units"]
