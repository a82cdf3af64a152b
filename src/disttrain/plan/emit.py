"""``disttrain plan --emit-config``: a layout as a TOML config ``disttrain train`` runs.

The model section says what disttrain builds: its GPT (``--model gpt``, or a custom
shape without gating, grouped-query attention or an MLP other than 4 x hidden), or a
transformers model (``model.hf_config`` pointing at the config.json given). The
config is checked by the same validation ``disttrain train`` runs before it is written.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..dimensions import plan_order
from ..errors import UserError
from ..parallel.dimensions import behaviour
from ..shape import ModelShape
from .estimate import Estimate
from .options import Options

# disttrain's activation_checkpointing for each planner recompute mode
_CHECKPOINTING = {"none": "none", "full": "full"}


def config_values(shape: ModelShape, ns: argparse.Namespace, best: Estimate,
                  options: Options | None = None) -> dict:
    """The config sections of ``best`` (nested dicts); ``train.fused_loss=false`` where
    ``options`` priced the loss on the full logits."""
    planned = best.layout
    if planned.recompute not in _CHECKPOINTING:
        raise UserError(f"--emit-config: disttrain has no {planned.recompute!r} recomputation "
                        "(it recomputes whole blocks); search with --recompute none,full")
    head = ns.model.partition(",")[0].strip()
    if head.endswith(".json"):
        model = {"hf_config": str(Path(head).resolve()), "seq_len": shape.seq}
    elif head == "gpt" or not (shape.gated or shape.kv_heads not in (0, shape.heads)
                               or shape.ffn not in (0, 4 * shape.hidden)
                               or shape.norm != "layernorm"):
        model = {"name": "gpt", "n_layer": shape.layers, "d_model": shape.hidden,
                 "n_head": shape.heads, "seq_len": shape.seq, "vocab_size": shape.vocab}
    else:
        raise UserError("--emit-config: disttrain builds this shape only from a "
                        "transformers config.json; pass --model path/config.json")
    m = planned.micro_batches(ns.global_batch)
    parallel: dict[str, Any] = {d.key: planned.degree(d.key) for d in plan_order()}
    parallel["zero"] = planned.zero
    for d in plan_order():  # the rest of each dimension's part of the section
        parallel.update(behaviour(d).pricing.config_values(planned))
    train = {"global_batch": ns.global_batch, "micro_batch": planned.mbs, "grad_accum": m,
             "precision": ns.precision,
             "activation_checkpointing": _CHECKPOINTING[planned.recompute]}
    if options is not None and not options.fused_loss:
        train["fused_loss"] = False
    return {"model": model, "train": train, "parallel": parallel}


def to_toml(values: dict) -> str:
    lines = ["# written by 'disttrain plan --emit-config'"]
    for section, items in values.items():
        lines.append(f"\n[{section}]")
        for key, value in items.items():
            if isinstance(value, bool):
                text = "true" if value else "false"
            elif isinstance(value, (int, float)):
                text = repr(value)
            else:
                text = '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'
            lines.append(f"{key} = {text}")
    return "\n".join(lines) + "\n"


def write_config(path: Path, shape: ModelShape, ns: argparse.Namespace,
                 best: Estimate, options: Options | None = None) -> Path:
    """Write ``best`` (estimated with ``options``) as TOML at ``path`` after validating
    it for its world size."""
    from ..config import load_config
    from ..run_checks import resolve

    values = config_values(shape, ns, best, options)
    config = load_config(values=values)
    resolve(config, best.layout.ranks)
    try:
        path.write_text(to_toml(values))
    except OSError as exc:
        raise UserError(f"--emit-config {path}: cannot write ({exc})") from None
    return path
