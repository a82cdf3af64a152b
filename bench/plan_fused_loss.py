"""The memory model's price of the fused linear + cross-entropy against torch's CPU
allocator, at a GPT-2 head: what the loss keeps from forward to backward and its
transient peak during the forward, predicted (``plan.memory.fused_loss_bytes``, what
the planner and the pre-launch check add) and measured.

    python bench/plan_fused_loss.py [--vocab 50304] [--tokens 8192] [--d-model 768]

Hidden states [tokens, d] and the head's weight [vocab, d] (fp32, both needing
gradients) and targets are made first; then the fused loss's forward runs once per
precision (fp32, and bf16 autocast) under ``torch.profiler`` with
``profile_memory=True``: the CPU allocator's records summed in time order give the
peak above the inputs, and what is left when the forward returns is what it keeps
(its two gradients and the 0-dim loss). Also printed: what the model priced before it
knew the fused loss (the full fp32 log-softmax [tokens, vocab] the unfused loss saves).
One JSON line; memory figures do not depend on the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from cpu_memory import peak_and_held  # noqa: E402 - bench/ is not a package

from disttrain.parallel.fused_loss import default_chunk_tokens, linear_cross_entropy
from disttrain.plan.memory import fused_loss_bytes

_MIB = 2**20


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--d-model", type=int, default=768)
    return p.parse_args()


def measure(args: argparse.Namespace, precision: str) -> dict:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.d_model, generator=g).requires_grad_()
    weight = (torch.randn(args.vocab, args.d_model, generator=g) * 0.02).requires_grad_()
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=g)

    def forward() -> torch.Tensor:  # the loss (its graph holds the kept gradients)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            return linear_cross_entropy(hidden, weight, targets)[0]

    peak, left, loss = peak_and_held(forward)
    del loss
    kept, transient = fused_loss_bytes(args.tokens, args.vocab, args.d_model,
                                       compute=4 if precision == "fp32" else 2)
    return {"measured_kept_mib": round(left / _MIB, 1),
            "predicted_kept_mib": round(kept / _MIB, 1),
            "measured_transient_mib": round((peak - left) / _MIB, 1),
            "predicted_transient_mib": round(transient / _MIB, 1),
            "measured_peak_mib": round(peak / _MIB, 1),
            "predicted_peak_mib": round((kept + transient) / _MIB, 1),
            "peak_rel_error": round((kept + transient) / peak - 1, 4)}


def main() -> None:
    args = parse_args()
    rows = {p: measure(args, p) for p in ("fp32", "bf16")}
    for p, row in rows.items():
        print(f"{p}: {row}", file=sys.stderr)
    print(json.dumps({
        "bench": "plan_fused_loss", "vocab": args.vocab, "tokens": args.tokens,
        "d_model": args.d_model,
        "chunk_tokens": default_chunk_tokens(args.tokens, args.vocab), **rows,
        "priced_before_mib": round(4 * args.tokens * args.vocab / _MIB, 1),
        "memory_method": "torch.profiler profile_memory: CPU allocator records summed "
                         "in time order; kept = held when the forward returns",
        "torch": torch.__version__, "machine": f"{os.cpu_count()} cpu cores"}))


if __name__ == "__main__":
    main()
