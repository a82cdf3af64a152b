"""A transformers causal LM's spec read from its module structure, never its class
name: the block list, what runs before and after it, the output head the fused loss
stands in for, packed inputs, the tensor-parallel plan (:mod:`.tp_plan`), and the small
twin the checks run on."""

from __future__ import annotations

import dataclasses
import inspect
import sys
from typing import Any

import torch
from torch import nn

from ...names import POSITION_IDS
from ...spec import (
    ModelSpec,
    UnclassifiedParameter,
    block_list,
    classify_tp_params,
    generic_spec,
    register_spec,
)
from .common import as_causal_lm, int_attr
from .tp_plan import tp_layout


def hf_spec(model: nn.Module, *, fields: dict[str, str] | None = None) -> ModelSpec:
    """The spec of a transformers causal LM, from its module structure (see the module
    docstring). ``fields``: the config keys named in tp refusals."""
    lm = as_causal_lm(model)
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
    spec = dataclasses.replace(spec, twin=lambda: small_twin(model), head=head_path,
                               head_refusal=refusal)
    emb_path = names[id(embedding)]
    if emb_path not in before:
        return spec
    hidden = int_attr(embedding, "embedding_dim")
    vocab = int_attr(embedding, "num_embeddings")
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
    tp = tp_layout(model, spec, names.get(id(head)) if head is not None else None,
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
LOGIT_CHANGES = ("final_logit_softcapping", "logit_scale", "logits_scaling",
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
    for key in LOGIT_CHANGES:
        value = getattr(config, key, None)
        if value is not None:
            return None, (f"its config sets {key}={value!r}, which changes the head's "
                          "output into the logits")
    return path, None


# a small model of the same family: these config keys, where present, set small
_SMALL = {"num_hidden_layers": 2, "n_layer": 2, "hidden_size": 32, "n_embd": 32,
          "intermediate_size": 64, "n_inner": 64, "num_attention_heads": 4, "n_head": 4,
          "head_dim": 8, "vocab_size": 64}


def small_twin(model: nn.Module) -> tuple[nn.Module, ModelSpec] | None:
    """A 2-block, 32-wide model of ``model``'s class and forward code (grouped-query
    attention kept as grouped), randomly initialised on the CPU, and its spec; None if
    its config cannot be made small this way."""
    config = as_causal_lm(model).config
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


def _recognise(model: nn.Module) -> ModelSpec | None:
    """A transformers model (only if transformers is already imported: a model of it
    cannot exist otherwise)."""
    transformers = sys.modules.get("transformers")
    if transformers is None or not isinstance(model, transformers.PreTrainedModel):
        return None
    return hf_spec(model)


register_spec(_recognise)
