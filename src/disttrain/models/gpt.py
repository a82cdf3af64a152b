"""A decoder-only transformer (GPT-style), plain PyTorch with no parallelism inside.

Pre-norm blocks (LayerNorm -> causal self-attention -> residual, LayerNorm -> MLP ->
residual), learned position embeddings, and an output projection tied to the token
embedding. Strategies are applied to this unchanged model from outside.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config.schema import ModelConfig
from ..targets import IGNORE_INDEX


class CausalSelfAttention(nn.Module):
    """qkv: [d, 3d] (no bias); out: [d, d]. Input and output [B, T, d].

    The key bias would get an identically zero gradient (softmax ignores a constant
    shift of the scores per query), so Adam would turn its rounding noise into
    full-size updates; the projection has no bias at all.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.d_model // cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.out = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Shapes are read from the projection's output, not from x or the config, so the
        # same code runs when qkv yields only some heads (or x only some positions).
        qkv = self.qkv(x)
        b, t = qkv.shape[:2]
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2)
                   for z in qkv.chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """up: [d, 4d]; down: [4d, d]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.down = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.down(F.gelu(self.up(x))))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """input_ids [B, T] (T <= seq_len) -> logits [B, T, vocab_size]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        # Residual projections scaled down with depth (GPT-2).
        for name, p in self.named_parameters():
            if name.endswith(("attn.out.weight", "mlp.down.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        pos = torch.arange(t, device=input_ids.device)
        x = self.drop(self.tok_emb(input_ids) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed cross-entropy over target positions != IGNORE_INDEX, and their count.

    logits: [B, T, V]; targets: [B, T]. The trainer divides by the global count.
    """
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(),
                           ignore_index=IGNORE_INDEX, reduction="sum")
    return loss, int((targets != IGNORE_INDEX).sum())


def num_params(cfg: ModelConfig, *, embeddings: bool = True) -> int:
    """Parameter count of GPT(cfg) (tied head counted once)."""
    d, layers = cfg.d_model, cfg.n_layer
    per_block = 3 * d * d + (d * d + d) + (8 * d * d + 5 * d) + 4 * d
    n = layers * per_block + 2 * d
    if embeddings:
        n += cfg.vocab_size * d + cfg.seq_len * d
    return n


def flops_per_token(cfg: ModelConfig) -> int:
    """Training FLOPs per token (forward + backward = 3x forward).

    6 per non-embedding parameter plus the output projection (2 x 3 x d x V), and the
    attention scores and weighted sum: 2 matmuls x 2 x T x d per layer forward, x3.
    Position/token embedding lookups cost no multiply-adds.
    """
    d, t = cfg.d_model, cfg.seq_len
    matmul_params = num_params(cfg, embeddings=False) + cfg.vocab_size * d
    attention = cfg.n_layer * 2 * 2 * t * d
    return 6 * matmul_params + 3 * attention
