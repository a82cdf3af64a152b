"""ZeRO's per-stage gradient and parameter traffic, driven by autograd and module hooks.

- :class:`ShardReducer`: reduce-scatters each flat gradient once its unit's gradients
  are all in (stage 1: only in a synchronising backward; stages 2-3: every backward),
  in a fixed order per backward scope, so every dp rank issues the same collectives in
  the same order: within a scope the blocks last to first, then the root units.
- :class:`Stage3Gathers`: stage 3's just-in-time parameters: a block's full parameters
  are all-gathered before its forward (the next block of the scope prefetched) and
  again before its backward, and freed after each (a trainable flat once its gradient
  is being reduced; a frozen one, which has no gradient, once the backward of the block
  before it starts, when its own is over); root units are gathered when their scope's
  module starts its forward and kept until the step ends.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ...comm.collectives import Communicator, TrackedWork
from .flat import FlatParam, Unit, free, is_freed, materialize


class ShardReducer:
    """Launches, orders and completes the reduce-scatters of the flat gradients."""

    def __init__(self, flats: list[FlatParam], comm: Communicator, stage: int,
                 reduce_dtype: torch.dtype | None,
                 on_launch: Callable[[FlatParam], None] = lambda f: None) -> None:
        self.comm, self.stage, self.reduce_dtype = comm, stage, reduce_dtype
        self.on_launch = on_launch  # stage 3: free the block and prefetch the next one
        self.order: dict[int, list[FlatParam]] = {}
        for f in sorted(flats, key=lambda f: (f.scope, f.root, f.unit if f.root else -f.unit)):
            self.order.setdefault(f.scope, []).append(f)
        self.next = dict.fromkeys(self.order, 0)
        self.ended: set[int] = set()  # scopes whose reductions ended in this step
        self.in_flight: list[tuple[FlatParam, TrackedWork, torch.Tensor, torch.Tensor]] = []

    def ready(self, flat: FlatParam, slot: int) -> None:
        flat.ready.add(slot)
        self._launch_ready(flat.scope)

    def _launch_ready(self, scope: int) -> None:
        order = self.order[scope]
        while self.next[scope] < len(order):
            flat = order[self.next[scope]]
            if len(flat.ready) < len(flat.params):
                return
            self._reduce(flat)
            self.next[scope] += 1

    def new_step(self) -> None:
        self.ended.clear()

    def end_scope(self, scope: int) -> None:
        """The scope's backward is over: reduce what is left in order (parameters that
        got no gradient count as zero), reset for its next backward (a scope whose
        parameters all are frozen has nothing to reduce)."""
        if scope not in self.order:
            return
        for f in self.order[scope][self.next[scope]:]:
            f.ready = set(range(len(f.params)))
        self._launch_ready(scope)
        for f in self.order[scope]:
            f.ready.clear()
        self.next[scope] = 0
        self.ended.add(scope)

    def end_all(self) -> None:
        """End every scope with reductions under way, and every scope not reduced yet in
        this step (so each rank reduces each scope at least once per step)."""
        for scope, order in self.order.items():
            started = self.next[scope] > 0 or any(f.ready for f in order)
            if started or scope not in self.ended:
                self.end_scope(scope)

    def _reduce(self, flat: FlatParam) -> None:
        """Reduce-scatter ``flat``'s gradient; stages 2-3 free the full gradient."""
        if self.stage == 1:
            if flat.grad_full is None:  # never: stage 1 builds each flat's full gradient
                raise RuntimeError(f"ZeRO stage 1 flat of unit {flat.unit} has no grad_full")
            source = flat.grad_full
        else:
            source = torch.zeros(flat.padded, dtype=flat.full.dtype, device=flat.full.device)
            for p, view in zip(flat.params, flat.views(source), strict=True):
                if p.grad is not None:
                    view.copy_(p.grad)
                    p.grad = None
            self.on_launch(flat)
        if self.reduce_dtype is not None and self.reduce_dtype != source.dtype:
            source = source.to(self.reduce_dtype)  # the shard is cast back on arrival
        out = torch.empty(flat.shard.numel(), dtype=source.dtype, device=source.device)
        work = self.comm.reduce_scatter(out, source, async_op=True)
        self.in_flight.append((flat, work, out, source))
        if self.stage > 1:  # at most two full-size gradients alive: this one, the previous
            self.drain(keep=1)

    def drain(self, keep: int = 0) -> None:
        """Wait for all but ``keep`` in-flight reductions, adding their shards up."""
        while len(self.in_flight) > keep:
            flat, work, out, _source = self.in_flight.pop(0)
            work.wait()
            out = out.to(flat.shard.dtype)
            if flat.grad_sum is None:
                flat.grad_sum = out
            else:
                flat.grad_sum.add_(out)


class Stage3Gathers:
    """Stage 3: gathers and frees the full parameters around the modules that use them."""

    def __init__(self, units: list[Unit], flats: list[FlatParam], comm: Communicator
                 ) -> None:
        self.comm = comm
        self.by_unit: dict[int, list[FlatParam]] = {}
        for f in flats:
            self.by_unit.setdefault(f.unit, []).append(f)
        self.roots: dict[int, list[int]] = {}   # scope -> its root units
        blocks: dict[int, list[int]] = {}       # scope -> its block units, forward order
        for i, u in enumerate(units):
            (blocks if u.module is not None else self.roots).setdefault(u.scope, []).append(i)
        self.next_block: dict[int, int] = {}
        self.prev_block: dict[int, int] = {}
        for seq in blocks.values():
            for a, b in zip(seq, seq[1:], strict=False):
                self.next_block[a], self.prev_block[b] = b, a
        self.first_block = {scope: seq[0] for scope, seq in blocks.items()}
        self.gathers: dict[int, list[TrackedWork]] = {}
        self.backward_prefetch: tuple[int, int] | None = None  # (freed unit, next unit)
        self.hooks = self._install(units)

    def _install(self, units: list[Unit]) -> list[RemovableHandle]:
        hooks: list[RemovableHandle] = []
        entries: dict[int, tuple[nn.Module, int]] = {}  # id(entry) -> (entry, its scope)
        for i, u in enumerate(units):
            entries.setdefault(id(u.entry), (u.entry, u.scope))
            if u.module is None:
                continue

            def before_backward(_m: nn.Module, _grads: object, i: int = i) -> None:
                self._gather_for_backward(i)
            hooks += [
                u.module.register_forward_pre_hook(lambda m, a, i=i: self.gather(
                    i, prefetch=self.next_block.get(i))),
                u.module.register_forward_hook(lambda m, a, o, i=i: self.free_unit(i)),
                u.module.register_full_backward_pre_hook(before_backward)]
        for entry, scope in entries.values():
            hooks.append(entry.register_forward_pre_hook(
                lambda m, a, scope=scope: self._gather_roots(scope)))
        return hooks

    def _start(self, unit: int) -> None:
        if unit in self.gathers or unit not in self.by_unit:
            return
        works = []
        for f in self.by_unit[unit]:
            if is_freed(f.full):
                materialize(f.full)
                works.append(self.comm.all_gather_into(f.full, f.shard.detach(),
                                                       async_op=True))
        self.gathers[unit] = works

    def gather(self, unit: int, prefetch: int | None = None) -> None:
        self._start(unit)
        if prefetch is not None:
            self._start(prefetch)
        for w in self.gathers.pop(unit, []):
            w.wait()

    def _gather_roots(self, scope: int) -> None:
        roots = self.roots.get(scope, [])
        for unit in roots:
            self._start(unit)
        first = self.first_block.get(scope)
        if first is not None:
            self._start(first)
        for unit in roots:
            self.gather(unit)

    def _gather_for_backward(self, unit: int) -> None:
        """Gather ``unit`` for its backward; the previous block is prefetched once this
        one's parameters are freed (:meth:`launched`), not now: at the start of backward
        the activations are at their largest, and two gathered blocks on top of them
        would set the peak."""
        self.gather(unit)
        self.backward_prefetch = (unit, self.prev_block.get(unit, -1))
        done = self.next_block.get(unit)  # its backward ran just before this one's
        if done is not None:
            self._free_frozen(done)

    def _free_frozen(self, unit: int) -> None:
        for f in self.by_unit.get(unit, []):
            if f.frozen:
                free(f.full)

    def launched(self, flat: FlatParam) -> None:
        """``flat``'s gradient is being reduced: a block's full parameters are freed and
        the block whose backward comes next starts gathering, overlapping the
        reduce-scatter."""
        if flat.root:
            return
        free(flat.full)
        pending = self.backward_prefetch
        if pending is not None and pending[0] == flat.unit:
            self.backward_prefetch = None
            if pending[1] >= 0:
                self._start(pending[1])

    def free_unit(self, unit: int) -> None:
        for f in self.by_unit.get(unit, []):
            free(f.full)

    def end_step(self) -> None:
        """Free every unit still gathered (the root units, kept for the whole step; the
        blocks' frozen parameters; a block prefetched for a backward that never came,
        as one whose input needs no gradient), once its gather is done, and forget
        prefetches."""
        self.backward_prefetch = None
        for works in self.gathers.values():
            for w in works:
                w.wait()
        self.gathers.clear()
        for unit in self.by_unit:
            self.free_unit(unit)

    def gather_all(self) -> None:
        with torch.no_grad():
            for unit in self.by_unit:
                self.gather(unit)

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks.clear()
