"""Shared by the transformers-model tests: padded dict rows and the plain PyTorch loop
every layout is held to."""

from __future__ import annotations

import torch

from disttrain.data import GlobalOrderSampler
from disttrain.train.batch import collate_samples


def padded_rows(n: int, seq: int, vocab: int) -> list[dict[str, list[int]]]:
    """Rows as a datasets.Dataset yields them (lists of ints): every third left-padded
    by a different amount, padding masked out of attention and labelled -100."""
    g = torch.Generator().manual_seed(1)
    rows = []
    for i in range(n):
        ids = torch.randint(1, vocab, (seq,), generator=g)
        mask = torch.ones(seq, dtype=torch.long)
        labels = ids.clone()
        pad = (i % 5) + 1 if i % 3 == 0 else 0
        ids[:pad], mask[:pad], labels[:pad] = 0, 0, -100
        rows.append({"input_ids": ids.tolist(), "attention_mask": mask.tolist(),
                     "labels": labels.tolist()})
    return rows


def plain_loop(model: torch.nn.Module, rows: list, train: dict, *, steps: int,
               batch: int) -> torch.nn.Module:
    """Train ``model`` in place in one process on the whole global batch per step (the
    trainer's sample order, seed 1234): loss = summed cross-entropy over the counted
    label tokens / their number, AdamW with decay on matrices only, clipping."""
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2],
                              "weight_decay": train["weight_decay"]},
                             {"params": [p for p in params if p.dim() < 2],
                              "weight_decay": 0.0}], lr=train["lr"], betas=(0.9, 0.95))
    sampler = GlobalOrderSampler(len(rows), 1234)
    for step in range(steps):
        b = collate_samples([rows[i] for i in sampler.indices(step * batch, batch)])
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        labels = b["labels"][:, 1:]
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), labels.flatten(), ignore_index=-100,
            reduction="sum") / (labels != -100).sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, train["grad_clip"])
        opt.step()
    return model
