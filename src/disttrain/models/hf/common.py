"""What the transformers-model modules read of a ``PreTrainedModel``, typed."""

from __future__ import annotations

from typing import Any, Protocol, cast

from torch import nn


class CausalLM(Protocol):
    """What this module reads of a transformers ``PreTrainedModel`` beyond nn.Module."""

    config: Any  # a transformers PretrainedConfig

    def get_input_embeddings(self) -> nn.Module: ...

    def get_output_embeddings(self) -> nn.Module | None: ...


def as_causal_lm(model: nn.Module) -> CausalLM:
    """``model``, a transformers model, as one (nn.Module types the attributes a
    subclass adds as Tensor | Module)."""
    return cast(CausalLM, model)


def int_attr(m: nn.Module, name: str) -> int:
    """``int(m.<name>)`` for a plain int attribute of a module (``out_features``,
    ``num_embeddings``), which nn.Module's typing gives as Tensor | Module."""
    return int(getattr(m, name))
