"""Peak memory and time of the output head + loss, forward and backward: the fused
linear + cross-entropy against ``F.linear`` then ``F.cross_entropy`` on the full logits.

    python bench/fused_loss.py [--vocab 50304] [--tokens 8192] [--d-model 768]

Hidden states [tokens, d] and the head's weight [vocab, d] (fp32, both needing
gradients) and targets (every 10th ignored) are made first; then each variant runs
forward and backward once under ``torch.profiler`` with ``profile_memory=True``: the
allocator's ``[memory]`` records (every allocation and free of the CPU allocator, in
bytes, signed) summed in time order give the peak of memory allocated above what
existed when the variant started (the inputs), gradients included. Each variant then
runs ``--reps`` more times outside the profiler, timed (the best run counts). One JSON
line: both peaks, the fused one over the unfused one against the target (<= 0.25), the
time ratio, and the two losses' relative difference.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from cpu_memory import peak_bytes  # noqa: E402 - bench/ is not a package

from disttrain.parallel.fused_loss import default_chunk_tokens, linear_cross_entropy
from disttrain.targets import IGNORE_INDEX

TARGET_PEAK_RATIO = 0.25


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--reps", type=int, default=2, help="timed runs per variant")
    return p.parse_args()


def _inputs(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.d_model, generator=g).requires_grad_()
    weight = (torch.randn(args.vocab, args.d_model, generator=g) * 0.02).requires_grad_()
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=g)
    targets[::10] = IGNORE_INDEX
    return hidden, weight, targets


def unfused(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> float:
    logits = F.linear(hidden, weight)
    loss = F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX,
                           reduction="sum")
    del logits
    loss.backward()
    return loss.item()


def fused(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> float:
    loss, _ = linear_cross_entropy(hidden, weight, targets, ignore_index=IGNORE_INDEX)
    loss.backward()
    return loss.item()


def fresh(fn: Callable[..., float], inputs: tuple[torch.Tensor, ...]) -> Callable[[], float]:
    """One forward + backward of ``fn`` on ``inputs``, their gradients cleared first."""
    def run() -> float:
        for t in inputs[:2]:
            t.grad = None
        return fn(*inputs)
    return run


def best_seconds(fn: Callable[..., float], inputs: tuple[torch.Tensor, ...], reps: int
                 ) -> float:
    times = []
    for _ in range(reps):
        for t in inputs[:2]:
            t.grad = None
        t0 = time.perf_counter()
        fn(*inputs)
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    args = parse_args()
    inputs = _inputs(args)
    peaks, losses, seconds = {}, {}, {}
    for name, fn in (("unfused", unfused), ("fused", fused)):
        peaks[name], losses[name] = peak_bytes(fresh(fn, inputs))
        seconds[name] = best_seconds(fn, inputs, args.reps)
        print(f"{name}: peak {peaks[name] / 2**20:.1f} MiB, {seconds[name]:.2f} s",
              file=sys.stderr)
    ratio = peaks["fused"] / peaks["unfused"]
    print(json.dumps({
        "bench": "fused_loss", "vocab": args.vocab, "tokens": args.tokens,
        "d_model": args.d_model, "dtype": "fp32",
        "chunk_tokens": default_chunk_tokens(args.tokens, args.vocab),
        "full_logits_mib": round(args.tokens * args.vocab * 4 / 2**20, 1),
        "unfused_peak_mib": round(peaks["unfused"] / 2**20, 1),
        "fused_peak_mib": round(peaks["fused"] / 2**20, 1),
        "peak_ratio": round(ratio, 4), "target_peak_ratio": TARGET_PEAK_RATIO,
        "target_met": ratio <= TARGET_PEAK_RATIO,
        "unfused_s": round(seconds["unfused"], 3), "fused_s": round(seconds["fused"], 3),
        "time_ratio": round(seconds["fused"] / seconds["unfused"], 4),
        "loss_rel_diff": abs(losses["fused"] - losses["unfused"]) / abs(losses["unfused"]),
        "memory_method": "torch.profiler profile_memory: CPU allocator records summed "
                         "in time order, peak above the inputs",
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "machine": f"{os.cpu_count()} cpu cores"}))


if __name__ == "__main__":
    main()
