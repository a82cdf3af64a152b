"""Shared pieces for the tests: a tiny GPT config and synthetic token data."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from disttrain.config import load_config
from disttrain.models import IGNORE_INDEX

TINY_MODEL = {"vocab_size": 64, "seq_len": 16, "n_layer": 2, "n_head": 2, "d_model": 32}


class SyntheticTokens(Dataset):
    """Random token windows; with ``mask`` each sample hides a different number of its
    targets (IGNORE_INDEX), so samples carry different numbers of loss terms."""

    def __init__(self, n: int = 96, seq_len: int = 16, vocab: int = 64, mask: bool = False,
                 seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, vocab, (n, seq_len + 1), generator=g)
        self.hidden = (torch.randint(0, seq_len, (n,), generator=g) if mask
                       else torch.zeros(n, dtype=torch.long))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        window = self.tokens[i]
        targets = window[1:].clone()
        targets[: int(self.hidden[i])] = IGNORE_INDEX
        return {"input_ids": window[:-1], "targets": targets}


def tiny_config(run_dir: Path | str | None = None, **train: Any):
    values = {"model": dict(TINY_MODEL),
              "train": {"steps": 20, "global_batch": 8, "grad_accum": 1, "lr": 3e-3,
                        "warmup_steps": 3, "eval_samples": 8, "log_every": 5, **train}}
    return load_config(values=values)


def state_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
