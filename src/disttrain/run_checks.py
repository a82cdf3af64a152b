"""The whole-config validation, before any process group exists.

:func:`resolve` turns a :class:`~disttrain.config.Config`, the world size and the
model's spec into a :class:`~disttrain.config.consistency.RunPlan` (the layout, the batch
triple with its third member derived, the learning rate), asking each part that has
constraints: the config's own sections, then every strategy the config selects, each
through the check that lives beside it (the registered ones: :mod:`.parallel.registry`;
each dimension's: :mod:`.parallel.dimensions`).
It sits above both ``config`` and ``parallel`` (the launcher and the Trainer call it),
so neither imports the other.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from .config.consistency import (
    RunPlan,
    check_sections,
    check_shared_gpu,
    data_parallel_degree,
    resolve_batch,
    scaled_lr,
)
from .config.layout import resolve_layout
from .config.schema import Config, ModelConfig
from .data.packing_check import check_packing
from .models.gpt import GPT, gpt_spec
from .models.hf import build_hf_model, hf_config_spec, is_hf
from .parallel.balance import check_balance
from .parallel.compilation import check_compile
from .parallel.dimensions import check_dimensions
from .parallel.ft.check import check_fault_tolerance, replica_groups
from .parallel.registry import check_selected
from .spec import ModelSpec


def resolve(config: Config, world_size: int, spec: ModelSpec | None = None,
            model: nn.Module | None = None) -> RunPlan:
    """Validate the whole config for a job of ``world_size`` ranks training ``model``
    with ``spec`` (default: the model ``config.model`` names, built on the meta device
    if a check reads its modules); raises ConfigError (one line: the field, the value,
    the fix)."""
    check_sections(config)
    check_shared_gpu(config, world_size)
    spec = spec or (hf_config_spec(config.model) if is_hf(config.model)
                    else gpt_spec(config.model))
    layout = resolve_layout(config.parallel, world_size)
    check_selected(config, layout)  # the sync mode, dp strategy and optimizer chosen
    check_balance(config, layout)
    check_fault_tolerance(config, layout)
    # replica groups (fault tolerance) each take a share of the global batch too
    shares = data_parallel_degree(config, layout) * replica_groups(config)
    batch = resolve_batch(config.train, config.explicit, shares)
    model_of = ((lambda: model) if model is not None
                else functools.partial(_config_model, config.model))
    check_dimensions(config, layout, spec, batch.grad_accum, model_of)
    check_compile(config, spec)
    check_packing(config, spec, layout)
    return RunPlan(layout=layout, batch=batch, lr=scaled_lr(config.train, batch))


def _config_model(cfg: ModelConfig) -> nn.Module:
    """The model ``cfg`` names, on the meta device (its modules, no memory)."""
    with torch.device("meta"):
        return build_hf_model(cfg) if is_hf(cfg) else GPT(cfg)
