"""Per-example samples (:class:`~.examples.ExampleDataset`) batched by padding: one
example per row, every row ``model.seq_len`` long.

Row ``b`` is example ``b``'s ``L_b`` tokens, then ``seq_len - L_b`` copies of the pad
id; its labels are the example's, then ``-100``, so padding is never trained on or
counted. No ``attention_mask`` is made: padding sits to the right, and under causal
attention a real token attends only to the tokens before it, all real, with the
positions ``0 .. L_b - 1`` it would have alone; the pad positions' outputs are not
read by the loss. (A batching that puts several examples in one row, packing, replaces
this collate function and must bring its own positions and block-diagonal mask.)
A fixed width keeps every micro-batch one shape, for pipeline stages and compiled
blocks alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from disttrain.targets import LABEL_IGNORE_INDEX


@dataclass(frozen=True)
class PadToSeqLen:
    """Collate ``{"input_ids": [L], "labels": [L]}`` samples (``L <= seq_len``) into
    ``{"input_ids": [B, seq_len], "labels": [B, seq_len]}`` (int64), right-padded."""

    seq_len: int
    pad_id: int

    def __call__(self, samples: Sequence[Mapping[str, torch.Tensor]]
                 ) -> dict[str, torch.Tensor]:
        ids = torch.full((len(samples), self.seq_len), self.pad_id, dtype=torch.long)
        labels = torch.full_like(ids, LABEL_IGNORE_INDEX)
        for row, sample in enumerate(samples):
            n = len(sample["input_ids"])
            if n > self.seq_len:
                raise ValueError(f"an example of {n} tokens does not fit seq_len="
                                 f"{self.seq_len}")
            ids[row, :n] = sample["input_ids"]
            labels[row, :n] = sample["labels"]
        return {"input_ids": ids, "labels": labels}
