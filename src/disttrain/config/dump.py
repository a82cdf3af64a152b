"""Writing a Config back as TOML (the run directory's snapshot)."""

from __future__ import annotations

import json
from typing import Any

from .schema import Config
from .validate import RunPlan


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))


def config_to_toml(config: Config, plan: RunPlan | None = None) -> str:
    """TOML that loads back into the same config. With ``plan``, the resolved layout
    and batch triple are written out, so the snapshot reproduces the run exactly."""
    data = config.to_dict()
    if plan is not None:
        data["parallel"]["dp"] = plan.layout.dp
        for key in ("global_batch", "micro_batch", "grad_accum"):
            data["train"][key] = getattr(plan.batch, key)
    lines = []
    for section, table in data.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in table.items() if v is not None]
        lines.append("")
    return "\n".join(lines)
