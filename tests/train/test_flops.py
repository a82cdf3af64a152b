"""FLOPs of a user's model, counted with torch's FLOP counter, leave training as it is.

torch's ``FlopCounterMode`` runs ops that have no FLOP formula through their
decompositions (``silu_backward`` becomes ``sigmoid``, ``mul``, ``add``: other
roundings), and any dispatch mode sends composite ops down their tensor-subclass paths;
counting inside the first real step moved its gradients by up to ~1e-6. The count is a
separate pass (its own RNG stream, its own buffers, gradients that go nowhere): with
it or with FLOPs per token given, the weights after two steps are bitwise equal.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from disttrain.testing import run_distributed

VOCAB, SEQ, D, HEADS, N = 64, 16, 32, 2, 32


class _Block(nn.Module):
    """Pre-norm attention (scaled_dot_product_attention) and a SwiGLU MLP, dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.out = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.gate_up, self.down = nn.Linear(D, 4 * D), nn.Linear(2 * D, D)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, HEADS, D // HEADS).permute(
            2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.out(a.transpose(1, 2).reshape(b, t, D)))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.drop(self.down(F.silu(gate) * up))


class TinyLM(nn.Module):
    """A user's decoder: ``model(input_ids=...)`` -> logits [B, T, VOCAB]."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(_Block() for _ in range(2))
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def matmul_flops_per_token() -> float:
    """Training FLOPs of TinyLM's linear layers per token (per position the loss runs
    over, trained or not): 6 per weight (forward, and both backward products)."""
    weights = sum(m.weight.numel() for m in TinyLM().modules() if isinstance(m, nn.Linear))
    return 6 * weights


def _rows() -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, VOCAB, (N, SEQ), generator=torch.Generator().manual_seed(3))
    return [{"input_ids": row, "labels": row} for row in ids]


def _fit(root: str) -> dict:
    """Two steps with the FLOPs counted, then with them given: weights, summaries."""
    from disttrain import Trainer

    out = {}
    for kind, flops in (("counted", None), ("given", 1000)):
        torch.manual_seed(0)
        model = TinyLM()
        config = {"train": {"steps": 2, "global_batch": 8, "grad_accum": 2, "lr": 1e-2,
                            "warmup_steps": 0, "log_every": 1},
                  "checkpoint": {"every": 0}, "monitor": {"peak_tflops": 1.0}}
        summary = Trainer(model, _rows(), config=config, run_dir=f"{root}/{kind}",
                          flops_per_token=flops, progress=False).fit()
        out[kind] = ({k: v.detach().clone() for k, v in model.state_dict().items()},
                     summary)
    return out


def test_counting_flops_leaves_the_first_steps_bitwise_unchanged(tmp_path):
    got = run_distributed(_fit, 1, args=(str(tmp_path),), timeout=180)[0]
    counted, given = got["counted"], got["given"]
    for k, v in given[0].items():
        assert torch.equal(counted[0][k], v), k
    assert counted[1]["final_train_loss"] == given[1]["final_train_loss"]
    # the count is still made and reported: FLOPs per token (CPU attention kernels
    # have no formula, so about the linear layers' share) and the MFU
    flops = counted[1]["model_flops_per_s"] / counted[1]["tokens_per_s"]
    assert 0.99 <= flops / matmul_flops_per_token() <= 1.3, flops
    # tokens/s counts every position the model computes; trained tokens/s the loss's
    # terms: SEQ - 1 of each row's SEQ (the last position predicts nothing), same clock
    summary = counted[1]
    assert summary["trained_tokens_per_s"] == pytest.approx(
        summary["tokens_per_s"] * (SEQ - 1) / SEQ, rel=1e-9)
    records = [json.loads(line) for line in
               (Path(tmp_path) / "counted" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["mfu"] is not None and r["mfu"] > 0 for r in records)
    # monitor.peak_tflops = 1.0 is the denominator, and the records and summary say so
    assert all(r["peak_source"] == "configured" for r in records)
    summary = counted[1]
    assert (summary["peak_source"], summary["peak_tflops"]) == ("configured", 1.0)
    assert summary["mfu"] == pytest.approx(summary["model_flops_per_s"] / 1e12)
