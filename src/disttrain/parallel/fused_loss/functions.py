"""Fused linear + cross-entropy: the output head's matmul and the token loss together,
chunk by chunk over the tokens, so the [tokens, vocabulary] logits never exist whole.

For logits z_i = W h_i + b, target t_i and label smoothing e (``F.cross_entropy``'s):

    loss = sum over counted i of  lse(z_i) - (1 - e) z_i[t_i] - (e / V) sum_j z_i[j]
    d loss / d z_i = softmax(z_i) - (1 - e) onehot(t_i) - e / V      (0 on ignored rows)

The forward computes each chunk's gradient at once and keeps the gradients of h and W
([N, d], [V, d]) instead of the logits [N, V]; the backward only scales them. What it
holds and saves: ``docs/strategies/memory.md``, "The fused linear + cross-entropy".
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from typing import Any

import torch

from ...comm.collectives import Communicator, ReduceOp
from ...targets import IGNORE_INDEX

CHUNK_LOGIT_BYTES = 256 * 2**20
"""The default chunk holds at most this many bytes of fp32 logits (at least one token):
at vocabulary 50,304 that is 1,334 tokens per chunk (1,334 / tp ranks' rows each)."""


def default_chunk_tokens(n_tokens: int, vocab_rows: int) -> int:
    """Tokens per chunk: as many as :data:`CHUNK_LOGIT_BYTES` of fp32 logits over
    ``vocab_rows`` (this rank's vocabulary rows) allow, at least 1, at most all."""
    return max(1, min(n_tokens, CHUNK_LOGIT_BYTES // (4 * max(vocab_rows, 1))))


@dataclass(frozen=True, kw_only=True)
class ChunkedLoss:
    """What a fused loss computes besides its tensors: ``ignore_index`` (targets not
    counted), ``label_smoothing`` (e above), ``chunk`` (tokens per chunk),
    ``compute_dtype`` (of the matmuls: autocast's, or the weight's), ``comm`` (the tp
    group of a vocabulary-parallel head; None: the whole vocabulary here) and ``wants``
    (which of hidden, weight, bias need a gradient)."""

    ignore_index: int
    label_smoothing: float
    chunk: int
    compute_dtype: torch.dtype
    comm: Communicator | None
    wants: tuple[bool, bool, bool]

    @property
    def tp(self) -> int:
        return 1 if self.comm is None else self.comm.size

    @property
    def rank(self) -> int:
        return 0 if self.comm is None else self.comm.rank


class LinearCrossEntropyFn(torch.autograd.Function):
    """Summed cross-entropy of the logits hidden @ W^T + b, chunk by chunk.

    Forward: hidden [N, d], weight [V(/tp), d], bias [V(/tp)] or None, targets [N]
    (global ids) -> the summed loss, 0-dim fp32, the gradients of hidden, weight and
    bias computed on the way and kept. Backward: those gradients times the incoming
    gradient of the sum; no communication, no matmul. It runs once per forward
    (``retain_graph`` cannot reuse it), except that a run fed the very gradient tensor
    of the first (a zero-bubble pipeline's weight pass re-running this node with the
    gradient its input pass recorded) gets the same gradients again."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None, targets: torch.Tensor, how: ChunkedLoss
                ) -> torch.Tensor:
        loss, grads = _loss_and_grads(hidden.detach(), weight.detach(),
                                      None if bias is None else bias.detach(), targets, how)
        ctx.save_for_backward(*grads)
        ctx.spent = None  # the incoming gradient of the first backward
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.spent is not None and ctx.spent is not grad_loss:
            raise RuntimeError("the fused linear + cross-entropy's backward ran twice: its "
                               "gradients are computed once in forward (no retain_graph)")
        if ctx.spent is None:  # scaled in place, once: each is this forward's own tensor
            ctx.spent = grad_loss
            ctx.scaled = [None if g is None else g.mul_(grad_loss) for g in ctx.saved_tensors]
        grads = ctx.scaled
        return grads[0], grads[1], grads[2], None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         *, bias: torch.Tensor | None = None,
                         ignore_index: int = IGNORE_INDEX, label_smoothing: float = 0.0,
                         chunk_tokens: int | None = None, comm: Communicator | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed cross-entropy of the logits ``hidden @ weight^T + bias`` against
    ``targets`` over the positions != ``ignore_index``, their count) without the
    logits ever existing whole: what ``F.cross_entropy(logits.float(), targets,
    reduction="sum", ignore_index=..., label_smoothing=...)`` and ``(targets !=
    ignore_index).sum()`` give on the full logits.

    hidden: [..., d]; targets: [...] (the same leading dims, flattened to N tokens);
    weight: [V, d], or under vocabulary parallelism (``comm``: the tp group) this
    rank's rows [V/tp, d], rows [r V/tp, (r+1) V/tp) on rank r; bias: [V] or [V/tp].
    Vocabulary-parallel, per chunk of c tokens the row max is all-reduced (MAX) over
    [c], then the sum of exps, the target logit (non-zero only on its owner) and, with
    smoothing, the sum of the logits in one all-reduce of [2 or 3, c]; logits never
    travel. A rank's hidden-state gradient is the part from its own rows, which the
    copy-to-tp-region op before the head sums over tp (as for a column-parallel layer).
    Per chunk the logits are fp32, their matmul in autocast's dtype where autocast is on.
    The loss is a 0-dim fp32 tensor, the same on every tp rank; the count a 0-dim
    int64 tensor on the targets' device (never read on the host here). ``chunk_tokens``:
    tokens per chunk (default :func:`default_chunk_tokens`)."""
    d = hidden.shape[-1]
    flat_h, flat_t = hidden.reshape(-1, d), targets.reshape(-1)
    _check(flat_h, weight, bias, flat_t, label_smoothing, chunk_tokens)
    grad_on = torch.is_grad_enabled()
    how = ChunkedLoss(
        ignore_index=ignore_index, label_smoothing=float(label_smoothing),
        chunk=chunk_tokens or default_chunk_tokens(flat_h.shape[0], weight.shape[0]),
        compute_dtype=_compute_dtype(hidden, weight), comm=comm,
        wants=(grad_on and hidden.requires_grad, grad_on and weight.requires_grad,
               grad_on and bias is not None and bias.requires_grad))
    loss = LinearCrossEntropyFn.apply(flat_h, weight, bias, flat_t, how)
    return loss, (flat_t != ignore_index).sum()


def _check(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           targets: torch.Tensor, label_smoothing: float, chunk_tokens: int | None) -> None:
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight has shape {tuple(weight.shape)}; the hidden states' last "
                         f"dim is {hidden.shape[1]}: pass the head's [vocabulary, "
                         f"{hidden.shape[1]}] weight")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias has shape {tuple(bias.shape)}; the weight has "
                         f"{weight.shape[0]} rows: pass the head's own bias")
    if targets.shape[0] != hidden.shape[0]:
        raise ValueError(f"{targets.shape[0]} targets for {hidden.shape[0]} hidden states: "
                         "give targets of the hidden states' leading shape")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing={label_smoothing}: must lie in [0, 1]")
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens}: must be at least 1 (or None)")


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The matmuls' dtype: autocast's where it is on (F.linear's under autocast), else
    the tensors' own, which must agree (as F.linear requires)."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    if hidden.dtype != weight.dtype:
        raise TypeError(f"hidden states are {hidden.dtype} and the head's weight "
                        f"{weight.dtype}: make them one dtype, or run under autocast")
    return weight.dtype


def _loss_and_grads(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    targets: torch.Tensor, how: ChunkedLoss
                    ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """The summed loss and the gradients ``how.wants`` (hidden's in its dtype, weight's
    and bias's in theirs, summed in fp32) for a gradient of the sum of 1."""
    n, dtype = hidden.shape[0], how.compute_dtype
    want_h, want_w, want_b = how.wants
    with torch.autocast(hidden.device.type, enabled=False):
        h, w = hidden.to(dtype), weight.to(dtype)
        b = None if bias is None else bias.to(dtype)
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grads = _Grads(
            hidden=torch.empty_like(hidden) if want_h else None,
            weight=weight.new_zeros(weight.shape, dtype=torch.float32) if want_w else None,
            bias=weight.new_zeros(weight.shape[0], dtype=torch.float32) if want_b else None)
        for lo in range(0, n, how.chunk):
            loss += _chunk(h, w, b, targets, slice(lo, min(n, lo + how.chunk)), how, grads)
    return loss, [grads.hidden,
                  None if grads.weight is None else grads.weight.to(weight.dtype),
                  None if grads.bias is None or bias is None else grads.bias.to(bias.dtype)]


@dataclass(frozen=True)
class _Grads:
    """The gradients a forward accumulates (None: not wanted): hidden [N, d] in its
    dtype, weight [rows, d] and bias [rows] in fp32."""

    hidden: torch.Tensor | None
    weight: torch.Tensor | None
    bias: torch.Tensor | None


def _chunk(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, targets: torch.Tensor,
           rows: slice, how: ChunkedLoss, grads: _Grads) -> torch.Tensor:
    """The summed loss of tokens ``rows``, their gradients added into ``grads``. A
    function of its own so that the chunk's logits are freed before the next chunk's
    exist (one chunk of them at a time). The product is in the compute dtype; the
    softmax's arithmetic in fp32."""
    z = torch.mm(h[rows], w.t()) if b is None else torch.addmm(b, h[rows], w.t())
    wanted = any(g is not None for g in (grads.hidden, grads.weight, grads.bias))
    g: torch.Tensor | None
    if z.device.type in KERNEL_DEVICES:
        loss, g = _chunk_loss_fused(z, targets[rows], how, w.shape[0], grad=wanted)
    else:  # in place over the chunk's fp32 logits, which become the gradient
        g = z.float()
        loss = _chunk_loss(g, targets[rows], how, w.shape[0], grad=wanted)
    if g is None or not wanted:
        return loss
    if grads.bias is not None:
        grads.bias.add_(g.sum(0, dtype=torch.float32))
    if grads.hidden is None and grads.weight is None:
        return loss
    g = g.to(how.compute_dtype)  # the chunk's d loss / d logits [c, rows]
    if grads.hidden is not None:
        _into(grads.hidden[rows], g, w)
    if grads.weight is not None:
        _add_product(grads.weight, g.t(), h[rows])
    return loss


def _targets_here(targets: torch.Tensor, how: ChunkedLoss, rows: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For targets [c] (global ids) and this rank's ``rows`` of the vocabulary: which
    are counted [c], which are counted and in this rank's rows [c], and their column
    here [c, 1] (clamped where not here)."""
    valid = targets != how.ignore_index
    local = targets - how.rank * rows
    mine = valid & (local >= 0) & (local < rows)
    return valid, mine, local.clamp(0, rows - 1).unsqueeze(1)


def _global_max(row_max: torch.Tensor, how: ChunkedLoss) -> torch.Tensor:
    """The row max [c] over the whole vocabulary (MAX over the tp group): it only
    steadies exp(), so no gradient flows through it."""
    if how.comm is not None:
        how.comm.all_reduce(row_max, op=ReduceOp.MAX)
    return row_max


def _summed_loss(stats: torch.Tensor, valid: torch.Tensor, how: ChunkedLoss,
                 vocab: int) -> torch.Tensor:
    """The chunk's summed loss from this rank's [2 or 3, c] sums (exp(z - max), the
    target's z - max, with smoothing the sum of z - max), summed over the tp group in
    place, in one collective."""
    if how.comm is not None:
        how.comm.all_reduce(stats)
    eps = how.label_smoothing
    per_token = stats[0].log() - (1.0 - eps) * stats[1]
    if eps:
        per_token = per_token - (eps / vocab) * stats[2]
    return torch.where(valid, per_token, 0.0).sum()


def _chunk_loss(z: torch.Tensor, targets: torch.Tensor, how: ChunkedLoss, rows: int, *,
                grad: bool) -> torch.Tensor:
    """The chunk's summed loss from its logits ``z`` [c, rows] (fp32, this rank's
    rows), which become, in place, d loss / d z when ``grad`` (else exp(z - max))."""
    eps, vocab = how.label_smoothing, rows * how.tp
    valid, mine, index = _targets_here(targets, how, rows)
    row_max = _global_max(z.amax(dim=1), how)
    z.sub_(row_max.unsqueeze(1))
    target = torch.where(mine, z.gather(1, index).squeeze(1), 0.0)
    sums = [target, z.sum(dim=1)] if eps else [target]
    z.exp_()
    stats = torch.stack([z.sum(dim=1), *sums])
    loss = _summed_loss(stats, valid, how, vocab)
    if grad:
        z.div_(stats[0].unsqueeze(1))  # the softmax over the whole vocabulary
        z.scatter_add_(1, index, mine.unsqueeze(1).to(z.dtype).mul_(eps - 1.0))
        if eps:
            z.sub_(eps / vocab)
        z.mul_(valid.unsqueeze(1))
    return loss


KERNEL_DEVICES: tuple[str, ...] = ("cuda",)
"""Devices whose chunks go through :func:`_chunk_loss_fused` (on CUDA: two kernels that
inductor generates, a reduction and an elementwise pass over the chunk's logits in the
matmul's dtype). On the others the chunk's fp32 logits are reworked in place by
:func:`_chunk_loss` (eager, no compiler needed). Both compute the same values; tests add
"cpu" here to run the fused path's arithmetic eagerly on the CPU."""

COMPILE_DEVICES: tuple[str, ...] = ("cuda",)
"""Devices where :func:`_kernel` compiles the fused path's two functions (CUDA, whose
kernels Triton generates); tests add "cpu" (inductor's C++ backend) to count how often
they compile."""

_COMPILED: dict[tuple[str, str], Any] = {}


def _kernel(fn: Any, device: torch.device) -> Any:
    """``fn`` compiled by inductor where the device is in :data:`COMPILE_DEVICES` and
    inductor can generate its kernels (dynamo supported; on CUDA, Triton installed), else
    ``fn`` itself, run eagerly (the same values, with a few chunk-sized temporaries).
    The first chunk's shape compiles with static sizes; the first other row count (the
    last chunk, or another step's token count: chat data unpacked) compiles once more
    with the rows symbolic (dynamo's automatic dynamic shapes), which then serves every
    row count, so a run compiles each function at most twice, never once per length."""
    if device.type not in COMPILE_DEVICES or not _can_compile(device.type):
        return fn
    key = (fn.__name__, device.type)
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(fn, fullgraph=True)
    return _COMPILED[key]


@functools.cache
def _can_compile(kind: str) -> bool:
    import torch._dynamo

    if not torch._dynamo.is_dynamo_supported():
        return False
    return kind != "cuda" or importlib.util.find_spec("triton") is not None


def _exp_sums(z: torch.Tensor, row_max: torch.Tensor, with_sum: bool) -> torch.Tensor:
    """[1 or 2, c] fp32: per row the sum of exp(z - max) (and the sum of z - max), in
    one pass over ``z`` [c, rows] (any float dtype; the arithmetic in fp32)."""
    shifted = z.float() - row_max.unsqueeze(1)
    sums = [shifted.exp().sum(dim=1)]
    if with_sum:
        sums.append(shifted.sum(dim=1))
    return torch.stack(sums)


def _softmax_grad(z: torch.Tensor, row_max: torch.Tensor, sum_exp: torch.Tensor,
                  index: torch.Tensor, mine: torch.Tensor, valid: torch.Tensor,
                  eps: float, vocab: int) -> torch.Tensor:
    """d loss / d z [c, rows] in ``z``'s dtype, in one pass over ``z``: the softmax,
    minus 1 - eps at this rank's target column, minus eps / vocab; 0 on rows not
    counted."""
    columns = torch.arange(z.shape[1], device=z.device)
    hit = (columns.unsqueeze(0) == index) & mine.unsqueeze(1)
    g = (z.float() - row_max.unsqueeze(1)).exp() / sum_exp.unsqueeze(1)
    g = g - torch.where(hit, 1.0 - eps, 0.0) - eps / vocab
    return torch.where(valid.unsqueeze(1), g, 0.0).to(z.dtype)


def _chunk_loss_fused(z: torch.Tensor, targets: torch.Tensor, how: ChunkedLoss, rows: int,
                      *, grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`_chunk_loss`'s loss (and, when ``grad``, d loss / d z in ``z``'s dtype)
    from the chunk's logits ``z`` [c, rows] as the matmul gave them: the max, the exp
    sums and the gradient each one pass over ``z``, and no fp32 copy of it."""
    eps, vocab = how.label_smoothing, rows * how.tp
    valid, mine, index = _targets_here(targets, how, rows)
    row_max = _global_max(z.amax(dim=1).float(), how)  # the max is exact in any dtype
    target = torch.where(mine, z.gather(1, index).squeeze(1).float() - row_max, 0.0)
    sums = _kernel(_exp_sums, z.device)(z, row_max, bool(eps))
    stats = torch.cat([sums[:1], target.unsqueeze(0), sums[1:]])  # as _chunk_loss's
    loss = _summed_loss(stats, valid, how, vocab)
    if not grad:
        return loss, None
    g = _kernel(_softmax_grad, z.device)(z, row_max, stats[0], index, mine, valid, eps, vocab)
    return loss, g


def _into(out: torch.Tensor, g: torch.Tensor, w: torch.Tensor) -> None:
    """out [c, d] = g [c, rows] @ w [rows, d], kept in ``out``'s dtype."""
    if out.dtype == g.dtype:
        torch.mm(g, w, out=out)
    else:
        out.copy_(torch.mm(g, w))


def _add_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc (fp32) += a @ b: in place in fp32, else the product in the compute dtype
    (as the unfused head's weight gradient) added in fp32."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
    else:
        acc += torch.mm(a, b)
