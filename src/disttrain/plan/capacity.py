"""Whether a job fits this host, checked by the launcher before any worker starts.

The per-rank memory of training is estimated from the model and the batch alone
(:func:`disttrain.plan.estimate_gpt`'s formulas: pure arithmetic, nothing allocated)
and compared with what one local rank can have: on CPU the host's available memory
(``MemAvailable`` of ``/proc/meminfo``) shared by the local ranks, on CUDA one device's
total memory. The estimate is a lower bound (pipeline and tensor parallelism are
assumed to split everything evenly, a split of each sequence its activations, and
transient buffers are left out), so a refusal
is certain and a job that passes may still be tight. The loss is priced as it will run:
with the fused linear + cross-entropy (``train.fused_loss``) its two gradients and one
chunk's logits, without it the full [tokens, vocabulary] fp32 logits.

Model states are checked before activations: they are a closed formula, while the
activation estimate walks the blocks, so an absurd ``model.n_layer`` is refused before
anything proportional to it is computed.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

from ..config.consistency import RunPlan, on_gpu
from ..config.layout import Layout, resolve_layout
from ..config.schema import Config, ModelConfig
from ..dimensions import Role
from ..errors import ConfigError, UserError
from ..models import num_params
from ..models.hf.recognise import LOGIT_CHANGES
from ..shape import ModelShape, hf_shape
from .memory import gpt_activation_bytes, model_state_bytes

_GIB = 2**30
_MEMINFO = Path("/proc/meminfo")
# The estimator's optimizer families: lars is momentum SGD, lamb keeps AdamW's state.
_SIZE_FIELDS = ("n_layer", "d_model", "vocab_size", "seq_len")
_STATE_KIND = {"adamw": "adamw", "lamb": "adamw", "sgd": "sgd", "lars": "sgd",
               "onebit_adam": "onebit_adam"}


@dataclass(frozen=True, kw_only=True)
class RankMemory:
    """Bytes one local rank may use, and where the figure comes from (for messages)."""

    bytes: int
    source: str


def check_model_fits(config: Config, world_size: int, local_ranks: int,
                     memory: RankMemory | None = None) -> None:
    """Refuse a model whose parameters, gradients and optimizer state alone exceed
    ``memory`` per rank (default: :func:`rank_memory` of this host), naming the model
    size furthest above its default. Needs only the layout, so it runs before
    :func:`disttrain.run_checks.resolve` (whose model spec grows with n_layer)."""
    memory = memory or rank_memory(config, local_ranks)
    layout = resolve_layout(config.parallel, world_size)
    states = _state_bytes(config, layout)
    if states > memory.bytes:
        field, value = _largest_dimension(config)
        _refuse(field, value, states, memory, "model states (parameters, gradients, "
                "optimizer state)", f"lower {field}, or add ranks / parallel.zero")


def check_batch_fits(config: Config, plan: RunPlan, local_ranks: int,
                     memory: RankMemory | None = None) -> None:
    """Refuse a job whose model states plus one micro-batch's activations (``plan``'s
    micro-batch) exceed ``memory`` per rank, naming the batch setting to lower."""
    memory = memory or rank_memory(config, local_ranks)
    t, micro = config.train, plan.batch.micro_batch
    model, fused = _estimated_model(config), _fused_loss(config)
    activations = 0 if model is None else gpt_activation_bytes(
        model, micro_batch=micro, precision="fp32" if t.precision == "fp32" else "bf16",
        activation_checkpointing=t.activation_checkpointing,
        every_k=t.activation_checkpointing_k, fused_loss=fused) // _activation_split(plan.layout)
    need = _state_bytes(config, plan.layout) + activations
    if need > memory.bytes:
        loss = "the fused loss's" if fused else "the full logits'"
        turn_on = "" if fused or t.fused_loss else ", or set train.fused_loss=true"
        _refuse(*_batch_field(config, micro), need, memory, "model states and the "
                f"activations of a micro-batch of {micro} x {config.model.seq_len} tokens "
                f"({loss} included)", "lower train.global_batch or raise train.grad_accum "
                f"(smaller micro-batches), or lower model.seq_len{turn_on}")


def rank_memory(config: Config, local_ranks: int) -> RankMemory:
    """What one of ``local_ranks`` ranks on this host may use: one CUDA device's total
    memory (ranks beyond the device count share), else the host's available memory
    divided among the ranks."""
    import torch

    if on_gpu(config.train) and torch.cuda.is_available():  # else resolve() refuses cuda
        devices = torch.cuda.device_count()
        total = torch.cuda.get_device_properties(0).total_memory
        per = total * min(devices, local_ranks) // local_ranks
        return RankMemory(bytes=per, source=f"the GPU has {total / _GIB:.1f} GiB, "
                          f"{devices} device(s) for {local_ranks} local rank(s)")
    available = host_available_bytes()
    return RankMemory(bytes=available // local_ranks,
                      source=f"this host has {available / _GIB:.1f} GiB available for "
                      f"{local_ranks} local rank(s)")


def host_available_bytes() -> int:
    """``MemAvailable`` of ``/proc/meminfo``; where there is none, physical memory."""
    try:
        for line in _MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _state_bytes(config: Config, layout: Layout) -> int:
    """fp32 model states on one rank, split evenly over the tensor shards and the stages
    (pp x tp: a lower bound), ZeRO over the replicas."""
    t = config.train
    kind = _STATE_KIND.get(t.optimizer, "adamw")
    if config.model.hf_config:
        shape = _hf_shape(config)
        params = 0 if shape is None else shape.num_params()
    else:
        params = num_params(config.model)
    states = model_state_bytes(params, replicas=layout.role(Role.REPLICAS), zero=layout.zero,
                               optimizer=kind, momentum=t.momentum > 0).model_states
    return int(states // _model_split(layout))  # an int already: params is one


def _model_split(layout: Layout) -> int:
    """Ranks one replica's parameters (and, evenly, its activations) are split over:
    the tensor shards times the stages."""
    return layout.role(Role.TENSORS) * layout.role(Role.LAYERS)


def _activation_split(layout: Layout) -> int:
    """Ranks one micro-batch's activations are split over (evenly: a lower bound): the
    replica's parameter split, times the ranks each sample's tokens are split over."""
    return _model_split(layout) * layout.role(Role.TOKENS)


def _hf_shape(config: Config) -> ModelShape | None:
    """The dimensions of ``model.hf_config`` (GPT-2 and Llama families); None for a
    config the estimator cannot read (the transformers model is then not estimated)."""
    try:
        return hf_shape(Path(config.model.hf_config))
    except (UserError, ValueError, TypeError):
        return None


def _estimated_model(config: Config) -> ModelConfig | None:
    """The [model] section the activation estimate walks: a transformers config's
    dimensions at ``model.seq_len`` (its gated MLP counted as a plain one: a lower
    bound), or None when there is none to read."""
    if not config.model.hf_config:
        return config.model
    shape = _hf_shape(config)
    if shape is None:
        return None
    return replace(config.model, n_layer=shape.layers, d_model=shape.hidden,
                   n_head=shape.heads, vocab_size=shape.vocab)


def _fused_loss(config: Config) -> bool:
    """Whether the loss will be the fused linear + cross-entropy, as far as the config
    tells before a model exists: ``train.fused_loss``, and a transformers config that
    sets none of the keys that change the head's output into the logits
    (:data:`~disttrain.models.hf.recognise.LOGIT_CHANGES`). A forward found changing
    them only when run (a family checked by its probe) is priced fused."""
    if not config.train.fused_loss:
        return False
    if not config.model.hf_config:
        return True
    try:
        keys = json.loads(Path(config.model.hf_config).read_text())
    except (OSError, ValueError):
        return True  # unreadable: _hf_shape gives None and no activations are priced
    return not (isinstance(keys, dict) and any(keys.get(k) is not None
                                                for k in LOGIT_CHANGES))


def _largest_dimension(config: Config) -> tuple[str, int | str]:
    """The model size furthest above its default (the one to lower); for a
    transformers model, its config."""
    if config.model.hf_config:
        return "model.hf_config", config.model.hf_config
    defaults = ModelConfig()
    name = max(_SIZE_FIELDS, key=lambda f: getattr(config.model, f) / getattr(defaults, f))
    return f"model.{name}", getattr(config.model, name)


def _batch_field(config: Config, micro_batch: int) -> tuple[str, int | None]:
    """The batch member the user set that sets the micro-batch size."""
    if "train.micro_batch" in config.explicit:
        return "train.micro_batch", micro_batch
    return "train.global_batch", config.train.global_batch


def _refuse(field: str, value: object, need: int, memory: RankMemory, what: str,
            fix: str) -> None:
    raise ConfigError(field, value, f"needs ~{_gib(need)} GiB per rank for {what}, "
                      f"more than the {_gib(memory.bytes)} GiB a rank can have "
                      f"({memory.source})", fix)


def _gib(n: int) -> str:
    gib = n / _GIB
    return f"{gib:,.1f}" if gib < 1e6 else f"{gib:.2e}"
