"""Dropout under tensor parallelism: the ranks of a tp group must draw the same masks
for the activations they replicate (GPT-2's embedding and residual dropout), whatever
each process drew before. Training seeds its random streams from ``train.seed`` (the
same on every rank of a tp group, distinct per dp replica and pipeline stage), so a
process that drew other random numbers first still trains right: the first step's
proof of identical gradients (``parallel.tp_check_grads``) passes at dropout 0.1, and
two runs with the same seed end on the same weights."""

from __future__ import annotations

import os

import torch
from support import SyntheticTokens, full_state

from disttrain.testing import run_distributed


def _fit(run_dir: str, draws: int) -> dict[str, torch.Tensor] | None:
    from transformers import GPT2Config, GPT2LMHeadModel

    from disttrain import Trainer
    from disttrain.data import collate_token_batch

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2,
                                       n_head=4, resid_pdrop=0.1, embd_pdrop=0.1,
                                       attn_pdrop=0.1, bos_token_id=0, eos_token_id=0))
    if os.environ["RANK"] == "1":
        torch.rand(draws)  # this process's streams now differ from rank 0's
    trainer = Trainer(model, SyntheticTokens(), None, {
        "train": {"steps": 3, "global_batch": 8, "eval_samples": 8, "log_every": 1},
        "parallel": {"tp": 2}, "checkpoint": {"every": 0}, "monitor": {"peak_tflops": 1.0}},
        collate_fn=collate_token_batch, run_dir=run_dir, progress=False)
    trainer.fit()
    return full_state(trainer.parallel)


def _twice(root: str) -> list:
    out = []
    for name, draws in (("a", 7), ("b", 11)):
        out.append(_fit(f"{root}/{name}", draws))
    return out


def test_tp_ranks_draw_the_same_masks_for_replicated_activations(tmp_path):
    first, second = run_distributed(_twice, 2, args=(str(tmp_path),), timeout=180)[0]
    assert first is not None and sorted(first) == sorted(second)
    assert all(torch.equal(first[n], second[n]) for n in first)
