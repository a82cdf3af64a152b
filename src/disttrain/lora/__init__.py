"""LoRA: low-rank adapters trained beside a frozen model, under every layout.

``model.lora_rank = r`` (with ``model.lora_alpha``, ``model.lora_dropout`` and
``model.lora_targets``) makes the Trainer add adapters to the model it is given
(:func:`add_lora`) before anything else touches it; every strategy then sees ordinary
parameters, most of them frozen. The adapted layer itself is
:class:`disttrain.adapters.LoRALinear`; its tensor-parallel split is
:mod:`disttrain.parallel.tensor.lora`; exports to ``peft`` and merged weights are
:mod:`.export`.
"""

from __future__ import annotations

from ..adapters import LoRALinear, lora_modules
from .apply import LoRASettings, adapted_names, add_lora, default_targets, lora_settings

__all__ = ["LoRALinear", "LoRASettings", "adapted_names", "add_lora", "default_targets",
           "lora_modules", "lora_settings"]
