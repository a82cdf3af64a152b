"""The composition step: one rank's part of the model and its training state.

:func:`compose` turns (model, its spec, the topology, each strategy's config slice) into
a :class:`Parallelized`: the module this rank runs, its :class:`~.interfaces.GradSync`
and :class:`~.interfaces.ShardedState`, the synchronisation between steps, and the kind
of step it needs. In order, over an unchanged model:

0. with ``train.compile``, each block wrapped for torch.compile
   (:func:`~.compilation.compile_blocks`), first, so every later wrapper and hook stays
   outside the compiled regions;
1. every dimension of the layout that applies something to a model, where its degree
   is > 1 (:func:`~.hybrid.apply_model_parallel`: the declared entries' behaviours,
   :mod:`.dimensions`), with activation checkpointing on the blocks;
2. the data-parallel strategy ``parallel.strategy`` selects (:mod:`.registry`) over
   the replica group, on whatever step 1 left this rank (blocks grouped per pipeline
   chunk);
3. the gradient side the optimizer ``train.optimizer`` needs, if any (1-bit Adam's
   follows its phase: local once the momentum is compressed), then, where a dimension
   changed the model, seen through :class:`~.hybrid.ModelParallelGrads`;
4. the sync mode ``train.sync``;
5. how a step's micro-batches run forward and backward (:class:`~.interfaces.StepPass`:
   the model cut's, through the whole module or through the pipeline schedule);
6. with the default causal-LM loss and ``train.fused_loss``, the output head swapped,
   where this rank runs it, for the fused linear + cross-entropy (:mod:`.fused_loss`:
   the same weight Parameter, so nothing above sees a difference), whose token loss
   the step's default loss then calls.

Each choice is looked up in :mod:`.registry`, each dimension in the declared list
(:mod:`disttrain.dimensions`); no dimension is named here. The training loop uses only
the result's interfaces.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..checkpoint.state import MODEL
from ..comm.collectives import CollectiveLedger, Communicator
from ..config.layout import Layout
from ..config.schema import Config, TrainConfig
from ..dimensions import Role, mesh_order
from ..param_names import canonical_name
from ..spec import ModelSpec, block_list, output_logits
from ..targets import IGNORE_INDEX
from ..weights.materialize import allocate, fill_buffers, on_meta, persistent_buffers
from .compilation import compile_blocks
from .fused_loss import FusedHead, fuse_output_head, head_refusal, loss_line
from .hybrid import ModelParallel, ModelParallelGrads, apply_model_parallel
from .interfaces import (
    GradSync,
    PartialSource,
    RunsOwnLoop,
    ShardedState,
    StatePiece,
    StepPass,
    StepTracer,
    SyncStrategy,
    TensorSource,
)
from .placement import Placement, tensor_pieces
from .registry import OPTIMIZER_REGISTRY, SYNC_MODE_REGISTRY, get_strategy
from .strategy import OptimizerContext, StrategyContext, SyncContext
from .topology import Topology


@dataclass(frozen=True)
class Groups:
    """The communicators a composition uses: the world, one per mesh axis (``axes``),
    and the groups of two roles: ``replicas`` (the ranks holding the same parameters,
    each on its own data: the data-parallel strategy reduces and shards over it, a
    step's held-out totals are summed over it) and ``samples`` (the ranks a global
    batch's samples, and the held-out samples, are split over). A role taken by one
    dimension is that axis's communicator; by several, their flattened group."""

    world: Communicator
    axes: Mapping[str, Communicator]
    replicas: Communicator
    samples: Communicator

    def axis(self, name: str) -> Communicator:
        return self.axes[name]

    @classmethod
    def build(cls, topology: Topology, ledger: CollectiveLedger) -> Groups:
        """One communicator per mesh axis and role over ``topology`` (every rank calls
        it: a flattened group is a collective)."""
        axes = {d.axis: Communicator(topology.group(d.axis), ledger, d.axis)
                for d in mesh_order()}

        def role(r: Role) -> Communicator:
            names = topology.role_axes(r)
            if len(names) == 1:
                return axes[names[0]]
            return Communicator(topology.role_group(r), ledger, "_".join(names))
        return cls(world=Communicator(None, ledger, "world"), axes=axes,
                   replicas=role(Role.REPLICAS), samples=role(Role.SAMPLES))


@dataclass
class Parallelized:
    """This rank's part of the model and its training state, composed.

    ``module``: what this rank runs (the model, or a ModuleList of its pipeline chunks);
    ``grads`` / ``state``: the declared interfaces the loop uses; ``sync``: what happens
    between steps (``train.sync``); ``passes``: how a step's micro-batches run forward
    and backward; ``mp``: the model-parallel dimensions' parts (none when no dimension
    changed the model) and the model's cut; ``strategy``: the data-parallel strategy's
    name; ``token_loss``: the per-token loss the module's outputs need (the fused
    linear + cross-entropy when ``fused`` swapped the output head: the outputs are then
    hidden states; else a part's, such as the vocabulary-parallel cross-entropy when
    the head is sharded over tp), or None for the ordinary one; ``fused``: the swapped
    head (None: the fused loss is off); ``layout_head``: the banner's line for the
    layout (empty when no dimension changed the model); ``loss_line``: its line for the
    loss (fused or not, and why).
    """

    module: nn.Module
    grads: GradSync
    state: ShardedState
    sync: SyncStrategy
    passes: StepPass
    mp: ModelParallel
    placement: Placement
    strategy: str
    groups: Groups
    zero_stage: int = 0
    token_loss: Callable[..., Any] | None = None  # what the module's outputs need
    followers: list[Any] = field(default_factory=list)  # parts that track the optimizer
    layout_head: str = ""
    fused: FusedHead | None = None
    loss_line: str = ""

    @property
    def own_loop(self) -> RunsOwnLoop | None:
        """The sync mode, when it replaces the step loop with its own."""
        return self.sync if isinstance(self.sync, RunsOwnLoop) else None

    def build_optimizer(self, config: Config, lr: float) -> torch.optim.Optimizer:
        """The optimizer ``train.optimizer`` names over :attr:`state`'s groups, handed
        to the parts that follow it."""
        train = config.train
        optimizer = OPTIMIZER_REGISTRY.get(train.optimizer).build(OptimizerContext(
            groups=self.state.optimizer_groups(train.weight_decay), lr=lr, train=train,
            replicas=self.groups.replicas))
        self.bind_optimizer(optimizer)
        return optimizer

    def layout_lines(self) -> str:
        """For the start-up banner: which ranks hold which layers and shards (where a
        dimension changed the model; a collective over the world), then how the loss is
        computed."""
        loss = f"\n{self.loss_line}" if self.loss_line else ""
        if not self.layout_head:
            return loss
        g = self.groups
        where = ", ".join(f"{d.key} {g.axis(d.axis).rank}" for d in mesh_order())
        mine = f"rank {g.world.rank} ({where}): {self.describe()}"
        return self.layout_head + "".join(
            f"\n  {line}" for line in g.world.all_gather_object(mine)) + loss

    def restore_head(self) -> None:
        """Put the output head the fused loss stood in for back (the end of ``fit()``:
        the model gives logits again); nothing when it is off, or done."""
        if self.fused is not None:
            self.fused.restore()

    def bind_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Hand the optimizer, once built over :attr:`state`'s groups, to the parts of
        the composition that follow it (1-bit Adam's gradient side follows its phase)."""
        for part in self.followers:
            part.follow(optimizer)

    def loss_for(self, loss_fn: Callable[..., Any] | None, plain: Callable[..., Any]
                 ) -> Callable[..., Any] | None:
        """The loss a step calls for the user's ``loss_fn`` (None: the batch's default
        loss, computed by :attr:`token_loss`). With the head fused into the loss, or
        its logits sharded over the vocabulary, ``plain`` (the causal-LM token loss
        on (logits, targets), ``IGNORE_INDEX`` ignored) is computed by
        :attr:`token_loss`, and any other ``loss_fn`` gets the full logits (never
        with the fused loss: :func:`compose` leaves it off for such a loss)."""
        token_loss = self.token_loss
        if token_loss is None or loss_fn is None:
            return loss_fn
        if loss_fn is plain:
            def plain_loss(outputs: Any, targets: Any) -> Any:
                return token_loss(output_logits(outputs), targets, IGNORE_INDEX)
            return plain_loss
        if self.fused is not None:  # never: see compose()
            raise RuntimeError(f"a loss_fn ({loss_fn!r}) with a token loss it cannot take "
                               "the logits of")
        return self.mp.full_logits_loss(loss_fn)

    def local_boxes(self, optimizer: torch.optim.Optimizer
                    ) -> dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]]:
        """``model/<name>`` -> the (global offsets, sizes) boxes of that tensor this rank
        holds: its tensor-parallel boxes, or under ZeRO the boxes of its shard's range
        (a tensor this rank holds but does not save, such as a tied copy, is absent:
        read whole). What a :class:`~.interfaces.PartialSource` reads for it."""
        if self.zero_stage:
            out: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
            for piece in self.state.state_pieces(optimizer) + self.state.frozen_pieces():
                if piece.name.startswith(MODEL):
                    out.setdefault(piece.name, []).append(
                        (piece.offsets, tuple(piece.tensor.shape)))
            return out
        return {MODEL + self.placement.name(p): [
            (b.global_offsets, b.shape)
            for b in self.placement.boxes(self.placement.name(p), p)]
            for p in self.module.parameters() if id(p) in self.placement.names}

    def fill(self, source: TensorSource, optimizer: torch.optim.Optimizer) -> None:
        """Give this rank's part of a model built on the meta device its values from
        ``source`` (global tensors by ``model/<name>``: the seeded initialiser, a
        pretrained directory), each rank reading only what it holds; then whatever
        follows the weights (a sync mode's round) starts from them."""
        if isinstance(source, PartialSource):
            source.want(self.local_boxes(optimizer))
        self.state.load_state(source, optimizer)
        # buffers by their full-model names: a pipeline chunk keeps the model's paths
        for part in self.mp.cut.buffer_holders():
            fill_buffers(part, source)
        self.sync.restart()

    def describe(self) -> str:
        """This rank's part, in one line (for the start-up banner)."""
        stage = f" (ZeRO-{self.zero_stage})" if self.zero_stage else ""
        layout = self.mp.describe()
        return f"{self.strategy}{stage}" + (f"; {layout}" if layout else "")

    def weight_pieces(self, optimizer: torch.optim.Optimizer) -> list[StatePiece]:
        """The pieces of the model's weights this rank contributes to the final weights
        (``model/<name>`` boxes of global tensors; over all ranks they cover every
        parameter, and every persistent buffer, at least once): under ZeRO each rank's
        shard pieces, else the data-parallel rank 0 replicas' parameters (their boxes
        where a dimension changed the model). No rank gathers anything: the writer
        assembles one tensor at a time. Valid before ``grads.finalize()``."""
        world, replicas = self.groups.world, self.groups.replicas
        whole = not self.mp.applied
        if self.zero_stage:
            pieces = [p for p in self.state.state_pieces(optimizer)
                      if p.name.startswith(MODEL)] + self.state.frozen_pieces()
        elif replicas.rank != 0:
            pieces = []
        elif whole:
            pieces = [StatePiece(MODEL + self.placement.name(p), p.detach(),
                                 tuple(p.shape), (0,) * p.dim())
                      for p in _unique(self.module.parameters())] if world.rank == 0 else []
        else:
            pieces = [StatePiece(MODEL + name, g.tensor.detach(), g.global_shape, g.offsets)
                      for name, p in self.mp.named_parameters() if self.placement.writes(p)
                      for g in tensor_pieces(self.placement.boxes(name, p), p)]
        if whole and world.rank == 0:  # buffers the model saves (whole)
            pieces += [StatePiece(MODEL + n, b.detach(), tuple(b.shape), (0,) * b.dim())
                       for n, b in persistent_buffers(self.module)]
        return pieces

    def full_state(self) -> dict[str, torch.Tensor] | None:
        """The unsharded model's parameters and buffers on global rank 0 (None
        elsewhere), after ``grads.finalize()``. Where no dimension changed the model
        every rank holds them; otherwise each replica-rank-0 rank sends the boxes it
        saves (one gather of small objects: meant for final weights, not for models too
        large for one host)."""
        world = self.groups.world
        if not self.mp.applied:
            return ({canonical_name(k): v for k, v in self.module.state_dict().items()}
                    if world.rank == 0 else None)
        mine = []
        if self.groups.replicas.rank == 0:
            for name, p in self.mp.named_parameters():
                if self.placement.writes(p):
                    mine += [(name, g.global_shape, g.offsets, g.tensor.detach().cpu().clone())
                             for g in tensor_pieces(self.placement.boxes(name, p), p)]
        everyone = world.all_gather_object(mine)
        if world.rank != 0:
            return None
        full: dict[str, torch.Tensor] = {}
        for pieces in everyone:
            for name, shape, offsets, t in pieces:
                out = full.setdefault(name, torch.empty(shape, dtype=t.dtype))
                out[tuple(slice(o, o + n) for o, n in zip(offsets, t.shape, strict=True))] = t
        return full


def _unique(params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    seen: set[int] = set()
    out = []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def compose(model: nn.Module, spec: ModelSpec, config: Config, topology: Topology,
            groups: Groups, *, micro_batches: int, num_samples: int,
            tracer: StepTracer | None = None, default_loss: bool = False) -> Parallelized:
    """Apply every strategy ``config`` selects to ``model`` for this rank (see the
    module docstring); ``micro_batches``: per step and replica (the pipeline's m);
    ``num_samples``: the training set's size (federated partitions); ``default_loss``:
    the step's loss is the causal-LM token loss (no ``loss_fn`` of the user's, or
    :func:`disttrain.models.token_loss`), which alone the fused loss may compute."""
    train, par = config.train, config.parallel
    refusal = _fused_refusal(model, spec, train, default_loss)  # on the unchanged model
    checkpointing = (train.activation_checkpointing, train.activation_checkpointing_k)
    fresh = on_meta(model)  # built on meta: only this rank's part gets storage, below
    if train.compile:  # refused at validation where it cannot apply
        blocks = block_list(model, spec)
        if blocks is None:
            raise ValueError("train.compile compiles the model's blocks; its spec names none")
        compile_blocks(blocks)
    mp = apply_model_parallel(model, spec, par, dict(groups.axes),
                              micro_batches=micro_batches, checkpointing=checkpointing,
                              seq_len=config.model.seq_len)
    module, placement = mp.module, mp.placement
    strategy = get_strategy(config)
    replicas = groups.replicas
    if fresh:  # parameters too unless the strategy allocates its own part of them
        allocate(module, replicas.device, params=not strategy.allocates)
    grads, state = strategy.build(StrategyContext(
        module=module, placement=placement, units=mp.cut.units(model),
        replicas=replicas, parallel=par, comm=config.comm, seed=train.seed,
        tracer=tracer, fresh=fresh))
    if fresh:  # what the strategy left (parameters that do not train)
        allocate(module, replicas.device)
    followers = []
    wrap = OPTIMIZER_REGISTRY.get(train.optimizer).wrap_grads
    if wrap is not None:  # the gradient side the optimizer needs
        grads = wrap(grads, replicas)
        followers.append(grads)
    if mp.applied:
        grads = ModelParallelGrads(grads, mp, groups.world)
    sync = SYNC_MODE_REGISTRY.get(train.sync).build(SyncContext(
        model=model, replicas=replicas, num_samples=num_samples, train=train,
        comm=config.comm))
    passes: StepPass = mp.cut.step_pass(grads, groups.world, replicas, tracer,
                                        mp.composed())
    fused = (fuse_output_head(spec.head, mp.cut.head_holder())
             if refusal is None and spec.head is not None else None)
    token_loss = fused.token_loss if fused is not None else mp.token_loss()
    return Parallelized(module=module, grads=grads, state=state, sync=sync, passes=passes,
                        mp=mp, placement=placement, strategy=strategy.name, groups=groups,
                        zero_stage=topology.layout.zero, token_loss=token_loss,
                        followers=followers, fused=fused,
                        layout_head=_layout_head(topology.layout, mp, micro_batches),
                        loss_line=loss_line(spec.head, refusal))


def _fused_refusal(model: nn.Module, spec: ModelSpec, train: TrainConfig,
                   default_loss: bool) -> str | None:
    """Why the fused linear + cross-entropy does not apply (None: it does)."""
    if not train.fused_loss:
        return "train.fused_loss=false"
    if not default_loss:
        return "the loss_fn given takes the logits"
    return head_refusal(model, spec)


def _layout_head(lay: Layout, mp: ModelParallel, micro_batches: int) -> str:
    """The banner's layout line where a dimension changed the model (empty otherwise):
    every degree in rank order, and what the cut adds (a pipeline's schedule)."""
    if not mp.applied:
        return ""
    degrees = " x ".join(f"{d.key}={lay.degree(d.key)}" for d in mesh_order())
    return f"\nlayout {degrees}" + mp.cut.headline(micro_batches)
