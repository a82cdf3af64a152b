"""ZeRO's per-stage gradient and parameter traffic, driven by autograd and module hooks.

- :class:`ShardReducer`: reduce-scatters each flat gradient once its unit's gradients
  are all in (stage 1: only in a synchronising backward; stages 2-3: every backward),
  in a fixed order per backward scope, so every dp rank issues the same collectives in
  the same order: within a scope the blocks last to first, then the root units.
- :class:`Stage3Gathers`: stage 3's just-in-time parameters: a block's full parameters
  are all-gathered before its forward (the next ``prefetch`` blocks of the scope
  prefetched) and again before its backward, and freed after each (a trainable flat
  once its gradient is being reduced; a frozen one, which has no gradient, once the
  backward of the block before it starts, when its own is over); root units are
  gathered when their scope's module starts its forward and kept until the step ends.
  A block's gradients accumulate into one flat buffer per flat, allocated as its
  backward starts (a root unit's: as its scope's forward ends, the head's gradient
  being a backward's first), which is what is reduce-scattered (no copy), and is freed
  as soon as the reduce-scatter is done: one unsharded gradient travels at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ...comm.collectives import Communicator, TrackedWork
from .flat import FlatParam, Unit, free, is_freed, materialize

# ZeRO's CPU forms (in-place broadcasts and all-reduces, a block's backward waiting for
# the reduction before it) where the group's tensors are on the CPU (Gloo); False runs
# the accelerator forms there too (one all-gather, a reduce-scatter, overlap), which is
# how the CPU suite checks the collectives NCCL runs (tests/parallel/test_zero_prefetch.py)
CPU_FORMS = True


def cpu_forms(comm: Communicator) -> bool:
    """Whether ``comm``'s ZeRO collectives take their CPU forms (see :data:`CPU_FORMS`)."""
    return CPU_FORMS and comm.size > 1 and comm.device.type == "cpu"


def gather_flat(comm: Communicator, full: torch.Tensor, shard: torch.Tensor
                ) -> list[TrackedWork]:
    """Every rank's ``shard`` [n] into ``full`` [size * n] (rank r's in block r); the
    works to wait for. On a CPU group, one broadcast per rank from its block, in place
    (this rank's shard first copied into its own block, unless it is that block): Gloo's
    all-gather stages its whole output in a temporary as large as ``full`` (with the
    reduce-scatter's, the largest transient a ZeRO-3 rank had: measured in
    ``docs/strategies/zero.md``), a broadcast none. Elsewhere (NCCL) one all-gather."""
    n = shard.numel()
    own = full[comm.rank * n:(comm.rank + 1) * n]
    in_place = own.data_ptr() == shard.data_ptr()  # stages 1-2: the shard is that block
    if not cpu_forms(comm):
        source = shard.clone() if in_place else shard
        return [comm.all_gather_into(full, source, async_op=True)]
    if not in_place:
        own.copy_(shard)
    return [comm.broadcast(full[r * n:(r + 1) * n], src=r, async_op=True)
            for r in range(comm.size)]


def reduce_flat(comm: Communicator, source: torch.Tensor) -> tuple[TrackedWork, torch.Tensor]:
    """Sum ``source`` [size * n], an unsharded gradient no one reads after, over the
    ranks: the work, and where this rank's block [n] of the sum is once it is done. On
    a CPU group an all-reduce of ``source`` in place, its block r a view of it: Gloo's
    reduce-scatter copies its whole input into a temporary, its all-reduce works in
    place (and, measured, in less time). Elsewhere (NCCL) a reduce-scatter into a new
    block."""
    n = source.numel() // comm.size
    if cpu_forms(comm):
        return comm.all_reduce(source, async_op=True), source[comm.rank * n:(comm.rank + 1) * n]
    out = torch.empty(n, dtype=source.dtype, device=source.device)
    return comm.reduce_scatter(out, source, async_op=True), out


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
            source = _unsharded_grad(flat)
            self.on_launch(flat)
        if self.reduce_dtype is not None and self.reduce_dtype != source.dtype:
            source = source.to(self.reduce_dtype)  # the shard is cast back on arrival
        if self.stage > 1:  # one unsharded gradient in flight at most: the previous one
            self.drain()    # is freed before this one travels
            work, out = reduce_flat(self.comm, source)
        else:  # stage 1 keeps the local gradient (1-bit Adam reads it): not in place
            out = torch.empty(flat.shard.numel(), dtype=source.dtype, device=source.device)
            work = self.comm.reduce_scatter(out, source, async_op=True)
        self.in_flight.append((flat, work, out, source))

    def drain(self, keep: int = 0, *, done_only: bool = False) -> None:
        """Wait for all but ``keep`` in-flight reductions (``done_only``: take only those
        already complete, waiting for none), adding their shards up; each one's
        unsharded gradient is freed as it is taken."""
        while len(self.in_flight) > keep:
            flat, work, out, source = self.in_flight[0]
            if done_only and not work.is_completed():
                return
            self.in_flight.pop(0)
            work.wait()
            out = out.to(flat.shard.dtype)
            if flat.grad_sum is None:  # of its own: not a block of the unsharded gradient
                aliased = out.untyped_storage().data_ptr() == source.untyped_storage().data_ptr()
                flat.grad_sum = out.clone() if aliased else out
            else:
                flat.grad_sum.add_(out)


def _unsharded_grad(flat: FlatParam) -> torch.Tensor:
    """``flat``'s whole gradient [padded], the parameters' ``.grad`` released: stage 3's
    flat buffer they accumulated into (:meth:`Stage3Gathers._grad_buffers`), or (stage
    2, or a unit whose hook did not run) a new one they are copied into."""
    source, flat.grad_flat = flat.grad_flat, None
    fresh = source is None
    if source is None:
        source = torch.zeros(flat.padded, dtype=flat.full.dtype, device=flat.full.device)
    for p, view in zip(flat.params, flat.views(source), strict=True):
        g = p.grad
        if g is not None and (fresh or g.data_ptr() != view.data_ptr()):
            view.copy_(g)  # autograd replaced the view (or there was none)
        p.grad = None
    return source


class Stage3Gathers:
    """Stage 3: gathers and frees the full parameters around the modules that use them.

    At most ``1 + prefetch`` blocks of a scope are gathered at once: in forward the
    running block and the ``prefetch`` after it; in backward the running block, then,
    once its gradient is being reduced and its parameters freed, the ``prefetch`` before
    it. ``release`` frees the unsharded gradients whose reduce-scatter is done (called
    as a block's backward starts, before its gradient buffer is allocated).
    """

    def __init__(self, units: list[Unit], flats: list[FlatParam], comm: Communicator,
                 prefetch: int = 1, release: Callable[[], None] = lambda: None) -> None:
        self.comm, self.prefetch, self.release = comm, prefetch, release
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
        self.root_units = {unit for seq in self.roots.values() for unit in seq}
        self.gathers: dict[int, list[TrackedWork]] = {}
        self.backward_prefetch: int | None = None  # the block whose launch prefetches
        self.hooks = self._install(units)

    def _following(self, unit: int, links: dict[int, int]) -> list[int]:
        """The ``prefetch`` blocks after ``unit`` along ``links`` (next or previous)."""
        out: list[int] = []
        while len(out) < self.prefetch and (unit := links.get(unit, -1)) >= 0:
            out.append(unit)
        return out

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
                    i, prefetch=self._following(i, self.next_block))),
                u.module.register_forward_hook(lambda m, a, o, i=i: self.free_unit(i)),
                u.module.register_full_backward_pre_hook(before_backward)]
        for entry, scope in entries.values():
            hooks += [entry.register_forward_pre_hook(
                          lambda m, a, scope=scope: self._gather_roots(scope)),
                      entry.register_forward_hook(
                          lambda m, a, o, scope=scope: self._root_grad_buffers(scope))]
        return hooks

    def _start(self, unit: int) -> None:
        if unit in self.gathers or unit not in self.by_unit:
            return
        works = []
        for f in self.by_unit[unit]:
            if is_freed(f.full):
                materialize(f.full)
                works += gather_flat(self.comm, f.full, f.shard.detach())
        self.gathers[unit] = works

    def gather(self, unit: int, prefetch: Sequence[int] = ()) -> None:
        self._start(unit)
        for ahead in prefetch:
            self._start(ahead)
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
        """Gather ``unit`` for its backward and give its trainable flats their gradient
        buffers (the reduce-scatters already done free theirs first); the blocks before
        it are prefetched once this one's parameters are freed (:meth:`launched`), not
        now: at the start of backward the activations are at their largest, and more
        gathered blocks on top of them would set the peak."""
        self.gather(unit)
        self.backward_prefetch = unit
        done = self.next_block.get(unit)  # its backward ran just before this one's
        if done is not None:
            self._free_frozen(done)
        self.release()
        self._grad_buffers(unit)

    def _grad_buffers(self, unit: int) -> None:
        """``unit``'s trainable flats get their unsharded gradient [padded], zeros, and
        their parameters' ``.grad`` become views of it: autograd then adds each new
        gradient into it in place (its rule for a ``.grad`` already set, outside
        double backward), so no per-parameter gradient outlives its computation (one
        autograd already gave, if any, is moved into it)."""
        for f in self.by_unit.get(unit, []):
            if not f.frozen and f.grad_flat is None:
                f.grad_flat = torch.zeros_like(f.full)
                for p, view in zip(f.params, f.views(f.grad_flat), strict=True):
                    if p.grad is not None:
                        view.copy_(p.grad)
                    p.grad = view

    def _root_grad_buffers(self, scope: int) -> None:
        """After a forward that records a graph: the scope's root units get their
        gradient buffers now, as the first gradients of a backward (the head's, a
        tied embedding's) are theirs; an evaluation's forward gets none."""
        if torch.is_grad_enabled():
            for unit in self.roots.get(scope, []):
                self._grad_buffers(unit)

    def _free_frozen(self, unit: int) -> None:
        for f in self.by_unit.get(unit, []):
            if f.frozen:
                free(f.full)

    def launched(self, flat: FlatParam) -> None:
        """``flat``'s gradient is being reduced: a block's full parameters are freed and
        the blocks whose backward comes next start gathering, overlapping the
        reduce-scatter."""
        if flat.root:
            return
        free(flat.full)
        if self.backward_prefetch == flat.unit:
            self.backward_prefetch = None
            for unit in self._following(flat.unit, self.prev_block):
                self._start(unit)

    def gathered(self) -> list[int]:
        """The block units whose parameters are materialised now (roots excluded)."""
        return [unit for unit, flats in self.by_unit.items()
                if unit not in self.root_units and any(not is_freed(f.full) for f in flats)]

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
