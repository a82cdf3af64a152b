"""Hugging Face ``transformers`` causal-LM models: built from ``[model]`` (random init,
nothing downloaded) for the command line's ``model.name = gpt2 | llama`` and
``model.hf_config``, and recognised (any of them, however built) by their module
structure, so every strategy applies to them. ``transformers`` is imported only when
one is built (the ``hf`` extra); validation refuses these settings without it.

:func:`hf_spec` reads a model's structure, never its class name:

- the block list is the model's first ``nn.ModuleList``; what its parent registers
  before it (embeddings, their dropout) runs before the blocks, what comes after it
  (final norm) and the output head after them; modules without parameters (a rotary
  embedding) stay with every stage. A pipeline runs the model's own forward on each
  stage (see :class:`~disttrain.parallel.pipeline.PipelineChunk`), checked once
  against the whole model;
- a tensor-parallel plan when the blocks have one of two known shapes: separate
  ``q_proj / k_proj / v_proj / o_proj`` and ``gate_proj / up_proj / down_proj`` (or
  ``up_proj / down_proj``) linear layers, as in the Llama family (Mistral, Qwen2, ...;
  grouped-query attention: tp must divide the key/value heads), or a fused ``c_attn``
  with ``c_proj``, ``c_fc`` / ``c_proj`` stored as [in, out] (GPT-2's ``Conv1D``), cut
  per head. The token embedding and the output head are sharded over the vocabulary
  and the loss is computed on the shards. Sequence parallelism does not apply (their
  forward reshapes activations by the full sequence length);
- the output head (``get_output_embeddings()``, tied or not) when it is an
  ``nn.Linear`` and the config does not change its output before it is returned as the
  logits (Gemma 2's soft cap, Cohere's scale): the fused linear + cross-entropy stands
  in for it (:mod:`disttrain.parallel.fused_loss`, which also runs the forward once to
  check that nothing else does);
- packed examples (``data.packing``) through ``position_ids`` alone, restarting at each
  example: transformers' padding-free path, whose mask functions keep attention inside
  each (checked by running the model's twin, :mod:`disttrain.data.packing_check`).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import sys
from pathlib import Path
from typing import Any, NoReturn, Protocol, cast

import torch
from torch import nn

from ..config.schema import ModelConfig
from ..errors import ConfigError
from ..names import POSITION_IDS
from ..spec import (
    TP_COLWISE,
    TP_COLWISE_QKV,
    TP_PARTIAL,
    TP_ROWWISE,
    TP_VOCAB,
    TP_VOCAB_HEAD,
    Divisor,
    ModelSpec,
    UnclassifiedParameter,
    block_list,
    classify_tp_params,
    generic_spec,
    register_spec,
)

# dimension -> the [model] key that sets it, for messages (model.name = gpt2 | llama)
_MODEL_FIELDS = {"heads": "model.n_head", "kv_heads": "model.n_kv_head",
                 "mlp": "model.d_model", "vocab": "model.vocab_size"}


class _CausalLM(Protocol):
    """What this module reads of a transformers ``PreTrainedModel`` beyond nn.Module."""

    config: Any  # a transformers PretrainedConfig

    def get_input_embeddings(self) -> nn.Module: ...

    def get_output_embeddings(self) -> nn.Module | None: ...


def _lm(model: nn.Module) -> _CausalLM:
    """``model``, a transformers model, as one (nn.Module types the attributes a
    subclass adds as Tensor | Module)."""
    return cast(_CausalLM, model)


def _int_attr(m: nn.Module, name: str) -> int:
    """``int(m.<name>)`` for a plain int attribute of a module (``out_features``,
    ``num_embeddings``), which nn.Module's typing gives as Tensor | Module."""
    return int(getattr(m, name))


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


def matmul_flops_per_token(model: nn.Module, seq_len: int, n_layer: int,
                           d_model: int) -> int:
    """Training FLOPs per token from the model's shapes: 6 per weight of every matrix
    that multiplies activations (embedding lookups excluded, a tied output head counted)
    plus attention's scores and weighted sum, 12 T d per layer (forward and backward)."""
    matmul = sum(p.numel() for m in model.modules() if not isinstance(m, nn.Embedding)
                 for p in m.parameters(recurse=False) if p.dim() == 2)
    return int(6 * matmul + 12 * n_layer * seq_len * d_model)


def hf_flops_per_token(model: nn.Module, seq_len: int) -> int | None:
    """:func:`matmul_flops_per_token` of a transformers model at ``seq_len`` (its layers
    and width from its config); None for any other model."""
    config = getattr(model, "config", None)
    if not type(model).__module__.startswith("transformers.") or config is None:
        return None
    try:
        return matmul_flops_per_token(model, seq_len, int(config.num_hidden_layers),
                                      int(config.hidden_size))
    except (AttributeError, TypeError, ValueError):
        return None


def hf_dimensions(model: nn.Module, cfg: ModelConfig) -> tuple[int, int, int]:
    """(seq_len, n_layer, d_model) of a built model: from ``[model]``, or from the
    transformers config when ``model.hf_config`` chose it."""
    if not cfg.hf_config:
        return cfg.seq_len, cfg.n_layer, cfg.d_model
    c = _lm(model).config
    return cfg.seq_len, int(c.num_hidden_layers), int(c.hidden_size)


def hf_spec(model: nn.Module, *, fields: dict[str, str] | None = None) -> ModelSpec:
    """The spec of a transformers causal LM, from its module structure (see the module
    docstring). ``fields``: the config keys named in tp refusals."""
    lm = _lm(model)
    spec = dataclasses.replace(generic_spec(model),
                               config_json=lm.config.to_json_string(),
                               call_kwargs=_no_cache(model), **_packing_fields(model))
    path, blocks = spec.blocks, block_list(model, spec)
    if path is None or blocks is None:
        return spec
    names = {id(m): n for n, m in model.named_modules()}
    embedding = lm.get_input_embeddings()
    head = lm.get_output_embeddings()
    if id(embedding) not in names or (head is not None and id(head) not in names):
        return spec
    before, after = _around_blocks(model, path)
    head_path, refusal = _head_fields(lm.config, head, names)
    spec = dataclasses.replace(spec, twin=lambda: _small_twin(model), head=head_path,
                               head_refusal=refusal)
    emb_path = names[id(embedding)]
    if emb_path not in before:
        return spec
    hidden = _int_attr(embedding, "embedding_dim")
    vocab = _int_attr(embedding, "num_embeddings")
    seq = int(getattr(lm.config, "max_position_embeddings", 0) or 0)
    block_costs = tuple(float(2 * _matmul_params(b) + 4 * seq * hidden) for b in blocks)
    spec = dataclasses.replace(
        spec, before=before, after=after, inject=emb_path, hidden_size=hidden,
        tied=_tied(model, before, after),
        probe={"input_ids": (torch.arange(8) % vocab).unsqueeze(0),
               **(spec.call_kwargs or {})},
        embedding_cost=float(hidden), block_costs=block_costs,
        head_cost=float(2 * hidden * vocab + 5 * vocab))
    if not _covers(model, spec):
        spec = dataclasses.replace(spec, inject=None)  # parameters outside the cut
    tp = _tp_layout(model, spec, names.get(id(head)) if head is not None else None,
                    emb_path, fields or {})
    if not tp:
        return spec
    try:
        classify_tp_params(model, tp["tp_plan"])
    except UnclassifiedParameter as e:  # validation refuses parallel.tp > 1 with it
        tp["tp_refusal"] = str(e)
    return dataclasses.replace(spec, **tp)


# transformers config keys whose models change the head's output before returning it as
# the logits (Gemma 2/3's soft cap, Cohere's and Granite's scales, Falcon-H1's
# multiplier); the fused loss computes the head's output, so it stays off for them.
# Other families' forwards are checked by running them (fused_loss.head_refusal).
_LOGIT_CHANGES = ("final_logit_softcapping", "logit_scale", "logits_scaling",
                  "lm_head_multiplier")


def _head_fields(config: Any, head: nn.Module | None, names: dict[int, str]
                 ) -> tuple[str | None, str | None]:
    """(the output head's path, None) when it is an ``nn.Linear`` whose output the
    config does not change, else (None, why not); (None, None) without a head."""
    if head is None:
        return None, None
    path = names[id(head)]
    if type(head) is not nn.Linear:
        return None, f"its output head {path!r} is a {type(head).__name__}, not an nn.Linear"
    for key in _LOGIT_CHANGES:
        value = getattr(config, key, None)
        if value is not None:
            return None, (f"its config sets {key}={value!r}, which changes the head's "
                          "output into the logits")
    return path, None


# a small model of the same family: these config keys, where present, set small
_SMALL = {"num_hidden_layers": 2, "n_layer": 2, "hidden_size": 32, "n_embd": 32,
          "intermediate_size": 64, "n_inner": 64, "num_attention_heads": 4, "n_head": 4,
          "head_dim": 8, "vocab_size": 64}


def _small_twin(model: nn.Module) -> tuple[nn.Module, ModelSpec] | None:
    """A 2-block, 32-wide model of ``model``'s class and forward code (grouped-query
    attention kept as grouped), randomly initialised on the CPU, and its spec; None if
    its config cannot be made small this way."""
    config = _lm(model).config
    values = config.to_dict()
    grouped = values.get("num_key_value_heads") not in (None, values.get(
        "num_attention_heads"))
    values.update({k: v for k, v in _SMALL.items() if k in values})
    if "num_key_value_heads" in values:
        values["num_key_value_heads"] = 2 if grouped else 4
    values.pop("dtype", None)
    values.pop("torch_dtype", None)
    if isinstance(values.get("layer_types"), list):
        values["layer_types"] = values["layer_types"][:2]
    try:
        with torch.random.fork_rng(devices=[]), torch.device("cpu"):
            torch.manual_seed(0)
            twin = type(model)(type(config).from_dict(values))
    except Exception:  # noqa: BLE001 - a family whose config does not shrink so
        return None
    return twin, hf_spec(twin)


def _no_cache(model: nn.Module) -> dict[str, Any]:
    """``use_cache=False`` for a model whose forward takes it: training builds no
    key/value cache (which recomputation would otherwise write twice)."""
    params = inspect.signature(model.forward).parameters
    return {"use_cache": False} if "use_cache" in params else {}


def _packing_fields(model: nn.Module) -> dict[str, Any]:
    """How the model takes packed examples: transformers' padding-free path, where
    ``position_ids`` restarting at 0 mark where each example begins and the model's
    mask functions keep attention inside each (its flash-attention path runs them as
    variable-length sequences). Whether this model's forward really does is checked by
    running its twin (:mod:`disttrain.data.packing_check`)."""
    if POSITION_IDS not in inspect.signature(model.forward).parameters:
        return {"packing_refusal": f"{type(model).__name__}'s forward takes no "
                                   f"{POSITION_IDS}"}
    return {"packed_inputs": (POSITION_IDS,)}


def _around_blocks(model: nn.Module, blocks: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Modules run before / after the block list: the children of each container on
    the path to it, split by whether they are registered before or after that path;
    modules without parameters other than dropout are left out (they stay, shared, on
    every stage)."""
    before: list[str] = []
    after: list[str] = []
    parts = blocks.split(".")
    for depth in range(len(parts)):
        prefix = ".".join(parts[:depth])
        node = model.get_submodule(prefix)
        on_path, seen = parts[depth], False
        for name, child in node.named_children():
            if name == on_path:
                seen = True
                continue
            if not _has_params(child) and not isinstance(child, nn.Dropout):
                continue
            path = f"{prefix}.{name}" if prefix else name
            (after if seen else before).append(path)
    # outer containers' "before" come first, their "after" last
    inner_first = sorted(after, key=lambda p: -p.count("."))
    return tuple(sorted(before, key=lambda p: p.count("."))), tuple(inner_first)


def _has_params(m: nn.Module) -> bool:
    return any(True for _ in m.parameters())


def _matmul_params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters() if p.dim() == 2)


def _tied(model: nn.Module, before: tuple[str, ...], after: tuple[str, ...]
          ) -> tuple[tuple[str, str], ...]:
    """(owner, copy) names of parameters shared by a module before the blocks and one
    after them (an output head tied to the token embedding)."""
    first: dict[int, str] = {}
    for path in before:
        for n, p in model.get_submodule(path).named_parameters():
            first.setdefault(id(p), f"{path}.{n}")
    pairs = []
    for path in after:
        for n, p in model.get_submodule(path).named_parameters(remove_duplicate=False):
            if id(p) in first:
                pairs.append((first[id(p)], f"{path}.{n}"))
    return tuple(pairs)


def _covers(model: nn.Module, spec: ModelSpec) -> bool:
    """Every parameter lies in the blocks or in a module before / after them."""
    blocks = block_list(model, spec)
    parts = [model.get_submodule(path) for path in (*spec.before, *spec.after)]
    held = {id(p) for part in (*parts, *([blocks] if blocks is not None else []))
            for p in part.parameters()}
    return all(id(p) in held for p in model.parameters())


def _tp_layout(model: nn.Module, spec: ModelSpec, head: str | None, embedding: str,
               fields: dict[str, str]) -> dict[str, Any] | None:
    """The plan, divisors and head attributes for a Llama-like or GPT-2-like block
    structure (None for any other)."""
    block_modules = block_list(model, spec)
    if block_modules is None:
        return None
    blocks = list(block_modules)
    first = {n: m for n, m in blocks[0].named_modules()}
    if any({n for n, _ in b.named_modules()} != set(first) for b in blocks[1:]):
        return None
    config = _lm(model).config
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    kv_heads = int(getattr(config, "num_key_value_heads", 0) or heads)
    if heads <= 0:
        return None
    layout = _llama_like(first, heads) or _gpt2_like(first, heads)
    if layout is None:
        return None
    plan, transposed, attrs, mlp_width = layout
    prefix = f"{spec.blocks}.*."
    full_plan = {embedding: TP_VOCAB, **{prefix + n: s for n, s in plan.items()}}
    if head is not None:
        full_plan[head] = TP_VOCAB_HEAD
    vocab = _int_attr(model.get_submodule(embedding), "num_embeddings")
    divisors = [Divisor(fields.get("heads", "num_attention_heads"), heads, heads,
                        "attention heads"),
                Divisor(fields.get("mlp", "intermediate_size"), mlp_width, mlp_width,
                        "MLP width"),
                Divisor(fields.get("vocab", "vocab_size"), vocab, vocab, "vocabulary rows")]
    if kv_heads != heads:
        divisors.insert(1, Divisor(fields.get("kv_heads", "num_key_value_heads"),
                                   kv_heads, kv_heads, "key/value heads"))
    return {"tp_plan": full_plan, "tp_divisors": tuple(divisors),
            "tp_transposed": tuple(prefix + n for n in transposed),
            "tp_head_attrs": tuple(prefix + a for a in attrs)}


def _linear(m: nn.Module | None) -> bool:
    return isinstance(m, nn.Linear)


def _sibling(modules: dict[str, nn.Module], suffix: str) -> list[str]:
    return [n for n in modules if n.rpartition(".")[2] == suffix]


def _llama_like(modules: dict[str, nn.Module], heads: int
                ) -> tuple[dict[str, str], list[str], list[str], int] | None:
    """q/k/v/o projections under one parent, gate/up/down (or up/down) under another,
    all ``nn.Linear``."""
    q = _sibling(modules, "q_proj")
    up = _sibling(modules, "up_proj")
    if len(q) != 1 or len(up) != 1:
        return None
    attn, mlp = q[0].rpartition(".")[0], up[0].rpartition(".")[0]
    def join(parent: str, leaf: str) -> str:
        return f"{parent}.{leaf}" if parent else leaf

    attn_names = {s: join(attn, s) for s in ("q_proj", "k_proj", "v_proj", "o_proj")}
    mlp_names = {s: join(mlp, s) for s in ("gate_proj", "up_proj", "down_proj")}
    if not all(_linear(modules.get(n)) for n in attn_names.values()):
        return None
    if not (_linear(modules.get(mlp_names["up_proj"]))
            and _linear(modules.get(mlp_names["down_proj"]))):
        return None
    plan = {attn_names["q_proj"]: TP_COLWISE, attn_names["k_proj"]: TP_COLWISE,
            attn_names["v_proj"]: TP_COLWISE, attn_names["o_proj"]: TP_ROWWISE,
            mlp_names["up_proj"]: TP_COLWISE, mlp_names["down_proj"]: TP_ROWWISE}
    if mlp_names["gate_proj"] in modules:
        if not _linear(modules[mlp_names["gate_proj"]]):
            return None
        plan[mlp_names["gate_proj"]] = TP_COLWISE
    head_dim = _int_attr(modules[attn_names["q_proj"]], "out_features") // heads
    plan |= {n: TP_PARTIAL for n in _per_head_modules(modules, attn, head_dim)}
    parent = modules[attn] if attn else None
    # older transformers versions reshape by these counts; newer ones by -1
    attrs = [join(attn, a) for a in ("num_heads", "num_key_value_heads", "hidden_size")
             if isinstance(getattr(parent, a, None), int)]
    return plan, [], attrs, _int_attr(modules[mlp_names["up_proj"]], "out_features")


def _per_head_modules(modules: dict[str, nn.Module], attn: str, head_dim: int) -> list[str]:
    """Modules inside the attention other than its projections whose every parameter
    has ``head_dim`` values: per-head norms (Qwen3's ``q_norm`` / ``k_norm``),
    which act on each head alone, so each tp rank's gradient is a partial sum. Anything
    else inside the attention is left for the plan's classification to refuse."""
    out = []
    for name, m in modules.items():
        if not (name.startswith(attn + ".") if attn else name) or name.endswith("_proj"):
            continue
        own = list(m.parameters(recurse=False))
        if own and all(p.numel() == head_dim for p in own) and not any(
                n.startswith(name + ".") for n in modules if n != name):
            out.append(name)
    return out


def _gpt2_like(modules: dict[str, nn.Module], heads: int
               ) -> tuple[dict[str, str], list[str], list[str], int] | None:
    """A fused ``c_attn`` (q | k | v) and ``c_proj`` under one parent, ``c_fc`` and
    ``c_proj`` under another; weights [in, out] (or [out, in] when ``nn.Linear``)."""
    qkv = _sibling(modules, "c_attn")
    fc = _sibling(modules, "c_fc")
    if len(qkv) != 1 or len(fc) != 1:
        return None
    attn, mlp = qkv[0].rpartition(".")[0], fc[0].rpartition(".")[0]
    names = [qkv[0], f"{attn}.c_proj", fc[0], f"{mlp}.c_proj"]
    mods = [modules.get(n) for n in names]
    weights = [w for w in (getattr(m, "weight", None) for m in mods)
               if isinstance(w, torch.Tensor) and w.dim() == 2]
    if len(weights) != len(mods):
        return None
    linear = [_linear(m) for m in mods]
    if any(linear) and not all(linear):
        return None
    transposed = [] if all(linear) else names
    out_dim = 0 if all(linear) else 1
    width = int(weights[0].shape[1 - out_dim])
    if int(weights[0].shape[out_dim]) != 3 * width:
        return None
    parent = modules[attn]
    attrs = [f"{attn}.{a}" for a in ("num_heads", "split_size")
             if isinstance(getattr(parent, a, None), int)]
    if not any(a.endswith("split_size") for a in attrs):
        return None  # nothing says how the fused output splits into q, k, v
    plan = {names[0]: TP_COLWISE_QKV, names[1]: TP_ROWWISE, names[2]: TP_COLWISE,
            names[3]: TP_ROWWISE}
    return plan, transposed, attrs, int(weights[2].shape[out_dim])


def _recognise(model: nn.Module) -> ModelSpec | None:
    """A transformers model (only if transformers is already imported: a model of it
    cannot exist otherwise)."""
    transformers = sys.modules.get("transformers")
    if transformers is None or not isinstance(model, transformers.PreTrainedModel):
        return None
    return hf_spec(model)


register_spec(_recognise)

__all__ = ["build_hf_model", "hf_config_spec", "hf_dimensions", "hf_spec", "is_hf",
           "matmul_flops_per_token"]
