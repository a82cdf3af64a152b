"""Where a model's values come from when it is built on the meta device.

A model built under ``torch.device("meta")`` has shapes and no storage; the composition
gives storage only to this rank's part (:mod:`.materialize`) and then fills it from a
source of global tensors by name, read piece by piece: the seeded initialiser
(:mod:`.seeded`), or a pretrained directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

from torch import nn

from ..adapters import adapter_init
from ..errors import UserError
from .materialize import allocate, fill_buffers, on_meta
from .pretrained import PretrainedWeights, open_pretrained, read_directory
from .seeded import InitFn, SeededInit, stream_seed, tensor_seed


def model_init_fn(model: nn.Module) -> InitFn | None:
    """The per-module initialisation of a model disttrain knows: the built-in GPT's
    ``init_module``, a transformers model's ``_init_weights``; else None."""
    from ..models.gpt import GPT

    if isinstance(model, GPT):
        return model.init_module
    if type(model).__module__.startswith("transformers.") and hasattr(model, "_init_weights"):
        # PreTrainedModel._init_weights(module): nn.Module types it Tensor | Module
        return cast(InitFn, model._init_weights)
    return None


def initial_weights(model: nn.Module, seed: int, init_fn: InitFn | None = None) -> SeededInit:
    """The seeded initial values of ``model`` (on meta): ``init_fn`` applied per
    module, or the model's own (:func:`model_init_fn`); LoRA adapters by their own
    (:func:`~disttrain.adapters.adapter_init`)."""
    init_fn = init_fn or model_init_fn(model)
    if init_fn is None:
        raise UserError(f"the model ({type(model).__name__}) is on the meta device and "
                        "disttrain does not know how to initialise it (pass init_fn=, a "
                        "function that initialises one module's own tensors in place, or "
                        "pretrained weights)")
    return SeededInit(model, adapter_init(init_fn), seed)


def pretrained_model(directory: str) -> nn.Module:
    """The transformers causal LM of a model directory's ``config.json``, built on the
    meta device (no memory): pass it with ``pretrained=directory`` to the Trainer."""
    import torch
    import transformers as tf

    from ..models.hf import read_hf_config

    config = read_hf_config(str(Path(directory).expanduser() / "config.json"))
    with torch.device("meta"):
        return tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def check_pretrained(directory: str, seq_len: int) -> None:
    """Everything about a pretrained directory that can be refused before any worker
    starts: its config, its files, their names and shapes against the model built from
    that config, and the training context ``seq_len`` against the model's positions."""
    model = pretrained_model(directory)
    limit = getattr(model.config, "max_position_embeddings", None) or getattr(
        model.config, "n_positions", None)
    if isinstance(limit, int) and seq_len > limit:
        raise UserError(f"model.seq_len {seq_len} is longer than the {limit} positions of "
                        f"the model in {directory} (set model.seq_len to at most {limit})")
    open_pretrained(directory, model)


__all__ = ["InitFn", "PretrainedWeights", "SeededInit", "allocate", "check_pretrained",
           "fill_buffers", "initial_weights", "model_init_fn", "on_meta",
           "open_pretrained", "pretrained_model", "read_directory", "stream_seed",
           "tensor_seed"]
