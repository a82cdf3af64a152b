"""Pipeline schedules on real ranks: measured bubble against the analytic one, and
activation memory of 1F1B against GPipe and of ZB-H1 against 1F1B.

    python bench/pipeline.py [--pp 2,4] [--m-per-pp 1,2,4] [--v 2] [--reps 3] [--d-model 256]

For p in --pp, one spawn of p Gloo ranks (one torch thread each) runs GPipe, 1F1B,
interleaved 1F1B (v chunks per rank) and the zero-bubble zb1 (ZB-H1) and zbv (a V of
2 chunks per rank) for m = k p micro-batches, k in --m-per-pp, on a uniform stack: a
GPT of p v equal blocks (small vocabulary so the embedding and head are cheap), cut
into equal chunks. Each step's per-action timings give each stage's bubble, 1 - busy /
span (span: first action start to last action end over all stages; busy: the stage's
compute, excluding the time blocked on receives), averaged over stages; a case's
bubble is the median over --reps steps. The same cases run again with "sleep" blocks:
a sleep of F in forward, and in backward one of B on the input's path and one of W on
a parameter's (F = B = W, the fused backward 2 F), so no CPU contention: they check the
runner and schedule alone (``overhead_ms``: each action kind's median time beyond its
sleeps, and the runner's time between actions). The zero-bubble paper's figure, idle
over busy time ``(p-1)/3m`` for ZB-H1, is ``bubble / (1 - bubble)`` here. Prints one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from disttrain.comm import CollectiveLedger, Communicator
from disttrain.config.schema import ModelConfig
from disttrain.models import GPT, gpt_spec, token_loss
from disttrain.parallel.pipeline import (
    analytic_bubble,
    bubble_fractions,
    build_chunks,
    build_schedule,
    plan_stages,
    run_pipeline,
    simulate,
    sync_tied_grads,
)
from disttrain.testing import run_distributed

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved", "zb1", "zbv")
CHUNKS = {"interleaved": None, "zbv": 2}  # chunks per rank (None: --v), else 1


class _SleepIdentity(torch.autograd.Function):
    """Identity that sleeps ``forward_s`` in forward and ``backward_s`` in backward
    (applied to a parameter: the W pass's sleep)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        time.sleep(forward_s)
        ctx.backward_s = backward_s
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.backward_s)
        return grad.clone(), None, None


class SleepBlock(nn.Module):
    """A block [B, T, d] -> [B, T, d] of fixed duration: ``x + w`` for a [1, 1]
    parameter w (zero), sleeping ``forward_s`` in forward, ``input_s`` for the input's
    gradient and ``weight_s`` for the weight's. w is a matrix: a split backward
    computes a vector parameter's gradient in B, a matrix's in W."""

    def __init__(self, forward_s: float, input_s: float, weight_s: float) -> None:
        super().__init__()
        self.forward_s, self.input_s, self.weight_s = forward_s, input_s, weight_s
        self.weight = nn.Parameter(torch.zeros(1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (_SleepIdentity.apply(x, self.forward_s, self.input_s)
                + _SleepIdentity.apply(self.weight, 0.0, self.weight_s))


def _model(cfg: ModelConfig, work: str, sleep_ms: float) -> GPT:
    torch.manual_seed(0)
    model = GPT(cfg)
    if work == "sleep":
        model.blocks = nn.ModuleList(SleepBlock(*(sleep_ms / 1e3,) * 3)
                                     for _ in model.blocks)
    return model


def _message_latency(comm: Communicator, shape: tuple[int, ...], n: int = 20) -> float:
    """Median one-way time of one activation message between pp ranks 0 and 1."""
    x, times = torch.zeros(shape), []
    for i in range(n if comm.rank < 2 else 0):
        t0 = time.perf_counter()
        if comm.rank == 0:
            comm.isend(x, 1, i).wait()
            comm.irecv(x, 1, i).wait()
        else:
            comm.irecv(x, 0, i).wait()
            comm.isend(x, 0, i).wait()
        times.append((time.perf_counter() - t0) / 2)
    return comm.all_gather_object(statistics.median(times) if times else None)[0]


def _simulated_bubble(comm: Communicator, schedule, timings: list, latency: float) -> float:
    """The schedule's mean stage bubble in the simulator, fed this step's median
    forward, backward (B) and weight-pass (W) times (over all stages) and the message
    latency."""
    durations = [(t.action.kind, t.end - t.start) for t in timings]
    everyone = [d for part in comm.all_gather_object(durations) for d in part]
    f = statistics.median(d for kind, d in everyone if kind == "F")
    b = statistics.median(d for kind, d in everyone if kind == "B")
    w = statistics.median(d for kind, d in everyone if kind == "W") if schedule.split \
        else 0.0
    bubbles = bubble_fractions(simulate(schedule, forward_time=f, backward_time=b + w,
                                        weight_time=w, message_time=latency))
    return statistics.fmean(bubbles)


def _step_spans(comm: Communicator, timings: list) -> list[tuple[float, float, float]]:
    """Every stage's (busy, first start, last end) for one step."""
    mine = (sum(t.end - t.start for t in timings), timings[0].start, timings[-1].end)
    return comm.all_gather_object(mine)


def _overhead_ms(comm: Communicator, timings: list, schedule, sleep_s: float) -> dict:
    """Median time per action kind beyond its blocks' sleeps (``sleep_s``: a chunk's
    forward), and between actions beyond the receive wait: the runner's own cost."""
    sleeps = {"F": 1, "B": 1 if schedule.split else 2, "W": 1}  # sleeps of sleep_s
    mine = [(t.action.kind, t.end - t.start - sleeps[t.action.kind] * sleep_s)
            for t in timings]
    mine += [("between", b.start - b.wait - a.end)
             for a, b in zip(timings[:-1], timings[1:], strict=True)]
    everyone = [d for part in comm.all_gather_object(mine) for d in part]
    return {kind: round(1e3 * statistics.median(d for k, d in everyone if k == kind), 3)
            for kind in ("F", "B", "W", "between") if any(k == kind for k, _ in everyone)}


def _case(model: GPT, cfg: ModelConfig, comm: Communicator, name: str, m: int, v: int,
          latency: float, work: str, args: argparse.Namespace) -> dict:
    pp = comm.size
    v = CHUNKS.get(name, 1) or v
    per_chunk = cfg.n_layer // (pp * v)
    spec = gpt_spec(cfg)
    plan = plan_stages(spec, pp=pp, v=v, cuts=range(per_chunk, cfg.n_layer, per_chunk),
                       vshape=name == "zbv")
    chunks = build_chunks(model, spec, plan, comm.rank)
    schedule = build_schedule(name, pp=pp, m=m, v=v)
    g = torch.Generator().manual_seed(m)
    tokens = torch.randint(0, cfg.vocab_size, (m, args.micro_batch, cfg.seq_len + 1),
                           generator=g)
    batches = [(t[:, :-1], t[:, 1:]) for t in tokens]
    bubbles, simulated, steps, peak, overhead = [], [], [], 0, []
    if cfg.n_layer % (pp * v):
        return {"schedule": name, "p": pp, "v": v, "m": m, "skipped": "n_layer % (p v)"}
    for rep in range(1 + args.reps):  # one warmup step
        for ch in chunks:
            ch.zero_grad(set_to_none=True)
        dist.barrier()
        result = run_pipeline(chunks, batches, token_loss, comm, schedule,
                              activation_shape=(args.micro_batch, cfg.seq_len, cfg.d_model),
                              loss_scale=1.0 / (m * args.micro_batch * cfg.seq_len),
                              measure_activations=True)
        sync_tied_grads(chunks, comm)
        spans = _step_spans(comm, result.timings)
        peak = max(peak, result.peak_activation_bytes or 0)
        if rep:
            span = max(s[2] for s in spans) - min(s[1] for s in spans)
            bubbles.append([1 - busy / span for busy, _, _ in spans])
            steps.append(span)
            simulated.append(_simulated_bubble(comm, schedule, result.timings, latency))
            if work == "sleep":
                overhead.append(_overhead_ms(comm, result.timings, schedule,
                                             per_chunk * args.sleep_ms / 1e3))
    per_stage = [statistics.median(b[s] for b in bubbles) for s in range(pp)]
    measured = statistics.median(statistics.fmean(b) for b in bubbles)
    return {"schedule": name, "p": pp, "v": v, "m": m,
            "bubble_measured": round(measured, 4),
            "idle_over_busy_measured": round(measured / (1 - measured), 4),
            "bubble_per_stage": [round(b, 4) for b in per_stage],
            "bubble_analytic": round(analytic_bubble(name, pp, m, v), 4),
            "bubble_simulated": round(statistics.median(simulated), 4),
            "step_s": round(statistics.median(steps), 4),
            "peak_activation_bytes": comm.all_gather_object(peak),
            **({"overhead_ms": {k: statistics.median(o[k] for o in overhead)
                                for k in overhead[0]}} if overhead else {})}


def _bench(work: str, args: argparse.Namespace) -> list[dict]:
    pp = dist.get_world_size()
    cfg = ModelConfig(vocab_size=64, seq_len=args.seq_len, n_layer=pp * args.v,
                      n_head=4, d_model=args.d_model)
    model = _model(cfg, work, args.sleep_ms)
    comm = Communicator(None, CollectiveLedger(), name="pp")
    latency = _message_latency(comm, (args.micro_batch, cfg.seq_len, cfg.d_model))
    out = []
    for k in args.m_per_pp:
        for name in args.schedules:
            case = _case(model, cfg, comm, name, k * pp, args.v, latency, work, args)
            case.update(work=work, message_latency_s=round(latency, 5))
            if dist.get_rank() == 0:
                print(f"[pipeline] {json.dumps(case)}", file=sys.stderr, flush=True)
            out.append(case)
    return out


def _summary(cases: list[dict]) -> dict:
    cases[:] = [c for c in cases if "skipped" not in c]
    for c in cases:
        c["bubble_rel_error"] = round(
            abs(c["bubble_measured"] - c["bubble_analytic"]) / c["bubble_analytic"], 4)
    by_key = {(c["work"], c["p"], c["m"], c["schedule"]): c for c in cases}
    ratios = [max(c["peak_activation_bytes"])
              / max(by_key[("gpt", c["p"], c["m"], "gpipe")]["peak_activation_bytes"])
              for c in cases if c["work"] == "gpt" and c["schedule"] == "1f1b"
              and c["m"] > c["p"] and ("gpt", c["p"], c["m"], "gpipe") in by_key]
    gpt = [c["bubble_rel_error"] for c in cases if c["work"] == "gpt"]
    sleep = [c["bubble_rel_error"] for c in cases if c["work"] == "sleep"]
    vs_sim = [abs(c["bubble_measured"] - c["bubble_simulated"]) / c["bubble_simulated"]
              for c in cases if c["work"] == "sleep"]
    return {**_zero_bubble_summary(by_key),
            "max_bubble_rel_error": max(gpt) if gpt else None,
            "max_bubble_rel_error_sleep": max(sleep) if sleep else None,
            "max_rel_error_vs_simulated_sleep": round(max(vs_sim), 4) if vs_sim else None,
            "onef1b_vs_gpipe_activation_memory": round(max(ratios), 4) if ratios else None}


def _zero_bubble_summary(by_key: dict) -> dict:
    """The issue's targets at p = 4, m = 8 (sleep stages, F = B = W): ZB-H1's idle over
    busy time against (p-1)/3m, ZBV's bubble against 1F1B's; and ZB-H1's activation
    memory (most bytes saved for backward on any rank, GPT stages) against 1F1B's."""
    out: dict[str, float | None] = {}
    zb1, zbv, onef1b = (by_key.get(("sleep", 4, 8, s)) for s in ("zb1", "zbv", "1f1b"))
    if zb1:
        want = 3 / (3 * 8)
        out["zb1_idle_over_busy_p4_m8"] = zb1["idle_over_busy_measured"]
        out["zb1_rel_error_vs_paper_p4_m8"] = round(
            abs(zb1["idle_over_busy_measured"] - want) / want, 4)
    if zbv and onef1b:
        out["zbv_over_1f1b_bubble_p4_m8"] = round(
            zbv["bubble_measured"] / onef1b["bubble_measured"], 4)
    ratios = [max(c["peak_activation_bytes"])
              / max(by_key[("gpt", c["p"], c["m"], "1f1b")]["peak_activation_bytes"])
              for c in by_key.values() if c["work"] == "gpt" and c["schedule"] == "zb1"
              and ("gpt", c["p"], c["m"], "1f1b") in by_key]
    out["zb1_vs_1f1b_activation_memory"] = round(max(ratios), 4) if ratios else None
    return out


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p.add_argument("--pp", type=ints, default=[2, 4], help="stage counts (default 2,4)")
    p.add_argument("--m-per-pp", type=ints, default=[1, 2, 4],
                   help="micro-batches per step as multiples of p (default 1,2,4)")
    p.add_argument("--v", type=int, default=2, help="chunks per rank, interleaved")
    p.add_argument("--reps", type=int, default=3, help="timed steps per case (median)")
    p.add_argument("--d-model", type=int, default=256, help="GPT width (default 256)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sample")
    p.add_argument("--micro-batch", type=int, default=4, help="samples per micro-batch")
    p.add_argument("--sleep-ms", type=float, default=50.0,
                   help="ms of each of a sleep block's F, B and W; 0 skips them")
    p.add_argument("--schedules", type=lambda s: s.split(","), default=list(SCHEDULE_NAMES),
                   help=f"schedules to run (default {','.join(SCHEDULE_NAMES)})")
    p.add_argument("--work", choices=("both", "gpt", "sleep"), default="both")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    works = ["gpt", "sleep"] if args.work == "both" else [args.work]
    if args.sleep_ms <= 0:
        works = [w for w in works if w != "sleep"]
    load = os.getloadavg()[0]
    cases = []
    for work in works:
        for pp in args.pp:
            print(f"[pipeline] {work} p={pp}", file=sys.stderr, flush=True)
            cases += run_distributed(_bench, pp, args=(work, args), timeout=1800)[0]
    print(json.dumps({
        "bench": "pipeline", **_summary(cases), "target_bubble_rel_error": 0.15,
        "bubble": "mean over stages of 1 - busy/span, median over steps",
        "d_model": args.d_model, "seq_len": args.seq_len, "micro_batch": args.micro_batch,
        "v": args.v, "reps": args.reps, "sleep_ms": args.sleep_ms, "cases": cases,
        "machine": f"{os.cpu_count()} cpu cores, load average {load:.1f} at start"}))


if __name__ == "__main__":
    main()
