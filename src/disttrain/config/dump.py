"""Writing a Config back as TOML (the run directory's snapshot)."""

from __future__ import annotations

import json
from typing import Any

from ..dimensions import Role, joined, with_role
from .consistency import RunPlan
from .schema import Config


def toml_value(value: Any) -> str:
    """``value`` written as TOML: ``true``, ``0.0003``, ``"gpt"``, ``[1, 2]``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(str(value))


def config_to_toml(config: Config, plan: RunPlan | None = None) -> str:
    """TOML that loads back into the same config. With ``plan``, the batch triple is
    written as the two members it was derived from, so the snapshot resolves to the
    same global batch on any number of ranks (the resolved layout goes in a comment)."""
    data = config.to_dict()
    lines = []
    if plan is not None:
        for key in ("global_batch", "micro_batch", "grad_accum"):
            given = key in plan.batch.given
            data["train"][key] = getattr(plan.batch, key) if given else None
        b, planned = plan.batch, plan.layout
        degrees = " ".join(f"{k}={n}" for k, n in planned.as_dict().items())
        lines.append(f"# resolved: {degrees}; "
                     f"global_batch {b.global_batch} = micro_batch {b.micro_batch} x "
                     f"grad_accum {b.grad_accum} x {joined(with_role(Role.SAMPLES))} "
                     f"{b.shares}")
    for section, table in data.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in table.items() if v is not None]
        lines.append("")
    return "\n".join(lines)
