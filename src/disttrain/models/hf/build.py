"""Transformers causal LMs from ``[model]``: ``model.name = gpt2 | llama`` and
``model.hf_config`` built with random values (nothing downloaded), their config read
as untrusted input, and the spec a config gives before any model exists."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import nn

from ...config.schema import ModelConfig
from ...errors import ConfigError
from ...spec import (
    ModelSpec,
)
from .recognise import hf_spec

# dimension -> the [model] key that sets it, for messages (model.name = gpt2 | llama)
_MODEL_FIELDS = {"heads": "model.n_head", "kv_heads": "model.n_kv_head",
                 "mlp": "model.d_model", "vocab": "model.vocab_size"}


def is_hf(cfg: ModelConfig) -> bool:
    return cfg.name != "gpt" or bool(cfg.hf_config)


# a transformers config.json is a few KiB; anything far larger is not one
MAX_CONFIG_BYTES = 1 << 20


def read_hf_config(path: str) -> Any:
    """The transformers config of the ``config.json`` at ``path`` (``model.hf_config``),
    read as untrusted input: a file that is not a JSON object, names no ``model_type``
    or one this transformers has no causal LM for, or whose values the config class
    rejects, and an encoder (BERT-like: it attends to every position, so trained as a
    causal LM it would see the tokens it predicts) are refused with a
    :class:`~disttrain.errors.ConfigError` naming ``model.hf_config``."""
    import transformers as tf
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    def refuse(problem: str, fix: str = "point it at the config.json of a transformers "
               "causal language model") -> NoReturn:
        raise ConfigError("model.hf_config", path, problem, fix)

    file = Path(path).expanduser()
    try:
        if file.stat().st_size > MAX_CONFIG_BYTES:
            refuse(f"is {file.stat().st_size:,} bytes, not a config.json (at most "
                   f"{MAX_CONFIG_BYTES:,})")
        values = json.loads(file.read_text(encoding="utf-8"))
    except OSError as e:
        refuse(f"cannot be read ({e.strerror})")
    except (UnicodeDecodeError, ValueError) as e:
        refuse(f"is not JSON ({str(e).splitlines()[0]})")
    if not isinstance(values, dict):
        refuse("holds no JSON object")
    kind = values.get("model_type")
    if not isinstance(kind, str) or not kind:
        refuse("has no model_type (a transformers config.json names its family)")
    if kind not in CONFIG_MAPPING:
        refuse(f"names model_type {kind!r}, which transformers {tf.__version__} does not "
               "know")
    if kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        refuse(f"names model_type {kind!r}, which has no causal language model in "
               "transformers")
    try:
        config = CONFIG_MAPPING[kind].from_dict(values)
    except Exception as e:  # noqa: BLE001 - any rejection of the values, said in one line
        refuse(f"holds values its {kind} config rejects: {_first_line(e)}")
    if kind in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False):
        refuse(f"is a {kind} encoder: it attends to every position, so trained as a causal "
               "language model it would see the tokens it predicts",
               "use a decoder-only model's config, or set \"is_decoder\": true if the "
               "model is meant as a decoder")
    return config


def _first_line(e: BaseException) -> str:
    """The exception's message in one line: its first line, and the next ones while a
    line ends with ':' (a heading whose reason follows)."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    said = lines[:1] or [type(e).__name__]
    for line in lines[1:]:
        if not said[-1].endswith(":"):
            break
        said.append(line)
    return " ".join(said)[:300]


def build_hf_model(cfg: ModelConfig) -> nn.Module:
    """The transformers model ``cfg`` names, randomly initialised (torch's seed)."""
    import transformers as tf

    if cfg.hf_config:
        return tf.AutoModelForCausalLM.from_config(read_hf_config(cfg.hf_config),
                                                   dtype=torch.float32)  # fp32 masters
    if cfg.name == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(
            vocab_size=cfg.vocab_size, n_positions=cfg.seq_len, n_embd=cfg.d_model,
            n_layer=cfg.n_layer, n_head=cfg.n_head, resid_pdrop=cfg.dropout,
            embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout, bos_token_id=0,
            eos_token_id=0))
    return tf.LlamaForCausalLM(tf.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
        intermediate_size=4 * cfg.d_model, num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_kv_head or cfg.n_head,
        max_position_embeddings=cfg.seq_len, attention_dropout=cfg.dropout,
        bos_token_id=0, eos_token_id=0))


def hf_config_spec(cfg: ModelConfig) -> ModelSpec:
    """What validation knows of such a model before any worker starts: the spec of the
    model built on the meta device (no memory, no initialisation)."""
    try:
        with torch.device("meta"):
            model = build_hf_model(cfg)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - dimensions the model cannot be built with
        field, value = (("model.hf_config", cfg.hf_config) if cfg.hf_config
                        else ("model", cfg.name))
        raise ConfigError(field, value, f"cannot build this model: {_first_line(e)}",
                          "check its dimensions (sizes positive, heads dividing the "
                          "width)") from None
    fields = (dict.fromkeys(_MODEL_FIELDS, "model.hf_config") if cfg.hf_config
              else _MODEL_FIELDS)
    return hf_spec(model, fields=fields)
