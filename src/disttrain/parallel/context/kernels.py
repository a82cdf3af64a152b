"""Attention of one block pair (a rank's queries against one key/value block), with the
per-row log-sum-exp the ring merges on.

For q [B, H, tq, Dh] and k, v [B, H_kv, tk, Dh] (query head h reads key head
h // (H / H_kv)), S = scale q k^T, optionally causal (a diagonal block: row r sees
columns <= r):

    forward:  lse = logsumexp_j S,  out = softmax(S) v        (out [B, H, tq, Dh], lse [B, H, tq])
    backward: P = exp(S - lse), D = rowsum(dout * out),
              dv = P^T dout, dS = P (dout v^T - D), dq = scale dS k, dk = scale dS^T q

Given the whole row's lse and out (all blocks merged), a block's backward is its exact
share of the gradients, so the ring recomputes only each block's scores. Kernels (see
:func:`default_kernel`; why CUDA's fused ones are not wired in:
``docs/strategies/context.md``).
"""

from __future__ import annotations

from typing import Literal

import torch

Kernel = Literal["fused", "math"]
KERNELS: tuple[Kernel, ...] = ("fused", "math")
SCORE_BYTES = 64 * 2**20  # fp32 scores one slice of query rows may hold in "math"

_aten = torch.ops.aten


def default_kernel(device: torch.device) -> Kernel:
    """``"fused"`` on the CPU, ``"math"`` elsewhere. ``"fused"``: torch's CPU
    flash-attention kernels (what CPU SDPA itself runs: they return the lse, take
    grouped-query heads as they are and never hold a [tq, tk] score matrix); ``"math"``:
    the formulas above in fp32 arithmetic on any device, over slices of query rows whose
    scores stay under :data:`SCORE_BYTES`, grouped heads matched by a reshape."""
    return "fused" if device.type == "cpu" else "math"


def check_kernel(kernel: str, device: torch.device) -> Kernel:
    """``kernel`` if it runs on ``device``; a ValueError with the choices otherwise."""
    if kernel == "math":
        return "math"
    if kernel == "fused" and device.type == "cpu":
        return "fused"
    raise ValueError(f"attention kernel {kernel!r} does not run on {device}: use 'math'"
                     + (" or 'fused' (CPU only)" if kernel != "fused" else ""))


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  scale: float, kernel: Kernel) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, H, tq, Dh], lse [B, H, tq] fp32) of one block pair; out in q's dtype
    ("fused") or fp32 ("math")."""
    if kernel == "fused":
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale)
        return out, lse
    return _math_forward(q, k, v, causal, scale)


def block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float,
                   kernel: Kernel) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one block pair, shaped as q, k, v (in their dtype for "fused",
    fp32 for "math"), given the whole rows' ``out`` (q's dtype) and ``lse`` (fp32)."""
    if kernel == "fused":
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale)
        return dq, dk, dv
    return _math_backward(dout, q, k, v, out, lse, causal, scale)


def _grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, H, t, Dh] -> [B, H_kv, g, t, Dh] (g = H / H_kv query heads per key head)."""
    b, h, t, d = x.shape
    return x.view(b, kv_heads, h // kv_heads, t, d)


def _row_slices(q: torch.Tensor, tk: int) -> list[slice]:
    """Slices of q's rows whose fp32 scores [B, H, rows, tk] fit in SCORE_BYTES."""
    b, h, tq, _ = q.shape
    rows = max(1, SCORE_BYTES // (4 * b * h * max(tk, 1)))
    return [slice(s, min(s + rows, tq)) for s in range(0, tq, rows)]


def _scores(qs: torch.Tensor, k: torch.Tensor, rows: slice, causal: bool,
            scale: float) -> torch.Tensor:
    """scale q k^T [B, H_kv, g, r, tk] (fp32) for rows ``rows``, -inf above the
    diagonal when ``causal``."""
    s = torch.matmul(qs, k.transpose(-1, -2)) * scale
    if causal:
        r = torch.arange(rows.start, rows.stop, device=s.device).unsqueeze(1)
        c = torch.arange(s.shape[-1], device=s.device).unsqueeze(0)
        s = s.masked_fill(c > r, float("-inf"))
    return s


def _math_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    kv_heads = k.shape[1]
    kf, vf = k.float().unsqueeze(2), v.float().unsqueeze(2)  # [B, H_kv, 1, tk, Dh]
    qg = _grouped(q, kv_heads)
    out = torch.empty(*qg.shape[:-1], v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.empty(qg.shape[:-1], dtype=torch.float32, device=q.device)
    for rows in _row_slices(q, k.shape[2]):
        s = _scores(qg[:, :, :, rows].float(), kf, rows, causal, scale)
        lse[..., rows] = torch.logsumexp(s, dim=-1)
        out[..., rows, :] = torch.matmul(torch.exp(s - lse[..., rows, None]), vf)
    return out.flatten(1, 2), lse.flatten(1, 2)


def _math_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    kv_heads = k.shape[1]
    kf, vf = k.float().unsqueeze(2), v.float().unsqueeze(2)
    qg, dog = _grouped(q, kv_heads), _grouped(dout, kv_heads)
    lse_g = lse.view(*qg.shape[:-1])
    d_rows = (dog.float() * _grouped(out, kv_heads).float()).sum(-1)  # D [B, H_kv, g, tq]
    dq = torch.empty(qg.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
    for rows in _row_slices(q, k.shape[2]):
        qs, dos = qg[:, :, :, rows].float(), dog[:, :, :, rows].float()
        p = torch.exp(_scores(qs, kf, rows, causal, scale) - lse_g[..., rows, None])
        dv += torch.matmul(p.transpose(-1, -2), dos).sum(2)
        ds = p * (torch.matmul(dos, vf.transpose(-1, -2)) - d_rows[..., rows, None])
        dq[..., rows, :] = torch.matmul(ds, kf) * scale
        dk += torch.matmul(ds.transpose(-1, -2), qs).sum(2) * scale
    return dq.flatten(1, 2), dk, dv
