"""Storage for a model built on the meta device, and its values from a source.

:func:`allocate` gives the meta tensors of one rank's part of the model storage on its
device (uninitialised), keeping every parameter object (the strategies and the
placement know parameters by identity) and every tie (a weight shared by two modules
stays one tensor). :func:`fill_buffers` copies buffers, persistent or not, from a
source of global tensors (parameters are filled by the strategy's own ``load_state``,
which knows where each rank's piece lies).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ..checkpoint.state import MODEL
from ..param_names import canonical_name


def on_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` has no storage (meta device)."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def give_storage(param: nn.Parameter, data: torch.Tensor) -> None:
    """Make ``param`` (the same object) hold ``data``, also when it is on meta."""
    if param.is_meta:  # .data cannot move a tensor off meta; a swap keeps the object
        torch.utils.swap_tensors(param, nn.Parameter(
            torch.empty(0, dtype=data.dtype, device=data.device), param.requires_grad))
    param.data = data  # not an autograd view of ``data``: its own version counter


def allocate(module: nn.Module, device: torch.device, *, params: bool = True) -> None:
    """Storage on ``device`` for every meta buffer of ``module`` and, with ``params``,
    every meta parameter (the values are undefined until filled)."""
    done: set[int] = set()
    for m in module.modules():
        tables: list[Mapping[str, torch.Tensor | None]] = [
            m._buffers, *([m._parameters] if params else [])]
        for table in tables:
            for t in table.values():
                if t is None or not t.is_meta or id(t) in done:
                    continue
                done.add(id(t))
                empty = torch.empty(t.shape, dtype=t.dtype, device=device)
                if isinstance(t, nn.Parameter):
                    give_storage(t, empty)
                else:
                    torch.utils.swap_tensors(t, empty)


def fill_buffers(module: nn.Module, source) -> None:
    """Copy each buffer of ``module`` that ``source`` names (``model/<full name>``)."""
    with torch.no_grad():
        for name, b in module.named_buffers():
            full = MODEL + canonical_name(name)
            if full in source.names(full):
                b.copy_(source.tensor(full))


def persistent_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(full name, buffer) of every buffer of ``module`` that its ``state_dict`` saves."""
    out = []
    for mname, m in module.named_modules():
        for bname, b in m._buffers.items():
            if b is not None and bname not in m._non_persistent_buffers_set:
                out.append((canonical_name(f"{mname}.{bname}" if mname else bname), b))
    return out
