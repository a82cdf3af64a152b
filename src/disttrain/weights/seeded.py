"""Initial weights that do not depend on the layout: one generator per tensor.

A model built on the ``meta`` device has shapes and no values. :class:`SeededInit` gives
each of its parameters and buffers, by its full-model name, the values the model's own
initialisation gives it, drawn from a generator seeded by ``(seed, name)``: the same
values on every rank and at every layout, whatever else that rank holds, and at most
one whole tensor in memory at a time (a rank then keeps only its slice of it).

How one tensor is made: in a private meta copy of the model, the tensor alone is given
storage on the CPU (filled with NaN) and the model's init function is applied to its
module and then to each ancestor up to the root (the order ``Module.apply`` visits
them); in-place initialisers on the other, meta, tensors do nothing. A tensor the init
function leaves NaN is refused by name rather than trained from garbage. Buffers that
models compute rather than initialise (rotary frequencies) come out of the same path
when the init function recomputes them (transformers' ``_init_weights`` does).

Values are drawn on the CPU, so they do not depend on the device either.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable, Sequence
from typing import cast

import torch
from torch import nn

from ..checkpoint.state import MODEL
from ..errors import UserError
from ..param_names import canonical_name

InitFn = Callable[[nn.Module], None]


def tensor_seed(seed: int, name: str) -> int:
    """The generator seed of tensor ``name`` in a run seeded with ``seed``."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2 ** 63 - 1)


def stream_seed(seed: int, coordinates: Sequence[tuple[str, int]]) -> int:
    """The seed of a rank's random streams during training (dropout), from its
    (axis, coordinate) on every axis whose ranks draw distinct streams (data-parallel
    replicas, pipeline stages: ``streams/dp0/pp1``); the same on every rank of a
    tensor-parallel group (their replicated activations must draw the same masks)."""
    return tensor_seed(seed, "streams/" + "/".join(f"{a}{i}" for a, i in coordinates))


class SeededInit:
    """The initial model of a run, as a source of global tensors by name
    (``model/<name>``, as a checkpoint names them): parameters (a tied weight under its
    first name) and buffers, persistent or not.

    ``model``: the model on the meta device, as built (before any strategy touches it;
    a private copy is kept); ``init_fn``: applied to one module at a time, initialises
    that module's own tensors in place (e.g. transformers' ``model._init_weights``).
    """

    def __init__(self, model: nn.Module, init_fn: InitFn, seed: int) -> None:
        self.model = copy.deepcopy(model)
        self.init_fn, self.seed = init_fn, seed
        self._where: dict[str, tuple[str, str, bool]] = {}  # name -> (module, attr, param)
        seen: set[int] = set()
        for mname, module in self.model.named_modules():
            for attr, t in [*module._parameters.items(), *module._buffers.items()]:
                if t is None or id(t) in seen:
                    continue
                seen.add(id(t))
                full = canonical_name(f"{mname}.{attr}" if mname else attr)
                self._where[MODEL + full] = (mname, attr, attr in module._parameters)

    def names(self, prefix: str = "") -> list[str]:
        """The names of the model's tensors starting with ``prefix``."""
        return [n for n in self._where if n.startswith(prefix)]

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor ``name`` (from the meta model, nothing initialised)."""
        mname, attr, _ = self._where[name]
        return tuple(getattr(self.model.get_submodule(mname), attr).shape)

    def tensor(self, name: str) -> torch.Tensor:
        """The whole initial tensor ``name`` (on the CPU, in the model's dtype)."""
        mname, attr, is_param = self._where[name]
        owner = self.model.get_submodule(mname)
        # torch types the tables' values Parameter | None and Tensor | None: the names
        # listed hold tensors, and a Parameter goes back into the parameter table
        table = cast("dict[str, torch.Tensor]",
                     owner._parameters if is_param else owner._buffers)
        meta = table[attr]
        real = torch.full(meta.shape, float("nan"), dtype=meta.dtype, device="cpu") \
            if meta.is_floating_point() else torch.zeros(meta.shape, dtype=meta.dtype)
        table[attr] = nn.Parameter(real, meta.requires_grad) if is_param else real
        chain = [self.model.get_submodule(".".join(mname.split(".")[:i]))
                 for i in range(mname.count(".") + 1 if mname else 0, -1, -1)]
        try:
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                torch.manual_seed(tensor_seed(self.seed, name[len(MODEL):]))
                for module in chain:  # the module itself, then its ancestors
                    self.init_fn(module)
            out = table[attr].detach()
        finally:
            table[attr] = meta
        if out.is_floating_point() and bool(torch.isnan(out).any()):
            kind = "parameter" if is_param else "buffer"
            raise UserError(f"the model's initialisation leaves {kind} {name[len(MODEL):]} "
                            "unset, so it cannot be built on the meta device (give it "
                            "pretrained weights, or build the model on a real device)")
        return out
