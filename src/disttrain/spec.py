"""What the parallel strategies need to know about a model, handed to them as data.

This module sits below both :mod:`disttrain.models` (which ship specs) and
:mod:`disttrain.parallel` (which read them), and imports neither.

A :class:`ModelSpec` describes an unchanged ``nn.Module``: where its repeated blocks
are, what runs before and after them (so a pipeline can cut it), how to split its
matrices over tensor-parallel ranks (a plan: module-name pattern -> style), which
weights are tied, what limits the tensor-parallel degree, and the relative cost of
each piece. The strategies in :mod:`disttrain.parallel` read only this; nothing there
knows a model class. The built-in GPT ships its spec (:func:`disttrain.models.gpt.gpt_spec`);
:func:`spec_for` recognises it, and any other model gets :func:`generic_spec`
(its first ``nn.ModuleList`` as the blocks, no plan, no pipeline cut).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import nn

from .adapters import LORA_A, LORA_B, LoRALinear
from .param_names import ADAPTED, canonical_name

# (module holding the named submodules, its input) -> its output
Piece = Callable[[nn.Module, torch.Tensor], torch.Tensor]
# (module holding the embeddings, token ids, **the spec's embed_inputs by name) -> hidden
EmbedPiece = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class Divisor:
    """A model dimension that the tensor-parallel degree must divide.

    ``field`` / ``value``: the config key and its value, for the error message;
    ``split``: the size that is cut into tp shards (e.g. 4 x d_model for the MLP)."""

    field: str
    value: int
    split: int
    what: str


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A model's structure as the strategies see it.

    ``blocks``: dotted path of the ``nn.ModuleList`` of repeated blocks (None: no
    block list). ``before`` / ``after``: dotted paths of the modules the forward pass
    runs before the blocks (embeddings) and after them (final norm, head); with
    ``embed`` and ``finish`` they let a pipeline cut the model: ``embed(m, inputs)``
    and ``finish(m, hidden)`` are called on a module that holds those submodules under
    the same paths. Without ``embed`` / ``finish``, a pipeline runs the model's own
    forward on each stage with stand-ins (see :mod:`disttrain.parallel.pipeline.chunks`):
    ``inject`` names the ``before`` module whose output is the first hidden state
    (later stages substitute the activation they receive for it), and ``probe`` holds
    example keyword inputs used to check, once, that such a cut computes what the whole
    model computes. ``hidden_size``: the last dimension of the activations between
    blocks. ``tied``: (owner, copy) parameter names of tied weights.
    ``tp_plan``: module-name pattern -> tensor-parallel style. ``tp_divisors``: the
    dimensions tp must divide. ``tp_head_attrs``: ``"module-pattern.attribute"``
    entries naming integer attributes of attention modules that count heads or their
    total width (each tp rank then holds 1/tp of them). ``tp_transposed``: module-name
    patterns of modules that store their weight as [in, out] and compute x @ W + b
    (GPT-2's ``Conv1D``); their shards keep that layout. ``embedding_cost`` /
    ``block_costs`` / ``head_cost``: relative forward cost per token of each piece (any
    unit), for balanced pipeline cuts. ``flops_per_token``: training FLOPs per token
    (None: counted at run time). ``sequence_divisor``: the dimension sequence
    parallelism splits. ``config_json``: the model's own configuration (a transformers
    ``config.json``), kept in the run directory so the weights can be exported in the
    model's own format.
    ``tp_refusal``: why this model's structure cannot run under its tp plan (a
    parameter the plan cannot classify, see :func:`classify_tp_params`), found when the
    spec was read off the model; validation refuses ``parallel.tp > 1`` with it.
    ``twin``: builds a small model of the same class and forward code, with values,
    and its spec: checks that must run the model (the pipeline cut) run on it when the
    model itself is on the meta device (None, or a builder returning None: such checks
    refuse a meta model).
    ``head``: dotted path of the output head, an ``nn.Linear`` [V, d] whose output is
    the model's logits with nothing applied to them after it (a scale or a soft cap
    would be): the fused linear + cross-entropy stands in for it
    (:mod:`disttrain.parallel.fused_loss`; with a ``probe``, the forward is checked
    once for that). None: no such head, the loss takes the full logits;
    ``head_refusal`` then says why, where the model has a head (its config scales its
    logits).
    ``embed_inputs`` / ``block_inputs``: the micro-batch's keyword inputs a pipeline
    chunk cut by ``embed`` / ``finish`` hands on by name, to ``embed(m, ids, **those)``
    and to every block as ``block(x, **those)`` (the GPT: ``position_ids`` to the
    embedding, ``document_ids`` to the blocks); any other keyword input is refused.
    ``packed_inputs``: the keyword inputs, beside ``input_ids``, through which the model
    takes rows of packed examples (:mod:`disttrain.data.packing`: ``position_ids``
    restarting per example, ``document_ids`` numbering them) with attention kept inside
    each example; empty: ``data.packing`` is refused, with ``packing_refusal`` saying why.
    A spec with a ``twin`` has its claim checked by running the twin on a probe.
    """

    blocks: str | None
    before: tuple[str, ...] = ()
    after: tuple[str, ...] = ()
    embed: EmbedPiece | None = None
    finish: Piece | None = None
    inject: str | None = None
    probe: Mapping[str, Any] | None = None
    call_kwargs: Mapping[str, Any] | None = None
    hidden_size: int = 0
    tied: tuple[tuple[str, str], ...] = ()
    tp_plan: Mapping[str, str] | None = None
    tp_divisors: tuple[Divisor, ...] = ()
    tp_head_attrs: tuple[str, ...] = ()
    tp_transposed: tuple[str, ...] = ()
    embedding_cost: float = 0.0
    block_costs: tuple[float, ...] = ()
    head_cost: float = 0.0
    flops_per_token: int | None = None
    sequence_divisor: Divisor | None = None
    config_json: str | None = None
    tp_refusal: str | None = None
    twin: Callable[[], tuple[nn.Module, ModelSpec] | None] | None = None
    head: str | None = None
    head_refusal: str | None = None
    embed_inputs: tuple[str, ...] = ()
    block_inputs: tuple[str, ...] = ()
    packed_inputs: tuple[str, ...] = ()
    packing_refusal: str | None = None

    @property
    def can_pipeline(self) -> bool:
        """Whether the spec says enough to cut the model into pipeline stages (a block
        list, the pieces around it, a hidden size)."""
        pieces = (self.embed is not None and self.finish is not None) or self.inject
        return self.blocks is not None and bool(pieces) and self.hidden_size > 0

    @property
    def n_blocks(self) -> int:
        """The number of blocks in the block list."""
        return len(self.block_costs)


def block_list(model: nn.Module, spec: ModelSpec) -> nn.ModuleList | None:
    """The model's block list named by ``spec`` (None when it has none)."""
    if spec.blocks is None:
        return None
    blocks = model.get_submodule(spec.blocks)
    if not isinstance(blocks, nn.ModuleList):
        raise TypeError(f"spec.blocks={spec.blocks!r} is a {type(blocks).__name__}, "
                        "not an nn.ModuleList")
    return blocks


def generic_spec(model: nn.Module) -> ModelSpec:
    """Any model: its first ``nn.ModuleList`` is the block list (for ZeRO's units and
    activation checkpointing); no tensor plan and no pipeline cut."""
    name = next((n for n, m in model.named_modules() if isinstance(m, nn.ModuleList)),
                None)
    blocks = model.get_submodule(name) if name is not None else None
    n_blocks = len(blocks) if isinstance(blocks, nn.ModuleList) else 0
    return ModelSpec(blocks=name, block_costs=(1.0,) * n_blocks)


def output_logits(outputs: Any) -> torch.Tensor:
    """The logits in a model's output: the tensor itself, the first of a tuple, or the
    ``logits`` entry of a mapping (a Hugging Face model output is one)."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    if isinstance(outputs, Mapping):
        return outputs["logits"]
    if isinstance(outputs, (tuple, list)):
        return outputs[0]
    raise TypeError(f"cannot find logits in a {type(outputs).__name__}; return a tensor, "
                    "a tuple, or an object with 'logits', or pass loss_fn")


def with_logits(outputs: Any, logits: torch.Tensor) -> Any:
    """``outputs`` with its logits (as :func:`output_logits` finds them) replaced by
    ``logits``; the rest of a tuple or mapping kept."""
    if isinstance(outputs, torch.Tensor):
        return logits
    if isinstance(outputs, Mapping):
        fields = {**outputs, "logits": logits}
        try:
            return type(outputs)(**fields)  # a model output class keeps its type
        except TypeError:
            return fields
    if isinstance(outputs, (tuple, list)):
        return type(outputs)([logits, *outputs[1:]])
    raise TypeError(f"cannot find logits in a {type(outputs).__name__}")


# ----------------------------------------------------------- tensor-parallel plans
# A plan maps module-name patterns (fnmatch) to styles; disttrain.parallel.tensor applies
# it. Swapped styles replace the module by a sharded one: ``colwise`` / ``colwise_qkv``
# (output features sharded), ``rowwise`` (input features sharded), ``vocab`` /
# ``vocab_head`` (vocabulary rows sharded). The others keep the module whole and say how
# its parameters see the activations: ``partial`` (this rank's heads or features only:
# each rank's gradient is a partial sum, summed over tp), ``replicated`` (the whole
# activation: the same gradient on every tp rank), ``sequence`` (replicated; under
# sequence parallelism it runs on this rank's positions, so partial), ``split_sequence``
# (replicated; its output starts the sequence-parallel region).
TP_COLWISE, TP_COLWISE_QKV, TP_ROWWISE = "colwise", "colwise_qkv", "rowwise"
TP_VOCAB, TP_VOCAB_HEAD = "vocab", "vocab_head"
TP_PARTIAL, TP_REPLICATED = "partial", "replicated"
TP_SEQUENCE, TP_SPLIT_SEQUENCE = "sequence", "split_sequence"
TP_COLUMN = (TP_COLWISE, TP_COLWISE_QKV)
TP_LINEAR = (*TP_COLUMN, TP_ROWWISE)  # the column- and row-parallel linear layers
TP_SWAPPED = (*TP_LINEAR, TP_VOCAB, TP_VOCAB_HEAD)
TP_STYLES = (*TP_SWAPPED, TP_PARTIAL, TP_REPLICATED, TP_SEQUENCE, TP_SPLIT_SEQUENCE)
# what a parameter is under a plan, for its gradient
SHARDED, IDENTICAL, PARTIAL = "sharded", "identical", "partial"
# a LoRA adapter's factors under the style of the layer it adapts, split so that the
# layer's own collectives carry it: a column-parallel layer keeps A [r, in] whole and
# shards B [out, r] like its rows (A's gradient is then a partial sum over tp), a
# row-parallel one shards A like its input columns and keeps B whole (B's partial)
ADAPTER_KINDS = {**{(s, LORA_A): PARTIAL for s in TP_COLUMN},
                 **{(s, LORA_B): SHARDED for s in TP_COLUMN},
                 (TP_ROWWISE, LORA_A): SHARDED, (TP_ROWWISE, LORA_B): PARTIAL}


class UnclassifiedParameter(ValueError):
    """A parameter inside a tensor-parallel region that the plan does not classify."""


def match_plan(model: nn.Module, plan: Mapping[str, str]) -> list[tuple[str, str]]:
    """[(module name, style)] in module order, vocab heads last (they reuse the
    embedding's shard). Each pattern must match a module and name a known style; the
    first matching pattern wins."""
    for pattern, style in plan.items():
        if style not in TP_STYLES:
            raise ValueError(f"plan entry {pattern!r}: unknown style {style!r}; "
                             f"choose one of {', '.join(TP_STYLES)}")
    names = [n for n, _ in model.named_modules() if n]
    unused = [p for p in plan if not any(fnmatchcase(n, p) for n in names)]
    if unused:
        raise ValueError(f"plan patterns {unused} match no module of the model; "
                         "fix or remove them")
    targets = []
    for n in names:
        chosen = next((s for p, s in plan.items() if fnmatchcase(n, p)), None)
        if chosen is not None:
            targets.append((n, chosen))
    return sorted(targets, key=lambda t: t[1] == TP_VOCAB_HEAD)


def classify_tp_params(model: nn.Module, plan: Mapping[str, str]) -> dict[str, str]:
    """Every parameter of the unsharded ``model`` (first name of a tied one) -> what it
    is under ``plan`` without sequence parallelism: :data:`SHARDED` (a swapped module's
    weight, a column-parallel bias), :data:`PARTIAL` (a ``partial`` module's) or
    :data:`IDENTICAL` (a row-parallel bias, and everything outside the tensor-parallel
    regions: it sees the whole activation). A region is a module holding a column- or
    row-parallel child (an attention, an MLP); a parameter inside one that the plan
    does not name raises :class:`UnclassifiedParameter`, naming it and the plan entry
    to add. Works on a model on the meta device."""
    styles = dict(match_plan(model, plan))
    regions = sorted({n.rpartition(".")[0] for n, s in styles.items()
                      if s in TP_LINEAR})
    adapters = _adapter_styles(model, styles)
    kinds: dict[str, str] = {}
    seen: set[int] = set()
    for mod_name, module in model.named_modules():
        style = styles.get(mod_name)
        for p_name, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            name = canonical_name(f"{mod_name}.{p_name}" if mod_name else p_name)
            if mod_name in adapters:
                kinds[name] = adapters[mod_name]
            elif style in TP_SWAPPED:
                kinds[name] = IDENTICAL if (style, p_name) == (TP_ROWWISE, "bias") else SHARDED
            elif style == TP_PARTIAL:
                kinds[name] = PARTIAL
            elif style is not None:
                kinds[name] = IDENTICAL
            else:
                region = next((r for r in regions if _inside(mod_name, r)), None)
                if region is not None:
                    raise UnclassifiedParameter(_unclassified(model, name, mod_name, p,
                                                              region, styles))
                kinds[name] = IDENTICAL
    return kinds


def _adapter_styles(model: nn.Module, styles: dict[str, str]) -> dict[str, str]:
    """The adapted layers of a LoRA model under ``styles``: each one's base layer takes
    its style (added to ``styles``); returned, each adapter factor's module name -> its
    kind (:data:`ADAPTER_KINDS`). An adapter on a layer the plan does not split into
    columns or rows (an embedding, a vocabulary head) is refused."""
    factors: dict[str, str] = {}
    for name, style in list(styles.items()):
        if not isinstance(model.get_submodule(name), LoRALinear):
            continue
        if style not in TP_LINEAR:
            raise UnclassifiedParameter(
                f"module {name!r} carries a LoRA adapter and the tensor-parallel plan "
                f"shards it as {style!r}: adapters split with column- and row-parallel "
                "layers only; leave it out of model.lora_targets, or set parallel.tp=1")
        styles[f"{name}.{ADAPTED}"] = style
        factors |= {f"{name}.{f}": ADAPTER_KINDS[style, f] for f in (LORA_A, LORA_B)}
    return factors


def _inside(module: str, region: str) -> bool:
    return not region or module == region or module.startswith(region + ".")


def _unclassified(model: nn.Module, name: str, module: str, p: torch.Tensor, region: str,
                  styles: Mapping[str, str]) -> str:
    """The one-line refusal for ``name``: where it is, what its size suggests, and the
    plan entry that would classify it."""
    widths = {n: _out_width(model.get_submodule(n)) for n, s in styles.items()
              if s in TP_COLUMN and _inside(n, region)}
    whole = [n for n, w in widths.items() if w == p.numel()]
    where = (f"parameter {name!r} sits inside the tensor-parallel region "
             f"{region or '(the model)'!r}")
    if whole:
        return (f"{where}, and its {p.numel()} values match the whole output width of "
                f"{whole[0]!r}, of which each tp rank holds only its part: an operation "
                "over that whole width (a norm) cannot run exactly on one rank's part, so "
                "this model's attention cannot be sharded this way; set parallel.tp=1")
    pattern = re.sub(r"\.\d+(?=\.|$)", ".*", module)
    return (f"{where} and the plan does not say how it sees the sharded activations: "
            f"if it acts on each rank's own heads or features alone (a per-head norm or "
            f"scale), add {pattern!r}: 'partial' to the model's tp_plan "
            f"(ModelSpec.tp_plan; its gradient is then summed over tp); if it sees the "
            f"whole activation, {pattern!r}: 'replicated'; otherwise set parallel.tp=1")


def _out_width(m: nn.Module) -> int:
    """The output features of a linear-like module ([out, in] nn.Linear, or a
    transposed [in, out] weight)."""
    if isinstance(m, nn.Linear):
        return m.out_features
    w = getattr(m, "weight", None)
    return int(w.shape[-1]) if isinstance(w, torch.Tensor) and w.dim() == 2 else -1


_RECOGNISERS: list[Callable[[nn.Module], ModelSpec | None]] = []


def register_spec(recognise: Callable[[nn.Module], ModelSpec | None]) -> None:
    """Add a function that returns a model's spec, or None if it does not know it."""
    _RECOGNISERS.append(recognise)


def spec_for(model: nn.Module) -> ModelSpec:
    """The spec of the first recogniser that knows ``model``, else :func:`generic_spec`."""
    for recognise in _RECOGNISERS:
        spec = recognise(model)
        if spec is not None:
            return spec
    return generic_spec(model)
