"""The composition step: one rank's part of the model and its training state.

:func:`compose` turns (model, its spec, the topology, each strategy's config slice) into
a :class:`Parallelized`: the module this rank runs, its :class:`~.interfaces.GradSync`
and :class:`~.interfaces.ShardedState`, the synchronisation between steps, and the kind
of step it needs. Each choice is looked up in :mod:`.registry`, each dimension in the
declared list (:mod:`disttrain.dimensions`), so no strategy or dimension is named here;
the order and why: ``docs/architecture.md``, "Composition".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..comm.collectives import CollectiveLedger, Communicator
from ..config.schema import Config, TrainConfig
from ..dimensions import Role, mesh_order
from ..spec import ModelSpec, block_list, output_logits
from ..targets import IGNORE_INDEX
from ..weights.materialize import allocate, on_meta
from .compilation import compile_blocks
from .fused_loss import FusedHead, fuse_output_head, head_refusal, loss_line
from .interfaces import (
    GradSync,
    RunsOwnLoop,
    ShardedState,
    StepPass,
    StepTracer,
    SyncStrategy,
)
from .model_parallel import ModelParallel, ModelParallelGrads, apply_model_parallel
from .placement import Placement
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
    and backward; ``model_parallel``: the model-parallel dimensions' parts (none when no dimension
    changed the model) and the model's cut; ``strategy``: the data-parallel strategy's
    name; ``token_loss``: the per-token loss the module's outputs need (the fused
    linear + cross-entropy when ``fused`` swapped the output head: the outputs are then
    hidden states; else a part's, such as the vocabulary-parallel cross-entropy when
    the head is sharded over tp), or None for the ordinary one; ``fused``: the swapped
    head (None: the fused loss is off); ``loss_line``: how the loss is computed (fused
    or not, and why), in a line for the start-up banner.
    """

    module: nn.Module
    grads: GradSync
    state: ShardedState
    sync: SyncStrategy
    passes: StepPass
    model_parallel: ModelParallel
    placement: Placement
    strategy: str
    groups: Groups
    zero_stage: int = 0
    token_loss: Callable[..., Any] | None = None  # what the module's outputs need
    optimizer_users: list[Any] = field(default_factory=list)  # parts that track the optimizer
    fused: FusedHead | None = None
    loss_line: str = ""

    @property
    def own_loop(self) -> RunsOwnLoop | None:
        """The sync mode, when it replaces the step loop with its own."""
        return self.sync if isinstance(self.sync, RunsOwnLoop) else None

    def build_optimizer(self, config: Config, lr: float) -> torch.optim.Optimizer:
        """The optimizer ``train.optimizer`` names over :attr:`state`'s groups, handed
        to the parts that use it."""
        train = config.train
        optimizer = OPTIMIZER_REGISTRY.get(train.optimizer).build(OptimizerContext(
            groups=self.state.optimizer_groups(train.weight_decay), lr=lr, train=train,
            replicas=self.groups.replicas))
        self.bind_optimizer(optimizer)
        return optimizer

    def restore_head(self) -> None:
        """Put the output head the fused loss stood in for back (the end of ``fit()``:
        the model gives logits again); nothing when it is off, or done."""
        if self.fused is not None:
            self.fused.restore()

    def bind_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Hand the optimizer, once built over :attr:`state`'s groups, to the parts of
        the composition that use it (1-bit Adam's gradient side follows its phase)."""
        for part in self.optimizer_users:
            part.bind_optimizer(optimizer)

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
        return self.model_parallel.full_logits_loss(loss_fn)



def compose(model: nn.Module, spec: ModelSpec, config: Config, topology: Topology,
            groups: Groups, *, micro_batches: int, num_samples: int,
            tracer: StepTracer | None = None, default_loss: bool = False) -> Parallelized:
    """Apply every strategy ``config`` selects to ``model`` for this rank, in order:
    compiled blocks, the model-parallel dimensions with activation checkpointing, the
    data-parallel strategy, the optimizer's gradient side, the sync mode, the step
    pass, the fused loss's head; ``micro_batches``: per step and replica (the pipeline's m);
    ``num_samples``: the training set's size (federated partitions); ``default_loss``:
    the step's loss is the causal-LM token loss (no ``loss_fn`` of the user's, or
    :func:`disttrain.models.token_loss`), which alone the fused loss may compute."""
    train, parallel = config.train, config.parallel
    refusal = _fused_refusal(model, spec, train, default_loss)  # on the unchanged model
    checkpointing = (train.activation_checkpointing, train.activation_checkpointing_k)
    fresh = on_meta(model)  # built on meta: only this rank's part gets storage, below
    if train.compile:  # refused at validation where it cannot apply
        blocks = block_list(model, spec)
        if blocks is None:
            raise ValueError("train.compile compiles the model's blocks; its spec names none")
        compile_blocks(blocks)
    model_parallel = apply_model_parallel(model, spec, parallel, dict(groups.axes),
                              micro_batches=micro_batches, checkpointing=checkpointing,
                              seq_len=config.model.seq_len)
    module, placement = model_parallel.module, model_parallel.placement
    strategy = get_strategy(config)
    replicas = groups.replicas
    if fresh:  # parameters too unless the strategy allocates its own part of them
        allocate(module, replicas.device, params=not strategy.allocates)
    grads, state = strategy.build(StrategyContext(
        module=module, placement=placement, units=model_parallel.cut.units(model),
        replicas=replicas, parallel=parallel, comm=config.comm, seed=train.seed,
        tracer=tracer, fresh=fresh))
    if fresh:  # what the strategy left (parameters that do not train)
        allocate(module, replicas.device)
    optimizer_users = []
    wrap = OPTIMIZER_REGISTRY.get(train.optimizer).wrap_grads
    if wrap is not None:  # the gradient side the optimizer needs
        grads = wrap(grads, replicas)
        optimizer_users.append(grads)
    if model_parallel.applied:
        grads = ModelParallelGrads(grads, model_parallel, groups.world)
    sync = SYNC_MODE_REGISTRY.get(train.sync).build(SyncContext(
        model=model, replicas=replicas, num_samples=num_samples, train=train,
        comm=config.comm))
    passes: StepPass = model_parallel.cut.step_pass(grads, groups.world, replicas, tracer,
                                        model_parallel.composed())
    fused = (fuse_output_head(spec.head, model_parallel.cut.head_holder())
             if refusal is None and spec.head is not None else None)
    token_loss = fused.token_loss if fused is not None else model_parallel.token_loss()
    return Parallelized(module=module, grads=grads, state=state, sync=sync, passes=passes,
                        model_parallel=model_parallel, placement=placement,
                        strategy=strategy.name, groups=groups,
                        zero_stage=topology.layout.zero, token_loss=token_loss,
                        optimizer_users=optimizer_users, fused=fused,
                        loss_line=loss_line(spec.head, refusal))


def _fused_refusal(model: nn.Module, spec: ModelSpec, train: TrainConfig,
                   default_loss: bool) -> str | None:
    """Why the fused linear + cross-entropy does not apply (None: it does)."""
    if not train.fused_loss:
        return "train.fused_loss=false"
    if not default_loss:
        return "the loss_fn given takes the logits"
    return head_refusal(model, spec)
