"""Whether a run can pack examples (``data.packing``), checked before any process group.

A model takes packed rows through the inputs its spec declares (``packed_inputs``: the
built-in GPT's ``position_ids`` and ``document_ids``; a transformers causal LM's
``position_ids``, from which transformers keeps attention inside each example). A spec
with a ``twin`` (a small model of the same class and forward code) has that claim
checked by running the twin: two examples packed into one padded row against each
alone, every logit of the examples compared. A model that declares nothing, or whose
twin attends across the examples, is refused in one line: packing is never approximated.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..config.layout import Layout
from ..config.schema import Config
from ..dimensions import Role, with_role
from ..errors import ConfigError
from ..names import DOCUMENT_IDS, POSITION_IDS
from ..spec import ModelSpec, output_logits
from .packing import INPUT_IDS, packed_row

ROW_INPUTS = (POSITION_IDS, DOCUMENT_IDS)  # what a packed row offers a model
# the probe: two examples and padding in one row, token ids below any vocabulary's size
_PROBE_LENGTHS, _PROBE_ROW, _PROBE_VOCAB = (4, 6), 13, 8
# the same sums in another order differ by ~1e-7; attention that reaches another
# example moves a logit by 1e-2 or more
_PROBE_RTOL, _PROBE_ATOL = 1e-4, 1e-5


def check_packing(config: Config, spec: ModelSpec, layout: Layout) -> None:
    """Refuse (:class:`~disttrain.errors.ConfigError` on ``data.packing``) packing for
    a model that cannot take packed rows, and beside a dimension that splits each
    row's tokens over ranks (context parallelism's ring attends causally over the whole
    row, across the examples in it)."""
    if not config.data.packing:
        return
    splits = [d for d in with_role(Role.TOKENS) if layout.degree(d.key) > 1]
    if splits:
        settings = ", ".join(f"{d.config_key}={layout.degree(d.key)}" for d in splits)
        raise ConfigError("data.packing", True, f"does not combine with {settings}: a rank "
                          "holding part of each row attends causally over the whole row, "
                          "across the examples packed in it", "set data.packing = false "
                          "(each example padded to model.seq_len), or "
                          + " and ".join(f"{d.config_key} = 1" for d in splits))
    refusal = packing_refusal(spec)
    if refusal is not None:
        raise ConfigError("data.packing", True, f"this model cannot keep packed examples "
                          f"apart: {refusal}", "set data.packing = false (pad each "
                          "example to model.seq_len instead)")


def packing_refusal(spec: ModelSpec) -> str | None:
    """None when a model with ``spec`` takes packed rows, else why not (one line)."""
    if not spec.packed_inputs:
        return spec.packing_refusal or ("its spec declares no inputs for packed rows "
                                        "(ModelSpec.packed_inputs)")
    unknown = [k for k in spec.packed_inputs if k not in ROW_INPUTS]
    if unknown:
        return (f"its spec asks packed rows for {', '.join(unknown)}; a row offers "
                f"{' and '.join(ROW_INPUTS)}")
    if spec.twin is None:  # declared by the spec's author (the built-in GPT: tested)
        return None
    twin = spec.twin()
    if twin is None:
        return "no small model of its family could be built to check it on"
    return packing_mismatch(*twin)


def packing_mismatch(model: nn.Module, spec: ModelSpec) -> str | None:
    """None when ``model``, given a row of two packed examples through
    ``spec.packed_inputs``, computes for each example's tokens the logits it computes
    for that example alone; else what differs (one line). Runs in eval mode, without
    gradients, on the model's device."""
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(0)
    examples = [torch.randint(0, _PROBE_VOCAB, (n,), generator=g) for n in _PROBE_LENGTHS]
    row = packed_row([(ids, ids) for ids in examples], _PROBE_ROW)
    extra = dict(spec.call_kwargs or {})
    training = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            packed = _logits(model, {INPUT_IDS: row[INPUT_IDS], **{
                k: row[k] for k in spec.packed_inputs}}, extra, device)
            alone = [_logits(model, {INPUT_IDS: ids}, extra, device) for ids in examples]
    finally:
        for m, mode in training:
            m.training = mode
    start = 0
    for k, want in enumerate(alone):
        got = packed[start:start + len(want)]
        if not torch.allclose(got, want, rtol=_PROBE_RTOL, atol=_PROBE_ATOL):
            worst = float((got - want).abs().max())
            return (f"{type(model).__name__}, given a packed row's "
                    f"{' and '.join(spec.packed_inputs)}, lets example {k} read another "
                    f"(its logits move by {worst:.2g} from those it has alone)")
        start += len(want)
    return None


def _logits(model: nn.Module, inputs: dict[str, torch.Tensor], extra: dict[str, Any],
            device: torch.device) -> torch.Tensor:
    """The model's logits [T, V] for one row ``inputs`` ([T] each)."""
    batch = {k: v.unsqueeze(0).to(device) for k, v in inputs.items()}
    return output_logits(model(**batch, **extra))[0].float()
