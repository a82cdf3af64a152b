"""What a checkpoint holds, as named tensors: model, optimizer state, RNG streams.

Names are global and layout-free: ``model/<parameter name>``, ``optim/<parameter
name>/<state key>`` (e.g. ``exp_avg``), ``rng/rank<r>/cpu``. Replicated tensors (data
parallelism) are written once, each by one owner rank chosen to balance bytes; so every
rank writes only what it owns.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
from torch import nn

from ..param_names import canonical_name
from .format import ShardReader

MODEL, OPTIM, RNG = "model/", "optim/", "rng/"


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters (a tied weight once, under its first name) and persistent buffers."""
    out = {MODEL + canonical_name(n): p.detach() for n, p in model.named_parameters()}
    persistent = set(model.state_dict().keys())
    out.update({MODEL + canonical_name(n): b.detach() for n, b in model.named_buffers()
                if canonical_name(n) in persistent})
    return out






def _param_names(model: nn.Module) -> dict[int, str]:
    return {id(p): canonical_name(n) for n, p in model.named_parameters()}


def optimizer_tensors(model: nn.Module, optimizer: torch.optim.Optimizer
                      ) -> dict[str, torch.Tensor]:
    """Per-parameter optimizer state; scalars become 0-d tensors so nothing needs
    pickling."""
    names = _param_names(model)
    out: dict[str, torch.Tensor] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                t = value if isinstance(value, torch.Tensor) else torch.tensor(value)
                out[f"{OPTIM}{names[id(p)]}/{key}"] = t.detach()
    return out


def rng_tensors(rank: int) -> dict[str, torch.Tensor]:
    out = {f"{RNG}rank{rank}/cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out[f"{RNG}rank{rank}/cuda"] = torch.cuda.get_rng_state()
    return out


def assign_owners(sizes: dict[str, int], world_size: int) -> dict[str, int]:
    """Each replicated tensor goes to the least-loaded rank, largest first; the same on
    every rank because it depends only on names and sizes."""
    load = [0] * world_size
    owners: dict[str, int] = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[name] = rank
        load[rank] += sizes[name]
    return owners




class NamedTensorReader(Protocol):
    """What restoring reads: tensors by global name (a :class:`ShardReader`, or any
    strategy's ``TensorSource``)."""

    def names(self, prefix: str = "") -> list[str]: ...

    def tensor(self, name: str) -> torch.Tensor: ...


def restore_named(reader: NamedTensorReader, tensors: Mapping[str, torch.Tensor],
                  to_local: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> None:
    """Copy each ``model/<name>`` tensor into ``tensors[name]``; ``to_local(name, full)``
    cuts this rank's part out of the global tensor (tensor parallelism)."""
    with torch.no_grad():
        for name, t in tensors.items():
            if name not in reader.names(name):
                raise KeyError(f"checkpoint has no tensor {name} (a different model?)")
            loaded = reader.tensor(name)
            if to_local is not None:
                loaded = to_local(name[len(MODEL):], loaded)
            if loaded.shape != t.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(loaded.shape)} != model "
                                 f"shape {tuple(t.shape)}")
            t.copy_(loaded)


def restore_optimizer(reader: NamedTensorReader, model: nn.Module,
                      optimizer: torch.optim.Optimizer, names: dict[int, str] | None = None,
                      to_local: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
                      skip: tuple[str, ...] = ()) -> None:
    """Rebuild ``optimizer.state`` from ``optim/...`` tensors, on each parameter's device;
    ``names`` (id(param) -> global name) and ``to_local`` as in :func:`restore_named`;
    ``skip``: keys kept outside ``optimizer.state`` (loaded by their owner)."""
    names = names or _param_names(model)
    state: dict[int, dict[str, Any]] = {}
    index = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            prefix = f"{OPTIM}{names[id(p)]}/"
            entries = {n[len(prefix):]: reader.tensor(n) for n in reader.names(prefix)
                       if n[len(prefix):] not in skip}
            if to_local is not None:  # per-element state has the parameter's shape
                entries = {k: to_local(names[id(p)], t) if t.dim() else t
                           for k, t in entries.items()}
            if entries:  # load_state_dict moves each value to its parameter's device
                state[index] = entries
            index += 1
    sd = optimizer.state_dict()
    sd["state"] = state
    optimizer.load_state_dict(sd)


def restore_rng(reader: ShardReader, rank: int) -> bool:
    """Set this rank's RNG streams if the checkpoint has them (it may have been saved
    with fewer ranks); returns whether it did."""
    name = f"{RNG}rank{rank}/cpu"
    if name not in reader.index.tensors:
        return False
    torch.set_rng_state(reader.tensor(name))
    cuda = f"{RNG}rank{rank}/cuda"
    if cuda in reader.index.tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(reader.tensor(cuda))
    return True
