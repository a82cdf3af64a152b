"""The models, data and two tensor-parallel set-ups that ``bench/tp_vs_dtensor.py``
times and ``tests/parallel/test_tp_vs_dtensor.py`` checks, so the test proves what
the bench measures.

- :func:`build_model`: disttrain's GPT (tied head, learned positions, fused q|k|v) or a
  transformers Llama (separate q/k/v, SwiGLU MLP, RMSNorm, rotary), the same weights
  for the same seed; dropout 0, so tensor parallelism computes the full model.
- :func:`disttrain_step`: :func:`disttrain.parallel.tensor.apply_tensor_parallel` with
  the model's own plan, its vocabulary-parallel cross-entropy and the tp sum of the
  replicated gradients that are partial per rank.
- :func:`dtensor_step`: torch's DTensor tensor parallelism
  (``torch.distributed.tensor.parallel.parallelize_module``) as torch's tutorial and
  torchtitan set it up: column-wise q/k/v and MLP input, row-wise output projections,
  a row-wise (vocabulary-sharded) embedding, a column-wise head whose logits stay
  vocabulary-sharded DTensors and a loss under ``loss_parallel()``; under sequence
  parallelism ``SequenceParallel`` norms, ``PrepareModuleInput`` gathering the
  sequence in front of attention and MLP, row-wise outputs reduce-scattered to
  ``Shard(1)`` and the embedding reduce-scattered straight to ``Shard(1)``.

A step is: zero the gradients, forward, summed token cross-entropy / token count,
backward, (disttrain: the partial gradients' tp sum), AdamW. Both use the same AdamW
(foreach, lr :data:`LR`); on the DTensor side its DTensor and plain parameters (those no
style touched) go in two groups, as a foreach kernel takes one tensor type per list.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from disttrain.comm import CollectiveLedger, Communicator
from disttrain.config.schema import ModelConfig
from disttrain.models import GPT
from disttrain.models.hf import build_hf_model
from disttrain.parallel.tensor import apply_tensor_parallel
from disttrain.spec import output_logits

MODELS = ("gpt", "llama")
LR = 1e-3
# step(input_ids [B, T], targets [B, T]) -> the step's mean token loss (detached)
Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def model_config(kind: str, *, d_model: int, n_layer: int, n_head: int, seq_len: int,
                 vocab_size: int = 256) -> ModelConfig:
    """The [model] section of either model: the same dimensions, dropout 0."""
    return ModelConfig(name=kind, d_model=d_model, n_layer=n_layer, n_head=n_head,
                       seq_len=seq_len, vocab_size=vocab_size, dropout=0.0)


def build_model(cfg: ModelConfig, seed: int = 0) -> nn.Module:
    """The full model, initialised from torch's seed ``seed`` (same on every rank)."""
    torch.manual_seed(seed)
    return GPT(cfg) if cfg.name == "gpt" else build_hf_model(cfg)


def batches(cfg: ModelConfig, micro_batch: int, n: int, seed: int = 1
            ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` (input_ids, targets) pairs [micro_batch, seq_len], the same on every rank
    (tensor parallelism: the whole tp group works on one batch)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (n, micro_batch, cfg.seq_len + 1), generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW (foreach) with DTensor and plain parameters in separate groups."""
    params = list(model.parameters())
    groups = [[p for p in params if isinstance(p, DTensor)],
              [p for p in params if not isinstance(p, DTensor)]]
    return torch.optim.AdamW([{"params": g} for g in groups if g], lr=LR, foreach=True)


# ---- disttrain -------------------------------------------------------------------------

def disttrain_step(model: nn.Module, *, sequence_parallel: bool) -> Step:
    """Shard ``model`` in place over the world with disttrain's tensor parallelism."""
    comm = Communicator(None, CollectiveLedger(), "tp")
    tp = apply_tensor_parallel(model, comm, sequence_parallel=sequence_parallel)
    opt = _adamw(model)

    def step(ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss_sum, count = tp.loss_fn(output_logits(model(ids)), targets)
        loss = loss_sum / count
        loss.backward()
        tp.sync_replicated_grads()
        opt.step()
        return loss.detach()
    return step


# ---- torch DTensor ---------------------------------------------------------------------

def dtensor_step(model: nn.Module, mesh: DeviceMesh, *, sequence_parallel: bool) -> Step:
    """Shard ``model`` in place over ``mesh`` (1-D, the tp group) with DTensor."""
    if isinstance(model, GPT):
        _gpt_dtensor(model, mesh, sequence_parallel)
    elif sequence_parallel:
        raise ValueError("the Llama baseline runs without sequence parallelism: "
                         "disttrain's Llama plan has none to compare with")
    else:
        _llama_dtensor(model, mesh)
    opt = _adamw(model)

    def step(ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        logits = output_logits(model(ids))  # a DTensor [B, T, V], Shard(2)
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            loss.backward()
        opt.step()
        return loss.full_tensor().detach() if isinstance(loss, DTensor) else loss.detach()
    return step


def _head_style(sequence_parallel: bool) -> ColwiseParallel:
    """The output head: vocabulary-sharded logits left as DTensors for loss_parallel."""
    return ColwiseParallel(input_layouts=Shard(1) if sequence_parallel else Replicate(),
                           output_layouts=Shard(-1), use_local_output=False)


def _gpt_dtensor(model: GPT, mesh: DeviceMesh, sp: bool) -> None:
    tp = mesh.size()
    for block in model.blocks:
        _group_qkv_by_rank(block.attn.qkv, tp)
        parallelize_module(block, mesh, _gpt_block_plan(sp))
    top: dict[str, ParallelStyle] = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(),
                                   output_layouts=Shard(1) if sp else Replicate()),
        "head": _head_style(sp)}
    if sp:  # the position table's rows of this rank's positions, added to its tokens
        top["pos_emb"] = PrepareModuleOutput(output_layouts=Replicate(),
                                             desired_output_layouts=Shard(0))
        top["ln_f"] = SequenceParallel()
    parallelize_module(model, mesh, top)
    model.head.weight = model.tok_emb.weight  # re-tie: both Shard(0) over the vocabulary


def _gpt_block_plan(sp: bool) -> dict[str, ParallelStyle]:
    row_out = Shard(1) if sp else Replicate()
    plan: dict[str, ParallelStyle] = {
        "attn.qkv": ColwiseParallel(), "attn.out": RowwiseParallel(output_layouts=row_out),
        "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel(output_layouts=row_out)}
    if sp:
        gather = PrepareModuleInput(input_layouts=(Shard(1),),
                                    desired_input_layouts=(Replicate(),))
        plan |= {"ln1": SequenceParallel(), "attn": gather, "ln2": SequenceParallel(),
                 "mlp": copy.copy(gather)}
    return plan


@torch.no_grad()
def _group_qkv_by_rank(qkv: nn.Linear, tp: int) -> None:
    """Reorder the fused projection's rows [q; k; v] to [q_0; k_0; v_0; q_1; ...] so
    that ColwiseParallel's contiguous Shard(0) gives rank r its own heads' q, k and v
    (the model's forward splits its local output in three): DTensor has no style for
    a fused projection; the function computed is unchanged."""
    parts = [p.chunk(tp, dim=0) for p in qkv.weight.chunk(3, dim=0)]
    qkv.weight.copy_(torch.cat([parts[j][r] for r in range(tp) for j in range(3)]))


def _llama_dtensor(model: nn.Module, mesh: DeviceMesh) -> None:
    layer: dict[str, ParallelStyle] = {
        **{f"self_attn.{n}_proj": ColwiseParallel() for n in "qkv"},
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel()}
    inner: Any = model.get_submodule("model")
    for block in inner.layers:
        parallelize_module(block, mesh, layer)
    parallelize_module(model, mesh, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(),
                                              output_layouts=Replicate()),
        "lm_head": _head_style(False)})
