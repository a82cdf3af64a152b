"""apply_tensor_parallel: swap a model's modules for tensor-parallel shards, by plan.

A plan is data: module-name patterns (``fnmatch`` on ``named_modules()`` names) -> a
style of :mod:`disttrain.spec` (``colwise``, ``rowwise``, ``vocab``, ``partial``, ...).
Every parameter is classified before anything is swapped, and modules are swapped in
place under the same names, so ``named_parameters()`` keeps the unsharded model's
names. Each style, the classification and dropout: ``docs/strategies/tensor.md``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from fnmatch import fnmatchcase
from typing import Any, TypeVar

import torch
from torch import nn

from ...adapters import LoRALinear
from ...comm.collectives import Communicator
from ...errors import ConfigError
from ...spec import (
    IDENTICAL,
    PARTIAL,
    SHARDED,
    TP_COLWISE_QKV,
    TP_LINEAR,
    TP_PARTIAL,
    TP_ROWWISE,
    TP_SEQUENCE,
    TP_SPLIT_SEQUENCE,
    TP_STYLES,
    TP_SWAPPED,
    TP_VOCAB,
    TP_VOCAB_HEAD,
    ModelSpec,
    UnclassifiedParameter,
    classify_tp_params,
    match_plan,
    output_logits,
    spec_for,
    with_logits,
)
from .functions import gather_from_tp_region, scatter_to_sequence_region, vocab_parallel_token_loss
from .layers import (
    Box,
    ColumnParallelLinear,
    RowParallelLinear,
    ShardedModule,
    VocabParallelEmbedding,
    VocabParallelHead,
    cut,
    whole_box,
)
from .lora import adapted_layer

STYLES = TP_STYLES


class TensorParallelLayoutError(ConfigError, ValueError):
    """The model cannot be split over this many tp ranks."""


def check_divisible(spec: ModelSpec, tp: int, *, sequence_parallel: bool = False) -> None:
    """Raise :class:`TensorParallelLayoutError` (a ValueError) naming the first model
    dimension in ``spec.tp_divisors`` that tp does not divide (and the sequence length
    under sequence parallelism)."""
    divisors = list(spec.tp_divisors)
    if sequence_parallel and spec.sequence_divisor is not None:
        divisors.append(spec.sequence_divisor)
    for d in divisors:
        if d.split % tp:
            ok = [k for k in range(1, d.split + 1) if d.split % k == 0 and k <= 64]
            raise TensorParallelLayoutError(
                d.field, d.value, f"the {d.what} ({d.split}) cannot be split over tp={tp} "
                f"ranks", f"use a parallel.tp that divides {d.split} (one of {ok}) or "
                f"change {d.field} so that tp={tp} divides the {d.what}")


class TensorParallel:
    """What :func:`apply_tensor_parallel` did to a model, for the trainer and checkpoints.

    Knows, for every parameter name (tied aliases included), the boxes placing the local
    tensor in the global one; which parameters are sharded; and which replicated ones
    receive partial gradients (sequence parallelism).
    """

    def __init__(self, comm: Communicator, boxes: dict[str, list[Box]],
                 sharded: set[int], partial: list[nn.Parameter],
                 sequence_parallel: bool, vocab_sharded: bool,
                 kinds: dict[str, str]) -> None:
        self.comm = comm
        self._kinds = kinds
        self.sequence_parallel = sequence_parallel
        self.vocab_sharded = vocab_sharded
        self._boxes, self._sharded, self._partial = boxes, sharded, partial

    def loss_fn(self, outputs: torch.Tensor, targets: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed loss, target count: a 0-dim device tensor) from local logits
        [B, T, V/tp]; use instead of :func:`disttrain.models.token_loss`. Same value
        on every tp rank."""
        return vocab_parallel_token_loss(outputs, targets, self.comm)

    def token_loss(self, logits: torch.Tensor, targets: torch.Tensor, ignore: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed cross-entropy, counted positions) of local logits [B, T, V/tp]
        against global ids [B, T], positions equal to ``ignore`` left out: what a
        batch's default loss uses in place of the full-vocabulary one."""
        return vocab_parallel_token_loss(logits, targets, self.comm, ignore_index=ignore)

    def full_logits_loss(self, loss_fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        """``loss_fn`` called on the full logits: the local ones [B, T, V/tp] are
        all-gathered over tp first (each rank keeps its block of their gradient), so a
        loss the vocabulary-parallel cross-entropy does not cover (label smoothing,
        weights, masks) computes what it computes in one process. Every tp rank then
        holds [B, T, V] logits for it, as one process would."""
        comm = self.comm

        def on_full_logits(outputs: Any, targets: Any) -> Any:
            full = gather_from_tp_region(output_logits(outputs), comm)
            return loss_fn(with_logits(outputs, full), targets)
        return on_full_logits

    def boxes(self, name: str) -> list[Box]:
        """Where this rank's tensor for parameter ``name`` lies in the global tensor."""
        try:
            return list(self._boxes[name])
        except KeyError:
            raise KeyError(f"{name!r} is not a parameter of the tensor-parallel model") from None

    def local_from_global(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's local tensor for ``name``, cut from the global ``full`` tensor."""
        return cut(full, self._boxes[name])

    def is_sharded(self, param: torch.Tensor) -> bool:
        """True if ``param`` holds only part of its global tensor (its squared norm must
        be summed over tp); False for a replicated one (count it once)."""
        return id(param) in self._sharded

    def kind(self, name: str) -> str:
        """What parameter ``name`` (its name in the full model, a tied alias too) is for
        its gradient: :data:`~disttrain.spec.SHARDED`, :data:`~disttrain.spec.PARTIAL`
        (summed over tp by :meth:`sync_replicated_grads`) or
        :data:`~disttrain.spec.IDENTICAL` (every tp rank computes the same gradient)."""
        try:
            return self._kinds[name]
        except KeyError:
            raise KeyError(f"{name!r} is not a parameter of the tensor-parallel model") from None

    @property
    def partial_params(self) -> list[nn.Parameter]:
        """Replicated parameters whose gradients are partial sums per tp rank (the
        plan's ``partial`` modules; sequence parallelism's norms and row-parallel
        biases)."""
        return list(self._partial)

    def sync_replicated_grads(self, grads: list[torch.Tensor] | None = None) -> None:
        """Sum over tp the gradients that are partial per rank (``grads``: their data
        this rank holds, e.g. ZeRO shard pieces; default: the partial parameters'
        ``.grad``); call once after the backward passes of a step, before clipping and
        the optimizer step. Every tp rank must pass pieces of the same shapes.

        A replicated parameter outside the tensor-parallel regions (norms, row-parallel
        biases, position embedding) sees the full activations and the full output
        gradient on every rank (the all-reduces of copy-to- and reduce-from-tp-region
        make them identical), so its gradient is already complete. A ``partial`` one
        (a per-head norm) sees only this rank's heads, and under sequence parallelism the
        norms and row-parallel biases see only this rank's positions: each rank holds a
        partial sum of those.
        """
        if grads is None:
            grads = [p.grad for p in self._partial if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])  # one collective for all
        self.comm.all_reduce(flat)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def apply_tensor_parallel(model: nn.Module, comm: Communicator, *,
                          spec: ModelSpec | None = None, plan: dict[str, str] | None = None,
                          sequence_parallel: bool = False) -> TensorParallel:
    """Shard ``model`` in place over the tp group of ``comm`` following ``plan``
    (default: the spec's ``tp_plan``; the spec defaults to
    :func:`~disttrain.spec.spec_for` the model); every tp rank must pass an
    identically initialised model. Returns the :class:`TensorParallel` handle."""
    spec = spec or spec_for(model)
    given = spec.tp_plan if plan is None else plan
    if given is None:
        raise ValueError(f"no tensor-parallel plan for a {type(model).__name__}: pass "
                         "plan= (module-name pattern -> style)")
    plan = dict(given)
    check_divisible(spec, comm.size, sequence_parallel=sequence_parallel)
    targets = match_plan(model, plan)
    _check_ties(model, targets)
    transposed = {n for n, _ in targets
                  if any(fnmatchcase(n, p) for p in spec.tp_transposed)}
    for name, style in targets:
        if style in TP_SWAPPED:
            _check_module(style, model.get_submodule(name), name in transposed)
    try:
        classify_tp_params(model, plan)  # before anything is swapped
    except UnclassifiedParameter as e:
        raise TensorParallelLayoutError("parallel.tp", comm.size, str(e)) from None
    if sequence_parallel and TP_SPLIT_SEQUENCE not in plan.values():
        raise ValueError("sequence_parallel=True needs a 'split_sequence' entry in the "
                         "plan: the module whose output enters the sequence-parallel region")
    shards: dict[int, nn.Parameter] = {}  # id(full parameter) -> its shard
    partial: list[nn.Parameter] = []
    for name, style in targets:
        module = model.get_submodule(name)
        if style in TP_SWAPPED:
            _swap(model, name, _build(style, module, comm, sequence_parallel, shards,
                                      transposed=name in transposed))
        elif style == TP_PARTIAL or (sequence_parallel and style == TP_SEQUENCE):
            partial.extend(p for p in module.parameters() if p.requires_grad)
        elif sequence_parallel and style == TP_SPLIT_SEQUENCE:
            module.register_forward_hook(
                lambda _m, _inp, out: scatter_to_sequence_region(out, comm))
    _set_local_heads(model, comm.size, spec.tp_head_attrs)
    vocab_sharded = any(style == TP_VOCAB_HEAD for _, style in targets)
    return _handle(model, comm, partial, sequence_parallel, vocab_sharded)


def _check_ties(model: nn.Module, targets: list[tuple[str, str]]) -> None:
    """A module left whole must not share a parameter with one being sharded (the
    GPT's head is tied to tok_emb: sharding one needs the other in the plan too)."""
    swapped = {n for n, s in targets if s in TP_SWAPPED}
    to_shard = {id(p) for n in swapped
                for p in model.get_submodule(n).parameters(recurse=False)}
    for name, m in model.named_modules():
        if name not in swapped and any(id(p) in to_shard
                                       for p in m.parameters(recurse=False)):
            raise ValueError(f"module {name!r} is not in the plan but shares a parameter "
                             "with a module that is sharded; add it to the plan "
                             "(a head tied to a 'vocab' embedding: 'vocab_head')")


_EXPECTED = {**dict.fromkeys(TP_LINEAR, nn.Linear), TP_VOCAB: nn.Embedding,
             TP_VOCAB_HEAD: nn.Linear}


def _check_module(style: str, module: nn.Module, transposed: bool) -> None:
    """Refuse a module that ``style`` cannot shard (a LoRA adapter's: its base layer;
    adapters on vocabulary styles are refused by the plan's classification)."""
    if isinstance(module, LoRALinear) and style in TP_LINEAR:
        module = module.base_layer
    if transposed and style in TP_LINEAR:
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise ValueError(f"style {style!r} on a transposed module needs a 2-D "
                             f"'weight' [in, out], got a {type(module).__name__}")
    elif type(module) is not _EXPECTED[style]:
        raise ValueError(f"style {style!r} needs a {_EXPECTED[style].__name__} module, "
                         f"got a {type(module).__name__}")


def _build(style: str, module: nn.Module, comm: Communicator, sequence_parallel: bool,
           shards: dict[int, nn.Parameter], *, transposed: bool = False) -> nn.Module:
    full_weight = module.weight
    tied = shards.get(id(full_weight))
    new: VocabParallelEmbedding | ColumnParallelLinear | RowParallelLinear
    if tied is not None and style != TP_VOCAB_HEAD:
        raise ValueError(f"a {style!r} module shares a weight with a module already "
                         "sharded; only a 'vocab_head' may share the 'vocab' embedding's")
    sp = {"sequence_parallel": sequence_parallel}
    if style == TP_VOCAB:
        new = VocabParallelEmbedding(_checked(module, nn.Embedding), comm)
    elif style == TP_VOCAB_HEAD:
        new = VocabParallelHead(_checked(module, nn.Linear), comm, tied=tied, **sp)
    elif isinstance(module, LoRALinear):  # the adapter split with the layer
        new = adapted_layer(style, module, comm, transposed=transposed, **sp)
    elif style == TP_ROWWISE:
        new = RowParallelLinear(module, comm, transposed=transposed, **sp)
    else:
        new = ColumnParallelLinear(module, comm, parts=3 if style == TP_COLWISE_QKV else 1,
                                   transposed=transposed, **sp)
    shards[id(full_weight)] = new.weight
    return new


_Module = TypeVar("_Module", bound=nn.Module)


def _checked(module: nn.Module, kind: type[_Module]) -> _Module:
    """``module`` as the ``kind`` :func:`_check_module` has already made sure it is."""
    if not isinstance(module, kind):
        raise TypeError(f"expected a {kind.__name__}, got a {type(module).__name__}")
    return module


def _swap(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def _set_local_heads(model: nn.Module, tp: int, attrs: tuple[str, ...]) -> None:
    """Each ``"module-pattern.attribute"`` of the spec's ``tp_head_attrs`` counts heads
    (or their total width) in an attention module whose projections are now sharded:
    each rank runs 1/tp of them."""
    for entry in attrs:
        pattern, _, attr = entry.rpartition(".")
        found = [m for n, m in model.named_modules() if fnmatchcase(n, pattern)]
        if not found:
            raise ValueError(f"tp_head_attrs entry {entry!r} matches no module")
        for m in found:
            value = getattr(m, attr)
            if value % tp:
                raise TensorParallelLayoutError(
                    attr, value, f"cannot be split over tp={tp} ranks",
                    f"use a parallel.tp that divides {value}")
            setattr(m, attr, value // tp)


def _handle(model: nn.Module, comm: Communicator, partial: list[nn.Parameter],
            sequence_parallel: bool, vocab_sharded: bool) -> TensorParallel:
    """Collect every parameter's boxes (tied aliases too) once the swaps are done."""
    boxes: dict[str, list[Box]] = {}
    sharded: set[int] = set()
    found: list[tuple[str, nn.Parameter]] = []
    for mod_name, m in model.named_modules():
        sharded_module = isinstance(m, ShardedModule)
        own = m.param_boxes() if sharded_module else {}
        partial.extend(m.partial_grad_params() if sharded_module else [])
        for p_name, p in m._parameters.items():
            if p is None:
                continue
            box = own.get(p_name) or whole_box(tuple(p.shape))
            name = f"{mod_name}.{p_name}" if mod_name else p_name
            boxes[name] = box
            found.append((name, p))
            if p.numel() < math.prod(box[0].global_shape):
                sharded.add(id(p))
    partial_ids = {id(p) for p in partial}
    kinds = {name: SHARDED if id(p) in sharded else PARTIAL if id(p) in partial_ids
             else IDENTICAL for name, p in found}
    return TensorParallel(comm, boxes, sharded, partial, sequence_parallel,
                          vocab_sharded, kinds)

