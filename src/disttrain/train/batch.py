"""Batches and losses in the conventions users already have.

A collated batch is one of:

- a pair ``(inputs, targets)``: the model is called as ``model(inputs)`` and the loss as
  ``loss_fn(outputs, targets)``;
- a mapping: every entry except ``labels`` / ``targets`` is passed to the model as a
  keyword argument (``input_ids``, ``attention_mask``, ...), and ``labels`` (or
  ``targets``) go to the loss.

Without a ``loss_fn`` the loss is the causal-LM loss, summed with its token count, so the
trainer normalises by the global number of counted tokens: on ``labels`` (Hugging Face:
unshifted, ``-100`` ignored) it shifts inside; on ``targets`` (disttrain's token
windows: already shifted, ``-1`` ignored) it does not. The model's output may be the
logits, a tuple starting with them, or a mapping / model output with ``logits``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch.utils.data import default_collate

from ..errors import UserError
from ..names import ATTENTION_MASK, POSITION_IDS
from ..spec import output_logits as model_logits
from ..targets import IGNORE_INDEX, LABEL_IGNORE_INDEX

LossFn = Callable[[Any, Any], "torch.Tensor | tuple[torch.Tensor, int | torch.Tensor]"]
# (logits [B, T, V] (or [B, T, V/tp]; hidden states [B, T, d] where the head is fused
# into the loss), targets [B, T], ignored id) -> (summed loss, counted positions)
TokenLoss = Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]
LABELS, TARGETS = "labels", "targets"


@dataclass(frozen=True)
class Batch:
    """One micro-batch: what the model takes and what the loss takes.

    ``labels``: the targets follow the Hugging Face convention (unshifted, -100)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    targets: Any = None
    labels: bool = False

    def run(self, model: Callable[..., Any]) -> Any:
        return model(*self.args, **self.kwargs)

    def tokens(self) -> torch.Tensor:
        """The token ids [B, T]: the positional input, else ``input_ids``, else the
        first tensor input."""
        if self.args and isinstance(self.args[0], torch.Tensor):
            return self.args[0]
        ids = self.kwargs.get("input_ids")
        if isinstance(ids, torch.Tensor):
            return ids
        found = next((v for v in self.kwargs.values() if isinstance(v, torch.Tensor)), None)
        if found is None:
            raise ValueError("this batch has no tensor input to read its tokens from")
        return found

    def positions(self) -> int:
        """The positions the loss runs over, counted or not: every element of the
        targets (B x T of a causal LM's, padding and masked prompts included: the model
        computes them all; B for a loss over samples). What tokens/s and MFU count."""
        t = self.targets
        return int(t.numel()) if isinstance(t, torch.Tensor) else len(t)

    def tokens_shape(self) -> tuple[int, int]:
        """(B, T) of :meth:`tokens`."""
        ids = self.tokens()
        return int(ids.shape[0]), int(ids.shape[1])

    def split_sequence(self, part: Callable[[torch.Tensor], torch.Tensor],
                       positions: torch.Tensor) -> Batch:
        """This batch as one rank of a sequence split holds it (see
        :class:`disttrain.parallel.interfaces.SequenceBatch`): labels shifted over the
        whole sequence into targets (-100 -> :data:`IGNORE_INDEX`) before ``part`` cuts
        every [B, T] tensor, a mask of ones dropped, ``positions`` added as
        ``position_ids`` unless the batch has its own."""
        t = self.tokens_shape()[1]

        def cut(x: Any) -> Any:
            return part(x) if isinstance(x, torch.Tensor) and x.dim() >= 2 \
                and x.shape[1] == t else x
        kwargs = {k: cut(v) for k, v in self.kwargs.items() if k != ATTENTION_MASK}
        _refuse_padding(self.kwargs.get(ATTENTION_MASK))
        kwargs.setdefault(POSITION_IDS, positions.to(self.tokens().device))
        targets = shifted_labels(self.targets) if self.labels else self.targets
        return Batch(tuple(cut(a) for a in self.args), kwargs, cut(targets))

    def default_loss(self, outputs: Any, token_loss: TokenLoss | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """The causal-LM loss (summed) and its token count for these targets;
        ``token_loss`` computes it from the logits (default :func:`token_loss_on`; the
        vocabulary-parallel loss when the logits are sharded; the fused linear +
        cross-entropy when the model's output holds hidden states in their place)."""
        if self.labels:
            return causal_lm_loss(outputs, self.targets, token_loss)
        return (token_loss or token_loss_on)(model_logits(outputs), self.targets,
                                             IGNORE_INDEX)


def shifted_labels(labels: torch.Tensor) -> torch.Tensor:
    """Hugging Face labels [B, T] (unshifted, -100 ignored) as targets [B, T] aligned
    with the logits (``targets[:, t] = labels[:, t + 1]``, :data:`IGNORE_INDEX`
    ignored, the last position too): what :func:`causal_lm_loss` computes on, made
    explicit so the sequence can be cut anywhere."""
    out = torch.full_like(labels, IGNORE_INDEX)
    out[:, :-1] = labels[:, 1:].masked_fill(labels[:, 1:] == LABEL_IGNORE_INDEX,
                                            IGNORE_INDEX)
    return out


def _refuse_padding(mask: Any) -> None:
    """A rank holding part of each sequence attends causally over the whole of it: a
    batch's attention mask may only be all ones (one host read of it, only when a batch
    carries a mask)."""
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or not bool(mask.all()):
        raise UserError(f"a batch's {ATTENTION_MASK} masks out positions (padding) or is "
                        "not a [B, T] mask of ones; context parallelism attends causally "
                        "over every position of each sequence: pack the samples to full "
                        "length without padding, or train without context parallelism")


def split_batch(batch: Any, extra: Mapping[str, Any] | None = None) -> Batch:
    """A collated batch (a pair, or a mapping) as a :class:`Batch`; ``extra``: keyword
    arguments added to the model's (the spec's ``call_kwargs``)."""
    extra = dict(extra or {})
    if isinstance(batch, Mapping):
        key = LABELS if LABELS in batch else TARGETS if TARGETS in batch else None
        if key is None:
            raise ValueError(f"a mapping batch needs '{LABELS}' (or '{TARGETS}') for the "
                             f"loss; it has {', '.join(batch)}")
        kwargs = {k: v for k, v in batch.items() if k not in (LABELS, TARGETS)}
        return Batch((), {**kwargs, **extra}, batch[key], labels=key == LABELS)
    inputs, targets = batch
    return Batch((inputs,), extra, targets)


def to_device(obj: Any, device: torch.device) -> Any:
    """``obj``'s tensors on ``device``; a host tensor bound for a GPU is pinned first,
    so its ``non_blocking`` copy really overlaps (from pageable memory it would not)."""
    if isinstance(obj, torch.Tensor):
        if device.type == "cuda" and obj.device.type == "cpu":
            obj = obj.pin_memory()
        return obj.to(device, non_blocking=True)
    if isinstance(obj, Mapping):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)
    return obj


def collate_samples(samples: Sequence[Any]) -> Any:
    """Samples that are mappings (e.g. rows of a ``datasets.Dataset``, whose columns
    may be lists of ints) become a mapping of stacked tensors; anything else goes
    through torch's ``default_collate``."""
    if samples and isinstance(samples[0], Mapping):
        return {k: _stack_entry(k, [s[k] for s in samples]) for k in samples[0]}
    # torch declares ``batch: list``; default_collate indexes and iterates any sequence
    return default_collate(cast(list[Any], samples))


def _stack_entry(key: str, values: list[Any]) -> torch.Tensor:
    """The samples' ``key`` entries stacked on a new dim 0: [B, *entry shape]."""
    try:
        return torch.stack([torch.as_tensor(v) for v in values])
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"cannot stack the samples' '{key}' into one tensor ({e}): the "
                         "default collation needs numbers or equal-length sequences; pad "
                         "the samples to one length, drop other columns (a datasets."
                         "Dataset: remove_columns), or pass collate_fn") from e


def token_loss_on(logits: torch.Tensor, targets: torch.Tensor, ignore: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy of logits [B, T, V] against targets [B, T] and the number
    of positions counted (those != ``ignore``)."""
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(),
                           ignore_index=ignore, reduction="sum")
    return loss, (targets != ignore).sum()


def causal_lm_loss(outputs: Any, labels: torch.Tensor, token_loss: TokenLoss | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token loss on Hugging Face labels [B, T] (unshifted; -100 ignored): position
    t's logits predict labels[t + 1]; summed, with the number of counted tokens."""
    logits = model_logits(outputs)
    return (token_loss or token_loss_on)(logits[:, :-1], labels[:, 1:],
                                         LABEL_IGNORE_INDEX)


def loss_sum_and_terms(loss_fn: LossFn | None, outputs: Any, batch: Batch,
                       token_loss: TokenLoss | None = None
                       ) -> tuple[torch.Tensor, int | torch.Tensor, bool]:
    """(summed loss, loss terms, whether terms are samples): ``loss_fn`` returns a
    micro-batch mean or a (sum, count) pair; None is the batch's default loss (computed
    by ``token_loss``). A count the loss gives as a tensor stays one: reading it on the
    host would wait for the forward on a GPU, and the host could not queue the
    backward ahead of it."""
    result = (batch.default_loss(outputs, token_loss) if loss_fn is None
              else loss_fn(outputs, batch.targets))
    if isinstance(result, tuple):
        loss_sum, count = result
        return loss_sum, count if isinstance(count, torch.Tensor) else int(count), False
    n = len(batch.targets)
    return result * n, n, True


class BatchLoss:
    """The loss a step calls on each micro-batch: (summed loss, loss terms), from the
    user's ``loss_fn`` or (None) the batch's default loss computed by ``token_loss``.
    ``terms_are_samples``: the last call's loss was a mean over samples (the progress
    line counts samples, not tokens). A count may stay a tensor (see
    :func:`loss_sum_and_terms`): the passes only add it into the step's totals."""

    def __init__(self, loss_fn: LossFn | None, token_loss: TokenLoss | None) -> None:
        self.loss_fn, self.token_loss = loss_fn, token_loss
        self.terms_are_samples = False

    def __call__(self, outputs: Any, batch: Batch) -> tuple[torch.Tensor, int]:
        loss_sum, count, samples = loss_sum_and_terms(self.loss_fn, outputs, batch,
                                                      self.token_loss)
        self.terms_are_samples = samples
        return loss_sum, cast(int, count)  # LossOf (parallel.interfaces) declares int
