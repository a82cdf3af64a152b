"""Shared by the packing tests: examples of varying length, the tiny GPT and Llama they
train, and the reference every packed run is held to: the same examples unpacked, each
padded alone to the row length, in plain PyTorch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from disttrain.config.schema import ModelConfig
from disttrain.models import GPT

SEQ, VOCAB = 16, 64
MODEL = {"vocab_size": VOCAB, "seq_len": SEQ, "n_layer": 2, "n_head": 2, "d_model": 32}
# 26 examples, most short, a few near the row length (a skewed mix, 126 tokens): they
# pack into 8 rows of 16 (the packing tests assert it)
LENGTHS = (16, 14, 12, 11, 9, 8, 7, 6, 5, 5, 4, 4, 3, 3, 3, 2, 2, 2, 2, 1,
           1, 1, 1, 1, 2, 1)


def examples(lengths: tuple[int, ...] = LENGTHS, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``{"input_ids", "labels"}`` examples of these lengths; every third has a prompt
    (its first third of the labels -100), one has no trained token at all."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(lengths):
        ids = torch.randint(1, VOCAB, (n,), generator=g)
        labels = ids.clone()
        if i % 3 == 0:
            labels[: max(1, n // 3)] = -100
        if i == 7:
            labels[:] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def gpt() -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(ModelConfig(**MODEL))


def llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        bos_token_id=0, eos_token_id=0))


BUILD = {"gpt": gpt, "llama": llama}


def logits_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The model's logits [B, T, V] for ids [B, T], called as a user would, unpacked."""
    out = model(input_ids=ids) if not isinstance(model, GPT) else model(ids)
    return out if isinstance(out, torch.Tensor) else out.logits


def unpacked_loss(model: torch.nn.Module, batch: list[dict[str, torch.Tensor]]
                  ) -> tuple[torch.Tensor, int]:
    """(summed loss, trained tokens) of ``batch``'s examples, each padded alone to SEQ
    (id 0, labels -100) and run through ``model`` in one batch: position t predicts
    labels[t + 1], -100 not counted (plain cross-entropy)."""
    ids = torch.zeros(len(batch), SEQ, dtype=torch.long)
    labels = torch.full((len(batch), SEQ), -100, dtype=torch.long)
    for row, ex in enumerate(batch):
        n = len(ex["input_ids"])
        ids[row, :n], labels[row, :n] = ex["input_ids"], ex["labels"]
    logits = logits_of(model, ids)
    targets = labels[:, 1:]
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(),
                           ignore_index=-100, reduction="sum")
    return loss, int((targets != -100).sum())
