"""A decoder-only transformer (GPT-style), plain PyTorch with no parallelism inside.

Pre-norm blocks (LayerNorm -> causal self-attention -> residual, LayerNorm -> MLP ->
residual), learned position embeddings, and an output projection tied to the token
embedding. Strategies are applied to this unchanged model from outside.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import AttentionSlot
from ..config.schema import ModelConfig
from ..names import DOCUMENT_IDS, POSITION_IDS
from ..spec import (
    TP_COLWISE,
    TP_COLWISE_QKV,
    TP_ROWWISE,
    TP_SEQUENCE,
    TP_SPLIT_SEQUENCE,
    TP_VOCAB,
    TP_VOCAB_HEAD,
    Divisor,
    ModelSpec,
    register_spec,
)
from ..targets import IGNORE_INDEX


class CausalSelfAttention(AttentionSlot):
    """qkv: [d, 3d] (no bias); out: [d, d]. Input and output [B, T, d]; ``document_ids``
    [B, T] (optional): the packed example each position belongs to (attention stays
    inside it).

    The key bias would get an identically zero gradient (softmax ignores a constant
    shift of the scores per query), so Adam would turn its rounding noise into
    full-size updates; the projection has no bias at all. The attention itself is
    ``self.attend`` (:class:`~disttrain.attention.AttentionSlot`: causal SDPA over the
    positions held, unless a strategy such as context parallelism swapped it).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(dropout=cfg.dropout)
        self.n_head = cfg.n_head
        self.head_dim = cfg.d_model // cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.out = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor, document_ids: torch.Tensor | None = None
                ) -> torch.Tensor:
        # Shapes are read from the projection's output, not from x or the config, so the
        # same code runs when qkv yields only some heads (or x only some positions).
        qkv = self.qkv(x)
        b, t = qkv.shape[:2]
        q, k, v = (z.view(b, t, -1, self.head_dim).transpose(1, 2)
                   for z in qkv.chunk(3, dim=-1))
        y = self.attend(q, k, v, self.dropout if self.training else 0.0, document_ids)
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

    def forward(self, x: torch.Tensor, document_ids: torch.Tensor | None = None
                ) -> torch.Tensor:
        # document ids only when packed: an unpacked call passes the one input that
        # wrappers of the module (DTensor's input layouts, hooks) expect
        h = self.ln1(x)
        x = x + (self.attn(h) if document_ids is None else self.attn(h, document_ids))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """input_ids [B, T] (T <= seq_len) -> logits [B, T, vocab_size]; ``position_ids``
    ([T] or [B, T], default 0 .. T-1): the positions of those tokens in their sequence
    (a context-parallel rank holds non-contiguous parts of it; packed examples restart
    at 0); ``document_ids`` ([B, T], default None: one sequence per row): the packed
    example each token belongs to, which its attention never leaves."""

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
        if not self.head.weight.is_meta:  # on meta: a seeded source fills it later
            self.apply(self._init_own)  # (this order of draws: the torch seed's values)
            for name, p in self.named_parameters():
                if name.endswith(("attn.out.weight", "mlp.down.weight")):
                    nn.init.normal_(p, std=self._residual_std())

    def init_module(self, m: nn.Module) -> None:
        """Initialise ``m``'s own tensors (applied to every module, children first):
        matrices N(0, 0.02), biases 0, norms 1 / 0, and the residual projections scaled
        down with depth (GPT-2)."""
        self._init_own(m)
        if isinstance(m, (CausalSelfAttention, MLP)):
            residual = m.out if isinstance(m, CausalSelfAttention) else m.down
            nn.init.normal_(residual.weight, std=self._residual_std())

    def _residual_std(self) -> float:
        return 0.02 / math.sqrt(2 * self.cfg.n_layer)

    @staticmethod
    def _init_own(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = gpt_embed(self, input_ids, position_ids)
        for block in self.blocks:
            x = block(x) if document_ids is None else block(x, document_ids)
        return gpt_finish(self, x)


class _GPTEnds(Protocol):
    """The modules :func:`gpt_embed` and :func:`gpt_finish` run: the GPT's, or those of
    any module holding them (a pipeline stage)."""

    tok_emb: nn.Module
    pos_emb: nn.Module
    drop: nn.Module
    ln_f: nn.Module
    head: nn.Module


def gpt_embed(m: nn.Module, input_ids: torch.Tensor,
              position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Token + position embeddings (then dropout) of input_ids [B, T] -> [B, T, d] at
    ``position_ids`` ([T] or [B, T]; default 0 .. T-1); ``m`` is the GPT or any module
    holding its ``tok_emb``, ``pos_emb`` and ``drop``."""
    ends = cast(_GPTEnds, m)  # nn.Module types its submodules as Tensor | Module
    pos = (torch.arange(input_ids.shape[1], device=input_ids.device)
           if position_ids is None else position_ids)
    return ends.drop(ends.tok_emb(input_ids) + ends.pos_emb(pos))


def gpt_finish(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Final norm and output projection [B, T, d] -> logits [B, T, V]; ``m`` holds
    ``ln_f`` and ``head``."""
    ends = cast(_GPTEnds, m)  # nn.Module types its submodules as Tensor | Module
    return ends.head(ends.ln_f(x))


# The tensor-parallel plan (module-name pattern -> style, see
# disttrain.parallel.tensor.apply_tensor_parallel): Megatron's split of attention and MLP,
# the vocabulary sharded in the embedding and the (tied) head.
GPT_TP_PLAN: dict[str, str] = {
    "tok_emb": TP_VOCAB,
    "drop": TP_SPLIT_SEQUENCE,
    "blocks.*.ln1": TP_SEQUENCE,
    "blocks.*.attn.qkv": TP_COLWISE_QKV,
    "blocks.*.attn.out": TP_ROWWISE,
    "blocks.*.ln2": TP_SEQUENCE,
    "blocks.*.mlp.up": TP_COLWISE,
    "blocks.*.mlp.down": TP_ROWWISE,
    "ln_f": TP_SEQUENCE,
    "head": TP_VOCAB_HEAD,
}


def gpt_spec(cfg: ModelConfig) -> ModelSpec:
    """The GPT's structure for the strategies (needs only the config, so validation can
    check a layout before any model exists).

    Costs are forward FLOPs per token, the planner's (:func:`~disttrain.shape.
    gpt_shape`): a block's matmuls (2 x 12 d^2) and attention (4 T d); the head 2 d V
    (plus the loss, a few V); the embedding lookups and the position add, about d
    (memory-bound, costed as d)."""
    from ..shape import gpt_shape

    d, t, vocab = cfg.d_model, cfg.seq_len, cfg.vocab_size
    shape = gpt_shape(_costed(cfg))
    block = shape.layer_matmul_flops() + shape.layer_attention_flops()
    return ModelSpec(
        blocks="blocks", before=("tok_emb", "pos_emb", "drop"), after=("ln_f", "head"),
        embed=gpt_embed, finish=gpt_finish, embed_inputs=(POSITION_IDS,),
        block_inputs=(DOCUMENT_IDS,), packed_inputs=(POSITION_IDS, DOCUMENT_IDS),
        hidden_size=d, head="head",
        tied=(("tok_emb.weight", "head.weight"),), tp_plan=GPT_TP_PLAN,
        tp_head_attrs=("blocks.*.attn.n_head",),
        tp_divisors=(Divisor("model.n_head", cfg.n_head, cfg.n_head, "attention heads"),
                     Divisor("model.d_model", d, 4 * d, "MLP width 4 x d_model"),
                     Divisor("model.vocab_size", vocab, vocab, "vocabulary rows")),
        sequence_divisor=Divisor("model.seq_len", t, t, "sequence positions"),
        embedding_cost=float(d), block_costs=(float(block),) * cfg.n_layer,
        head_cost=float(shape.head_flops() + 5 * vocab), flops_per_token=flops_per_token(cfg))


def _recognise(model: nn.Module) -> ModelSpec | None:
    return gpt_spec(model.cfg) if isinstance(model, GPT) else None


def token_loss(logits: torch.Tensor, targets: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy over target positions != IGNORE_INDEX, and their count (a
    0-dim int64 tensor on the targets' device: reading it on the host would make a GPU
    step wait for its forward).

    logits: [B, T, V]; targets: [B, T]. The trainer divides by the global count.
    """
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(),
                           ignore_index=IGNORE_INDEX, reduction="sum")
    return loss, (targets != IGNORE_INDEX).sum()


def num_params(cfg: ModelConfig, *, embeddings: bool = True) -> int:
    """Parameter count of GPT(cfg) (tied head counted once)."""
    d, layers = cfg.d_model, cfg.n_layer
    per_block = 3 * d * d + (d * d + d) + (8 * d * d + 5 * d) + 4 * d
    n = layers * per_block + 2 * d
    if embeddings:
        n += cfg.vocab_size * d + cfg.seq_len * d
    return n


def flops_per_token(cfg: ModelConfig) -> int:
    """Training FLOPs per token (forward + backward = 3x forward): the planner's
    formula for this shape (:meth:`disttrain.shape.ModelShape.model_flops_per_token`:
    2 per weight of each matmul, the head's 2 d V, attention's 4 T d per layer; biases,
    norms and lookups are no multiply-adds)."""
    from ..shape import gpt_shape

    return gpt_shape(_costed(cfg)).model_flops_per_token()


def _costed(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` as the FLOPs formula reads it: the count does not depend on the number
    of heads (attention is 4 T d per layer however d is split), so one head stands in
    for a count the width does not divide, which the checks refuse naming the field
    (the spec exists before them)."""
    return cfg if cfg.d_model % cfg.n_head == 0 else dataclasses.replace(cfg, n_head=1)


register_spec(_recognise)
