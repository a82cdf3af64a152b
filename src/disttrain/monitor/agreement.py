"""Start-up check: every rank must run the same config and the same model.

Ranks started with different settings would otherwise fail later inside a collective
(wrong sizes, a hang) with no hint why. Each rank describes itself as a flat mapping;
rank 0 compares and the first difference is reported before training starts.
"""

from __future__ import annotations

from typing import Any, cast

from torch import nn

from ..comm import Communicator
from ..config import Config
from ..errors import UserError


def fingerprint(config: Config, model: nn.Module) -> dict[str, str]:
    """``{"config train.lr": "0.003", "parameter blocks.0.mlp.up.weight": "(512, 128)
    float32", ...}`` in a fixed order."""
    out = {f"config {section}.{key}": repr(value)
           for section, table in config.to_dict().items() for key, value in table.items()}
    out["model class"] = type(model).__qualname__
    for name, p in model.named_parameters():
        out[f"parameter {name}"] = f"{tuple(p.shape)} {str(p.dtype).removeprefix('torch.')}"
    for name, b in model.named_buffers():
        out[f"buffer {name}"] = f"{tuple(b.shape)} {str(b.dtype).removeprefix('torch.')}"
    return out


def first_difference(a: dict[str, Any], b: dict[str, Any]) -> tuple[str, Any, Any] | None:
    for key in list(a) + [k for k in b if k not in a]:
        if a.get(key, "absent") != b.get(key, "absent"):
            return key, a.get(key, "absent"), b.get(key, "absent")
    return None


def check_agreement(comm: Communicator, config: Config, model: nn.Module) -> None:
    """Raise UserError on every rank if any rank's config or model differs from
    rank 0's, naming the first difference."""
    everyone = cast(list[dict[str, Any]], comm.all_gather_object(fingerprint(config, model)))
    for rank, theirs in enumerate(everyone[1:], start=1):
        diff = first_difference(everyone[0], theirs)
        if diff:
            what, ours, other = diff
            raise UserError(f"ranks disagree at start: {what} is {ours} on rank 0 but "
                            f"{other} on rank {rank} (start every rank with the same "
                            "config and model)")
