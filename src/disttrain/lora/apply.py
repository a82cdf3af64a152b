"""Adding LoRA adapters to a model: which layers, their initial values, the base frozen.

:func:`add_lora` wraps each targeted linear layer of an unchanged model in a
:class:`~disttrain.adapters.LoRALinear` (on the meta device too: the adapters are then
tensors like any other, filled by the run's source), freezes every other parameter and
gives the adapters their values where the model has values:

- targets: the ``model.lora_targets`` patterns, each matching a module's full name or
  its last part; by default the layers the model's tensor-parallel plan splits into
  columns or rows (the attention and MLP projections). The output head is never
  adapted (the fused loss and the vocabulary-parallel head stand in for it whole).
- values: seeded by name (``tensor_seed(train.seed, "<path>.lora_A.weight")``, A drawn
  first, B zero), so every layout, and a model built on meta and filled by
  :class:`~disttrain.weights.SeededInit` (through
  :func:`~disttrain.adapters.adapter_init`), starts from the same adapters.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase

import torch
from torch import nn

from ..adapters import LORA_A, AdapterFactor, LoRALinear, lora_modules
from ..config.schema import ModelConfig
from ..errors import ConfigError
from ..spec import TP_LINEAR, ModelSpec
from ..weights.seeded import tensor_seed


@dataclass(frozen=True, kw_only=True)
class LoRASettings:
    """The adapters of a run (``model.lora_*``): rank r, alpha (the update is scaled by
    alpha / r), dropout on their input, and the target patterns (empty: the default)."""

    rank: int
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ()


def lora_settings(model: ModelConfig) -> LoRASettings | None:
    """The run's adapters, or None when ``model.lora_rank`` is 0 (every weight trains)."""
    if not model.lora_rank:
        return None
    return LoRASettings(rank=model.lora_rank, alpha=model.lora_alpha,
                        dropout=model.lora_dropout, targets=tuple(model.lora_targets))


def default_targets(spec: ModelSpec) -> tuple[str, ...]:
    """The plan's column- and row-parallel patterns: the attention and MLP projections."""
    plan = spec.tp_plan or {}
    return tuple(p for p, s in plan.items() if s in TP_LINEAR)


def _matches(name: str, pattern: str) -> bool:
    return fnmatchcase(name, pattern) or fnmatchcase(name.rpartition(".")[2], pattern)


def adapted_names(model: nn.Module, settings: LoRASettings, spec: ModelSpec
                  ) -> list[tuple[str, bool]]:
    """(module name, stores its weight [in, out]) of every layer ``settings`` adapt in
    ``model``, checked: each pattern matches a layer, each layer is a linear one (an
    ``nn.Linear``, or a module the spec says stores its weight transposed) and not the
    output head. Raises :class:`~disttrain.errors.ConfigError` naming the field."""
    given = bool(settings.targets)
    patterns = settings.targets or default_targets(spec)
    field = "model.lora_targets"
    if not patterns:
        raise ConfigError(field, settings.targets, "is empty and this model's spec names no "
                          "attention or MLP projections to adapt",
                          'name the linear layers to adapt, e.g. ["q_proj", "v_proj"]')
    found: list[tuple[str, bool]] = []
    used: set[str] = set()
    for name, module in model.named_modules():
        hits = [p for p in patterns if name and _matches(name, p)]
        if not hits or isinstance(module, AdapterFactor):
            continue
        used.update(hits)
        transposed = any(fnmatchcase(name, p) for p in spec.tp_transposed)
        if isinstance(module, LoRALinear):
            raise ConfigError(field, settings.targets, f"module {name!r} already carries "
                              "an adapter", "add adapters once (model.lora_rank, or "
                              "disttrain.lora.add_lora)")
        if name == spec.head:
            raise ConfigError(field, settings.targets, f"matches the output head {name!r}, "
                              "which LoRA does not adapt", "leave it out of the patterns")
        if not (type(module) is nn.Linear or (transposed and _two_d(module))):
            raise ConfigError(field, settings.targets, f"matches {name!r}, a "
                              f"{type(module).__name__}, not a linear layer",
                              "name nn.Linear layers (the attention and MLP projections)")
        found.append((name, transposed))
    unused = [p for p in patterns if p not in used]
    if unused and given:
        raise ConfigError(field, settings.targets, f"pattern {unused[0]!r} matches no "
                          "module of the model", "name modules of the model "
                          "(model.named_modules(): a full name or its last part)")
    return found


def _two_d(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return isinstance(weight, torch.Tensor) and weight.dim() == 2


def add_lora(model: nn.Module, settings: LoRASettings, spec: ModelSpec, seed: int
             ) -> list[str]:
    """Wrap the layers ``settings`` target (:func:`adapted_names`, read with ``spec``,
    the model's spec before any adapter) in place, freeze every other parameter, and,
    unless the model is on meta, give each adapter its seeded values; returns the
    adapted module names."""
    adapted = adapted_names(model, settings, spec)
    for name, transposed in adapted:
        parent, _, leaf = name.rpartition(".")
        holder = model.get_submodule(parent) if parent else model
        base = holder.get_submodule(leaf)
        setattr(holder, leaf, LoRALinear(base, settings.rank, settings.alpha,
                                         settings.dropout, transposed=transposed))
    for p in model.parameters():
        p.requires_grad_(False)
    for name, module in lora_modules(model):
        for factor in (module.lora_A, module.lora_B):
            factor.weight.requires_grad_(True)
        if not module.lora_A.weight.is_meta:
            seed_adapter(module, name, seed)
    return [name for name, _ in adapted]


def seed_adapter(module: LoRALinear, name: str, seed: int) -> None:
    """``module``'s initial adapter, drawn as the seeded initialiser draws it: A first
    after the generator is seeded by its name, B zero (so it does not depend on the
    layout, nor on whether the model was built on meta)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(tensor_seed(seed, f"{name}.{LORA_A}.weight"))
        module.reset_adapters()
