"""Where a training step's time goes on one GPU: disttrain's Trainer beside the plain loop
of ``bench/gpu_mfu.py``, same model and shape, each profiled over a few steps.

    python scripts/gpu_profile.py [--steps 6] [--micro-batch 16] [--compile]
                                  [--trace-dir DIR]

For each side: wall time per step, the GPU's busy time per step (the union of its
kernels' intervals, from torch.profiler's trace), so the fraction of the step the GPU
idles; the host-device synchronisations per step (calls that wait for the GPU); and the
host operations that took the most time; the device time by kind of work (matmul,
attention, memory-bound, optimizer: each aten operator's own device time) beside the
planner's split of the same step on this GPU's preset. A diagnostic for a GPU session, not a
benchmark: the profiler's own overhead inflates host time. Prints a table, then one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import gpu_mfu  # noqa: E402  (the bench's model, data and plain loop)

from disttrain import Callback, Trainer  # noqa: E402
from disttrain.config import load_config  # noqa: E402
from disttrain.config.schema import ModelConfig  # noqa: E402
from disttrain.data import collate_token_batch  # noqa: E402
from disttrain.models import token_loss  # noqa: E402

WAIT, WARMUP = 4, 2  # untraced steps first: allocator, autotuning, compilation
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def busy_seconds(prof: profile) -> tuple[float, float, int]:
    """(GPU busy seconds: the union of kernel and memcpy intervals, the traced span's
    wall seconds, host calls that waited for the device) of the traced steps."""
    spans, syncs, lo, hi = [], 0, float("inf"), 0.0
    for e in prof.events():
        if (e.device_type == torch.autograd.DeviceType.CUDA
                and not getattr(e, "is_user_annotation", False)
                and not e.name.startswith("ProfilerStep")):  # annotations span steps
            spans.append((e.time_range.start, e.time_range.end))
        elif e.name in SYNC_CALLS:
            syncs += 1
        if e.name.startswith("ProfilerStep"):
            lo, hi = min(lo, e.time_range.start), max(hi, e.time_range.end)
    busy, end = 0.0, 0.0
    for s, t in sorted(spans):
        s, t = max(s, lo, end), min(t, hi)
        if t > s:
            busy += t - s
            end = t
    return busy / 1e6, (hi - lo) / 1e6, syncs


def _profiler(steps: int) -> profile:
    gpu = [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
    return profile(activities=[ProfilerActivity.CPU, *gpu],
                   schedule=schedule(wait=WAIT, warmup=WARMUP, active=steps, repeat=1))


class StepProfiler(Callback):
    def __init__(self, prof: profile) -> None:
        self.prof = prof

    def on_step_end(self, trainer, record) -> None:  # noqa: ANN001
        self.prof.step()


def profile_disttrain(cfg: ModelConfig, data, args) -> profile:  # noqa: ANN001
    steps = WAIT + WARMUP + args.steps
    config = load_config(values={
        "model": {k: getattr(cfg, k) for k in ("vocab_size", "seq_len", "n_layer",
                                                 "n_head", "d_model")},
        "train": {"steps": steps, "global_batch": args.micro_batch, "grad_accum": 1,
                  "lr": 6e-4, "warmup_steps": 0, "schedule": "constant",
                  "precision": "bf16", "log_every": steps, "device": args.device,
                  "compile": args.compile, "eval_samples": 1},
        "checkpoint": {"every": 0}, "monitor": {"tensorboard": False}})
    prof = _profiler(args.steps)
    with tempfile.TemporaryDirectory() as run_dir, prof:
        Trainer(gpu_mfu._model(cfg), data, token_loss, config, run_dir=run_dir,
                collate_fn=collate_token_batch, progress=False,
                callbacks=[StepProfiler(prof)]).fit()
    return prof


def profile_plain(cfg: ModelConfig, data, args) -> profile:  # noqa: ANN001
    gpu_mfu.DEVICE = torch.device(args.device)
    prof = _profiler(args.steps)
    ns = argparse.Namespace(warmup=0, steps=WAIT + WARMUP + args.steps, log_every=1,
                            micro_batch=args.micro_batch, compile=args.compile)
    original = gpu_mfu._synchronize

    def synchronize_and_step() -> None:  # the bench syncs around each window of 1 step
        original()
        if getattr(synchronize_and_step, "calls", 0) % 2 == 1:
            prof.step()
        synchronize_and_step.calls = getattr(synchronize_and_step, "calls", 0) + 1

    gpu_mfu._synchronize = synchronize_and_step
    try:
        with prof:
            gpu_mfu.run_plain(cfg, data, ns, args.micro_batch)
    finally:
        gpu_mfu._synchronize = original
    return prof


# the planner's kinds of work (StepTime.split), and the operators whose device time is
# each: the rest of the step's kernels (casts, copies, norms, activations, adds, the
# loss's passes) is memory-bound work
KINDS = ("matmul", "attention", "memory_bound", "optimizer")
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm")


def _kind(op: str) -> str:
    if op in MATMUL_OPS:
        return "matmul"
    if "attention" in op:  # cuDNN's, flash's, the memory-efficient kernels'
        return "attention"
    if "adam" in op or "foreach" in op:  # fused / foreach AdamW, clipping's norms
        return "optimizer"
    return "memory_bound"


def device_split(prof: profile, steps: int, device: str) -> dict[str, float]:
    """Milliseconds per step by kind of work: each operator's own device time (on the
    CPU dry run, its own host time), summed by :func:`_kind`."""
    out = dict.fromkeys(KINDS, 0.0)
    for avg in prof.key_averages():
        if device == "cuda":
            own = getattr(avg, "self_device_time_total", None)
            own = avg.self_cuda_time_total if own is None else own
        else:
            own = avg.self_cpu_time_total
        if own and avg.key.startswith(("aten::", "triton_")):  # inductor's: fused
            out[_kind(avg.key)] += own / 1e3 / steps             # elementwise work
    return {k: round(v, 2) for k, v in out.items()}


def planner_split(cfg: ModelConfig, micro_batch: int, device: str) -> dict[str, float]:
    """The planner's milliseconds per step by kind of work for the same model and
    micro-batch on one device: the preset of this GPU (on the CPU dry run, the h100
    preset, to run the code)."""
    from disttrain.plan import ModelShape, Options
    from disttrain.plan.cluster import PRESETS, preset_for_device
    from disttrain.plan.estimate import estimate
    from disttrain.plan.layout import PlannedLayout

    name = preset_for_device(torch.cuda.get_device_name()) if device == "cuda" else "h100"
    if name is None:
        return {}
    shape = ModelShape(name="gpt", layers=cfg.n_layer, hidden=cfg.d_model,
                       heads=cfg.n_head, seq=cfg.seq_len, vocab=cfg.vocab_size)
    cluster = replace(PRESETS[name], gpus_per_node=1)
    est = estimate(shape, cluster, PlannedLayout(mbs=micro_batch), micro_batch,
                   Options(precision="bf16"))
    return {"preset": name, **{k: round(1e3 * est.split.get(k, 0.0), 2)
                               for k in (*KINDS, "overhead")},
            "step_ms": round(1e3 * est.step_time_s, 2)}


def summarise(name: str, prof: profile, steps: int, tokens: int, device: str) -> dict:
    busy, span, syncs = busy_seconds(prof)
    row = {"side": name, "step_ms": round(1e3 * span / steps, 2),
           "gpu_busy_ms": round(1e3 * busy / steps, 2),
           "gpu_idle_fraction": round(1 - busy / span, 4) if span else None,
           "syncs_per_step": round(syncs / steps, 1),
           "tokens_per_s": round(tokens * steps / span, 1) if span else None,
           "kinds_ms": device_split(prof, steps, device)}
    print(f"--- {name}: top host operations over {steps} traced steps")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18,
                                    max_name_column_width=60))
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6, help="traced steps (6)")
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--trace-dir", default=None, help="write Chrome traces here")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: a dry run of this script at a tiny shape")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_profile: no CUDA device", file=sys.stderr)
        sys.exit(2)
    shape = (dict(vocab_size=50304, seq_len=1024, n_layer=12, n_head=12, d_model=768)
             if args.device == "cuda" else
             dict(vocab_size=512, seq_len=64, n_layer=2, n_head=2, d_model=64))
    cfg = ModelConfig(**shape, dropout=0.0)
    total = WAIT + WARMUP + args.steps
    data = gpu_mfu.RandomWindows(total * args.micro_batch, cfg.seq_len, cfg.vocab_size)
    tokens = args.micro_batch * cfg.seq_len
    rows = []
    for name, fn in (("disttrain", profile_disttrain), ("plain", profile_plain)):
        t0 = time.perf_counter()
        prof = fn(cfg, data, args)
        rows.append(summarise(name, prof, args.steps, tokens, args.device) | {
            "run_s": round(time.perf_counter() - t0, 1)})
        if args.trace_dir:
            Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(Path(args.trace_dir) / f"{name}.json"))
        if args.device == "cuda":
            torch.cuda.empty_cache()
    print(f"{'side':10} {'step ms':>8} {'gpu busy':>9} {'idle':>6} {'syncs':>6} {'tok/s':>10}")
    for r in rows:
        print(f"{r['side']:10} {r['step_ms']:8.2f} {r['gpu_busy_ms']:9.2f} "
              f"{r['gpu_idle_fraction'] or 0:6.3f} {r['syncs_per_step']:6.1f} "
              f"{r['tokens_per_s'] or 0:10.0f}")
    planned = planner_split(cfg, args.micro_batch, args.device)
    print(f"{'kind (ms/step)':16}" + "".join(f"{r['side']:>11}" for r in rows)
          + f"{'planner':>11}")
    for kind in KINDS:
        print(f"{kind:16}" + "".join(f"{r['kinds_ms'][kind]:11.2f}" for r in rows)
              + f"{planned.get(kind, float('nan')):11.2f}")
    print(json.dumps({"check": "gpu_profile", "compile": args.compile,
                      "micro_batch": args.micro_batch, "rows": rows, "planner": planned}))


if __name__ == "__main__":
    main()
