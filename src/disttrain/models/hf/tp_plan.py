"""The tensor-parallel plan of a transformers model's blocks, for the two block shapes
recognised: Llama-like (separate q/k/v/o and gate/up/down projections; grouped-query
heads) and GPT-2-like (a fused ``c_attn`` stored [in, out] by ``Conv1D``, cut per head)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...spec import (
    TP_COLWISE,
    TP_COLWISE_QKV,
    TP_PARTIAL,
    TP_ROWWISE,
    TP_VOCAB,
    TP_VOCAB_HEAD,
    Divisor,
    ModelSpec,
    block_list,
)
from .common import as_causal_lm, int_attr


def tp_layout(model: nn.Module, spec: ModelSpec, head: str | None, embedding: str,
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
    config = as_causal_lm(model).config
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
    vocab = int_attr(model.get_submodule(embedding), "num_embeddings")
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
    head_dim = int_attr(modules[attn_names["q_proj"]], "out_features") // heads
    plan |= {n: TP_PARTIAL for n in _per_head_modules(modules, attn, head_dim)}
    parent = modules[attn] if attn else None
    # older transformers versions reshape by these counts; newer ones by -1
    attrs = [join(attn, a) for a in ("num_heads", "num_key_value_heads", "hidden_size")
             if isinstance(getattr(parent, a, None), int)]
    return plan, [], attrs, int_attr(modules[mlp_names["up_proj"]], "out_features")


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
