"""LoRA's adapted linear layer: what every part of disttrain knows of an adapter.

A :class:`LoRALinear` takes the place of a linear layer of a model (same attribute, same
path), keeps that layer unchanged as its ``base_layer`` and adds a low-rank update:

    y = base(x) + (alpha / r) * B(A(dropout(x)))

with A [r, in] and B [out, r]; B starts at zero, so the adapted model starts as the base.
Its tensors are named as ``peft`` names them, less peft's ``base_model.model.`` prefix:
``<path>.lora_A.weight``, ``<path>.lora_B.weight``; the base's are
``<path>.base_layer.weight`` (and ``.bias``), which
:func:`~disttrain.param_names.canonical_name` maps back to the plain ``<path>.weight``
that pretrained files, checkpoints and exports use.

This module imports nothing of disttrain: the tensor-parallel plan
(:func:`disttrain.spec.classify_tp_params`), the tensor-parallel layers and the seeded
initialiser (:func:`adapter_init`) read it; :mod:`disttrain.lora` adds adapters to a
model.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

# the adapter factors of a LoRALinear, by attribute (peft's names)
LORA_A, LORA_B = "lora_A", "lora_B"


class AdapterFactor(nn.Linear):
    """A or B of an adapter: a bias-free ``nn.Linear`` that the model's own
    initialisation leaves to :meth:`LoRALinear.reset_adapters` (:func:`adapter_init`)."""


class LoRALinear(nn.Module):
    """``base_layer`` (an ``nn.Linear`` [out, in]; with ``transposed``, a module storing
    its weight [in, out] and computing x @ W + b, as GPT-2's ``Conv1D``) plus the
    adapter: ``lora_A`` weight [r, in], ``lora_B`` weight [out, r], scaled by
    ``alpha / rank``, with ``dropout`` on the adapter's input. Built on the base's device
    (meta too) and dtype; call :meth:`reset_adapters` to give the factors their initial
    values (A uniform as ``nn.Linear``'s own, B zero)."""

    def __init__(self, base: nn.Module, rank: int, alpha: float, dropout: float, *,
                 transposed: bool = False) -> None:
        super().__init__()
        weight = base.weight
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise TypeError(f"LoRA needs a 2-D weight, got a {type(base).__name__}")
        out_features, in_features = weight.shape[::-1] if transposed else weight.shape
        self.base_layer = base
        self.transposed = transposed
        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank
        where = {"device": weight.device, "dtype": weight.dtype}
        self.lora_A = AdapterFactor(int(in_features), rank, bias=False, **where)
        self.lora_B = AdapterFactor(rank, int(out_features), bias=False, **where)
        self.lora_dropout = nn.Dropout(dropout)

    @property
    def weight(self) -> torch.Tensor:
        """The base layer's weight (what code reading ``module.weight`` expects)."""
        weight = self.base_layer.weight
        if not isinstance(weight, torch.Tensor):  # never: checked in __init__
            raise TypeError("the base layer has no weight tensor")
        return weight

    @property
    def bias(self) -> torch.Tensor | None:
        bias = getattr(self.base_layer, "bias", None)
        return bias if isinstance(bias, torch.Tensor) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = self.lora_B(self.lora_A(self.lora_dropout(x)))
        return self.base_layer(x) + update * self.scaling

    def reset_adapters(self) -> None:
        """A as ``nn.Linear`` initialises its weight (kaiming uniform, a = sqrt(5)), B
        zero (the update starts at zero). On a meta tensor nothing is drawn."""
        with torch.no_grad():
            nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
            nn.init.zeros_(self.lora_B.weight)

    def delta(self) -> torch.Tensor:
        """The update as a weight in the base's layout: (alpha / r) B @ A, [out, in]
        ([in, out] when ``transposed``); base weight + delta is the merged layer."""
        update = (self.lora_B.weight @ self.lora_A.weight) * self.scaling
        return update.t() if self.transposed else update

    def extra_repr(self) -> str:
        return f"rank={self.rank}, alpha={self.alpha}, transposed={self.transposed}"


def adapter_init(init_fn: Callable[[nn.Module], None]) -> Callable[[nn.Module], None]:
    """A model's per-module initialisation with adapters: ``init_fn`` on every module
    but the adapter factors, then a :class:`LoRALinear`'s :meth:`~LoRALinear.
    reset_adapters`. Seeded per tensor (:class:`~disttrain.weights.SeededInit`), A's
    values are the first draw after its seed, whatever the model's ``init_fn`` does."""
    def init(module: nn.Module) -> None:
        if isinstance(module, AdapterFactor):
            return
        init_fn(module)
        if isinstance(module, LoRALinear):
            module.reset_adapters()
    return init


def lora_modules(model: nn.Module) -> list[tuple[str, LoRALinear]]:
    """(path, module) of every :class:`LoRALinear` of ``model``, in module order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]
