"""A decoder-only transformer described by its dimensions: the planner's shapes and the
one FLOPs formula the models, the metrics and the planner share.

Counts parameters per layer, embedding and head, and the FLOPs of every matmul, for
the GPT-2 family (learned positions, LayerNorm with biases, GELU MLP 4h, tied head), the
Llama family (RMSNorm, no biases, gated SiLU MLP of width ``ffn``, grouped-query
attention with ``kv_heads``, untied head) and disttrain's own GPT (GPT-2-like, no
bias on the fused qkv projection).

Sources: ``--model layers=L,hidden=H,heads=A,seq=S,vocab=V[,ffn=F][,kv_heads=K]...``,
a transformers ``config.json`` (``path.json[,seq=S,...]``), or ``gpt`` for the
``[model]`` of a disttrain config.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .config.schema import ModelConfig
from .errors import UserError


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """Dimensions of a decoder-only transformer. ``ffn`` = 0 means 4 x hidden,
    ``kv_heads`` = 0 means ``heads``; ``gated``: three MLP matrices (gate, up, down);
    ``bias``: linear layers and norms have biases (``qkv_bias`` for the fused q/k/v
    projection); ``positions``: rows of a learned position table (0: rotary);
    ``dropout``: the model trains with dropout (a mask kept per dropout);
    ``flash``: attention saves no s x s scores (fused kernel)."""

    name: str = "model"
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    ffn: int = 0
    kv_heads: int = 0
    gated: bool = False
    bias: bool = True
    qkv_bias: bool = True
    norm: str = "layernorm"  # or rmsnorm
    tied: bool = True
    positions: int = 0
    dropout: bool = False
    flash: bool = True
    notes: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "seq", "vocab"):
            if getattr(self, name) < 1:
                raise UserError(f"model {name}={getattr(self, name)} must be at least 1")
        if self.hidden % self.heads:
            raise UserError(f"model hidden={self.hidden} is not divisible by "
                            f"heads={self.heads}")
        if self.kv_heads and self.heads % self.kv_heads:
            raise UserError(f"model heads={self.heads} is not a multiple of "
                            f"kv_heads={self.kv_heads}")
        if self.norm not in ("layernorm", "rmsnorm"):
            raise UserError(f"model norm={self.norm!r}: use layernorm or rmsnorm")

    @property
    def ffn_width(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def kv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_width(self) -> int:
        return self.kv * self.head_dim

    # parameters ---------------------------------------------------------------

    def matmul_shapes(self) -> list[tuple[str, int, int]]:
        """(name, in, out) of one layer's weight matrices, in forward order."""
        h, f = self.hidden, self.ffn_width
        mlp = ([("gate", h, f), ("up", h, f)] if self.gated else [("up", h, f)])
        return [("qkv", h, h + 2 * self.kv_width), ("out", h, h), *mlp, ("down", f, h)]

    def layer_params(self) -> int:
        """Parameters of one transformer layer."""
        n = sum(i * o for _, i, o in self.matmul_shapes())
        if self.bias:
            n += sum(o for name, _, o in self.matmul_shapes()
                     if name != "qkv" or self.qkv_bias)
        return n + 2 * self.norm_params()

    def norm_params(self) -> int:
        return self.hidden * (2 if self.norm == "layernorm" and self.bias else 1)

    def embedding_params(self) -> int:
        """Token (and learned position) embedding."""
        return (self.vocab + self.positions) * self.hidden

    def head_params(self) -> int:
        """Final norm, and the output projection unless tied to the embedding."""
        return self.norm_params() + (0 if self.tied else self.vocab * self.hidden)

    def num_params(self) -> int:
        return (self.layers * self.layer_params() + self.embedding_params()
                + self.head_params())

    # FLOPs (multiply-adds x 2), forward, per token -------------------------------

    def layer_matmul_flops(self) -> int:
        """Per token: the weight matmuls of one layer."""
        return 2 * sum(i * o for _, i, o in self.matmul_shapes())

    def layer_attention_flops(self) -> int:
        """Per token: scores q.k and the weighted sum of v over the whole context (the
        convention of Megatron-LM and PaLM: causal masking not subtracted)."""
        return 2 * 2 * self.seq * self.hidden

    def head_flops(self) -> int:
        return 2 * self.hidden * self.vocab

    def model_flops_per_token(self) -> int:
        """Forward + backward (3 x forward) per token, no recomputation: the one
        formula of the GPT and the transformers families, which the models' specs, the
        metrics' MFU and the planner all use."""
        return 3 * (self.layers * (self.layer_matmul_flops() + self.layer_attention_flops())
                    + self.head_flops())


def gpt_shape(model: ModelConfig) -> ModelShape:
    """disttrain's GPT(model): tied head, learned positions, no qkv bias."""
    return ModelShape(name="gpt", layers=model.n_layer, hidden=model.d_model,
                      heads=model.n_head, seq=model.seq_len, vocab=model.vocab_size,
                      bias=True, qkv_bias=False, tied=True, positions=model.seq_len,
                      dropout=model.dropout > 0, flash=True)


_KEYS = {"layers": "layers", "hidden": "hidden", "heads": "heads", "seq": "seq",
         "vocab": "vocab", "ffn": "ffn", "kv_heads": "kv_heads"}
_FLAGS = ("gated", "bias", "tied", "dropout", "flash")


def parse_model(text: str, *, gpt: ModelConfig | None = None) -> ModelShape:
    """``--model``: ``gpt``, ``path/config.json[,key=value...]`` or
    ``layers=L,hidden=H,heads=A,seq=S,vocab=V[,ffn=F][,kv_heads=K][,gated=1]...``."""
    head, _, rest = text.partition(",")
    if head.strip() == "gpt":
        return _override(gpt_shape(gpt or ModelConfig()), rest)
    if head.strip().endswith(".json"):
        return _override(hf_shape(Path(head.strip())), rest)
    fields = _pairs(text)
    missing = [k for k in ("layers", "hidden", "heads", "seq", "vocab") if k not in fields]
    if missing:
        raise UserError(f"--model {text!r} lacks {', '.join(missing)}; write "
                        "layers=L,hidden=H,heads=A,seq=S,vocab=V[,ffn=F][,kv_heads=K], a "
                        "config.json, or gpt")
    return _override(ModelShape(name="custom", layers=1, hidden=1, heads=1, seq=1,
                                vocab=1), text)


def _pairs(text: str) -> dict[str, str]:
    out = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, eq, value = item.partition("=")
        if not eq or key not in (*_KEYS, *_FLAGS, "name"):
            raise UserError(f"--model item {item!r}: expected key=value with a key among "
                            f"{', '.join((*_KEYS, *_FLAGS))}")
        out[key] = value
    return out


def _override(shape: ModelShape, text: str) -> ModelShape:
    changes: dict[str, Any] = {}
    for key, value in _pairs(text).items():
        if key == "name":
            changes[key] = value
        elif key in _FLAGS:
            if value not in ("0", "1", "true", "false"):
                raise UserError(f"--model {key}={value!r}: use 0 or 1")
            changes[key] = value in ("1", "true")
        else:
            try:
                changes[_KEYS[key]] = int(value)
            except ValueError:
                raise UserError(f"--model {key}={value!r} is not an integer") from None
    return replace(shape, **changes)


def hf_shape(path: Path) -> ModelShape:
    """A transformers ``config.json`` of the GPT-2 or Llama families (Mistral, Qwen2
    and other Llama-like configs read the same keys). The context is
    ``n_positions`` / ``max_position_embeddings`` unless ``seq=`` overrides it."""
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"--model {path}: cannot read a JSON config ({exc})") from None
    if not isinstance(cfg, dict):
        raise UserError(f"--model {path}: not a JSON object")
    return hf_config_shape(cfg, str(path), path.stem)


def hf_config_shape(cfg: dict[str, Any], where: str = "config",
                    name: str = "model") -> ModelShape:
    """:func:`hf_shape` of a transformers config already read (``config.to_dict()``);
    ``where`` names it in errors."""

    def get(*keys: str, default: Any = None) -> Any:  # a JSON value
        for k in keys:
            if cfg.get(k) is not None:
                return cfg[k]
        if default is None:
            raise UserError(f"--model {where}: no {' / '.join(keys)} in the config")
        return default

    hidden = int(get("n_embd", "hidden_size", "d_model"))
    kind = str(cfg.get("model_type", ""))
    gated = "intermediate_size" in cfg and kind != "gpt2" and "n_inner" not in cfg
    seq = int(get("n_positions", "max_position_embeddings", "n_ctx"))
    if gated:  # Llama family
        return ModelShape(name=kind or name, layers=int(get("num_hidden_layers")),
                          hidden=hidden, heads=int(get("num_attention_heads")), seq=seq,
                          vocab=int(get("vocab_size")), ffn=int(get("intermediate_size")),
                          kv_heads=int(get("num_key_value_heads",
                                           default=get("num_attention_heads"))),
                          gated=True, bias=bool(cfg.get("attention_bias", False)),
                          qkv_bias=bool(cfg.get("attention_bias", False)),
                          norm="rmsnorm", tied=bool(cfg.get("tie_word_embeddings", False)),
                          positions=0, dropout=float(cfg.get("attention_dropout", 0)) > 0)
    dropout = max(float(cfg.get(k, 0) or 0) for k in
                  ("resid_pdrop", "embd_pdrop", "attn_pdrop")) > 0
    return ModelShape(name=kind or name, layers=int(get("n_layer", "num_hidden_layers")),
                      hidden=hidden, heads=int(get("n_head", "num_attention_heads")),
                      seq=seq, vocab=int(get("vocab_size")),
                      ffn=int(cfg.get("n_inner") or 4 * hidden), gated=False, bias=True,
                      qkv_bias=True, norm="layernorm",
                      tied=bool(cfg.get("tie_word_embeddings", True)), positions=seq,
                      dropout=dropout)


def token_part(shape: ModelShape, parts: int) -> ModelShape:
    """``shape`` as one rank holds each sample when its tokens are split over ``parts``
    ranks: ``seq / parts`` positions (the activations, the head and the messages of
    that many; the attention's work: :func:`~.work.layer_work`'s ``token_split``)."""
    return shape if parts == 1 else replace(shape, seq=shape.seq // parts)


def key_value_values(shape: ModelShape, b: int, shards: int) -> float:
    """Values of one layer's keys and values for ``b`` sequences of ``shape.seq`` on
    one of ``shards`` tensor shards: 2 x b x seq x kv width / shards."""
    return 2.0 * b * shape.seq * shape.kv_width / shards


# parameters on one rank ------------------------------------------------------------

@functools.lru_cache(maxsize=65536)
def rank_params(shape: ModelShape, shards: int, layers: int, first: bool, last: bool,
                stages: int) -> float:
    """Parameters one of ``shards`` tensor shards of a stage (of ``stages``) holds: its
    layers, the vocabulary-parallel embedding if first, the final norm and head (or the
    tied copy, with more than one stage) if last."""
    h = shape.hidden
    n = 0.0
    for name, i, o in shape.matmul_shapes():
        n += i * o / shards
        if shape.bias and (name != "qkv" or shape.qkv_bias):
            n += o / shards if name in ("qkv", "gate", "up") else o
    n += 2 * shape.norm_params()
    n *= layers
    if first:
        n += shape.vocab * h / shards + shape.positions * h
    if last:
        n += shape.norm_params()
        if not shape.tied or (stages > 1 and not first):
            n += shape.vocab * h / shards
    return n


def zero_flats(layers: int, first: bool, last: bool) -> int:
    """ZeRO's flat buffers on one rank, each its own collective: two (weights with
    weight decay, and without) per block and for the unit that holds the rest of the
    stage (the embedding, the final norm and head)."""
    return 2 * (layers + int(first or last))


def rank_tensors(shape: ModelShape, layers: int, first: bool, last: bool, stages: int,
                 zero: int) -> int:
    """Parameter tensors the optimizer of one rank walks: each weight, bias and norm
    parameter, or under ZeRO its flat shards (:func:`zero_flats`)."""
    if zero >= 1:
        return zero_flats(layers, first, last)
    linears = shape.matmul_shapes()
    biases = sum(1 for name, _, _ in linears if shape.bias and (name != "qkv"
                                                               or shape.qkv_bias))
    norm = 2 if shape.norm == "layernorm" and shape.bias else 1
    n = layers * (len(linears) + biases + 2 * norm)
    if first:
        n += 1 + int(shape.positions > 0)
    if last:
        n += norm + int(not shape.tied or (stages > 1 and not first))
    return n
