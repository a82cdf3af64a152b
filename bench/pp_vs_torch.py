"""disttrain's pipeline against torch.distributed.pipelining: same model, same stage cut.

    python bench/pp_vs_torch.py [--pp 2,4] [--m-per-pp 2,4] [--v 2] [--steps 4]
                                [--d-model 128] [--n-layer 8] [--seq-len 32] [--micro-batch 4]

For each p in ``--pp``, one world of p Gloo ranks (forked, one torch thread each; the
pp group is the world) runs every schedule (GPipe, 1F1B, interleaved 1F1B with ``--v``
chunks per rank, the zero-bubble zb1 and zbv; ``--schedules`` picks some) for m = k p
micro-batches, k in ``--m-per-pp``. Each case builds both
systems with ``build_pair`` of ``bench/torch_pipeline.py`` (the code
the parity test checks): two identically seeded ``disttrain.models.GPT`` copies, cut by
one plan into equal chunks (``--n-layer`` / (p v) blocks each, the embedding on the
first, the final norm and head on the last), each trained by AdamW (lr 1e-3) on the
same micro-batches: disttrain's ``run_pipeline`` against torch's ``ScheduleGPipe`` /
``Schedule1F1B`` / ``ScheduleInterleaved1F1B`` / ``ScheduleInterleavedZeroBubble`` (for
zb1) / ``ScheduleZBVZeroBubble`` (for zbv) over ``PipelineStage`` s given their
shapes up front (no shape inference), ``scale_grads=False`` with the loss already
divided by the step's token count, ``return_outputs=False``. A step is zero_grad, the
schedule, the tied embedding/head gradient sum, the optimizer step. After one warmup
step each, ``--steps`` timed steps alternate the systems (disttrain first on even
steps, torch first on odd ones), each after a barrier.

Per case and system: ``step_s``, the median over steps of the step's wall time (first
rank's start to last rank's end); ``pipeline_s``, the same up to the schedule's return
(``span``); ``ratio`` = disttrain's step_s / torch's (``pipeline_ratio`` likewise);
``cpu_s``, the median over steps of the CPU seconds all ranks used in the step
(``time.process_time``, every thread; other work on a shared machine slows the wall
clock but hardly this), ``cpu_ratio`` likewise.
``bubble``: measured bubble fraction, defined identically for both systems as
1 - busy_r / span averaged over the p ranks, median over steps, where busy_r is rank
r's compute seconds in the step (every forward, the loss included, and every backward
of its chunks, read around each library's per-action call; waits on receives
excluded) and span is the schedule's wall time over all ranks (optimizer excluded);
``bubble_theory`` = (p-1)/(m+p-1), interleaved (p-1)/(v m+p-1), zero-bubble
:func:`~disttrain.parallel.pipeline.analytic_bubble`'s. ``idle_per_rank_s`` (per
system): each rank's span - busy_r, ``start_per_rank_s`` its first action's start after
the earliest rank's (both medians over steps). ``loss`` (both): the
mean token loss of the last timed step (after 1 + steps - 1 AdamW updates from the
same weights); ``loss_rel_diff`` = |disttrain - torch| / torch, the largest over the
steps. Prints one JSON line; progress on stderr.
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
from torch_pipeline import (  # bench/torch_pipeline.py (a sibling: bench/ runs as the script's dir)
    DISTTRAIN,
    TORCH,
    PipelineTrainer,
    build_pair,
)

from disttrain.comm import CollectiveLedger, Communicator
from disttrain.config.schema import ModelConfig
from disttrain.models import GPT, gpt_spec, token_loss
from disttrain.names import SCHEDULE_INTERLEAVED, SCHEDULE_ZBV, SCHEDULES
from disttrain.parallel.pipeline import analytic_bubble
from disttrain.testing import run_distributed

WARMUP_STEPS = 1
TARGET_RATIO = 1.0


def _batches(cfg: ModelConfig, m: int, micro_batch: int, step: int
             ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 * m + step)
    tokens = torch.randint(0, cfg.vocab_size, (m, micro_batch, cfg.seq_len + 1), generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _timed(trainer: PipelineTrainer, batches: list) -> torch.Tensor:
    """Every rank's :meth:`StepStats.as_tensor` row for one step."""
    dist.barrier()
    mine = trainer.step(batches).as_tensor()
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    return torch.stack(rows)


def _summary(rows: list[torch.Tensor]) -> dict:
    """Median step, schedule span, CPU seconds (all ranks) and bubble over steps; each
    step's mean token loss."""
    steps = [float(r[:, 4].max() - r[:, 2].min()) for r in rows]
    cpu = [float(r[:, 6].sum()) for r in rows]
    spans = [float(r[:, 3].max() - r[:, 2].min()) for r in rows]
    bubbles = [float((1 - r[:, 5] / span).mean()) for r, span in zip(rows, spans, strict=True)]
    losses = [float(r[:, 0].sum() / r[:, 1].sum()) for r in rows]
    # per rank: wall time of the schedule not spent computing, and when it started
    idle = [[float(span - r[k, 5]) for r, span in zip(rows, spans, strict=True)]
            for k in range(rows[0].shape[0])]
    late = [[float(r[k, 2] - r[:, 2].min()) for r in rows] for k in range(rows[0].shape[0])]
    return {"step_s": statistics.median(steps), "pipeline_s": statistics.median(spans),
            "cpu_s": statistics.median(cpu),
            "idle_per_rank_s": [round(statistics.median(i), 5) for i in idle],
            "start_per_rank_s": [round(statistics.median(t), 5) for t in late],
            "bubble": statistics.median(bubbles), "losses": losses}


def _case(cfg: ModelConfig, comm: Communicator, name: str, m: int, v: int,
          args: argparse.Namespace) -> dict:
    pp = comm.size
    v = v if name == SCHEDULE_INTERLEAVED else 2 if name == SCHEDULE_ZBV else 1
    per_chunk = cfg.n_layer // (pp * v)

    def make_model() -> GPT:
        torch.manual_seed(0)
        return GPT(cfg)

    trainers = build_pair(make_model, gpt_spec(cfg), comm, schedule=name, m=m, v=v,
                          cuts=range(per_chunk, cfg.n_layer, per_chunk),
                          activation_shape=(args.micro_batch, cfg.seq_len, cfg.d_model),
                          loss_fn=token_loss,
                          make_optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
    rows: dict[str, list[torch.Tensor]] = {t.name: [] for t in trainers}
    for step in range(WARMUP_STEPS + args.steps):
        batches = _batches(cfg, m, args.micro_batch, step)
        order = trainers if step % 2 == 0 else trainers[::-1]
        for trainer in order:
            got = _timed(trainer, batches)
            if step >= WARMUP_STEPS:
                rows[trainer.name].append(got)
    ours, theirs = _summary(rows[DISTTRAIN]), _summary(rows[TORCH])
    diffs = [abs(a - b) / abs(b) for a, b in zip(ours["losses"], theirs["losses"],
                                                 strict=True)]
    return {"p": pp, "schedule": name, "v": v, "m": m,
            "disttrain_step_s": round(ours["step_s"], 5),
            "torch_step_s": round(theirs["step_s"], 5),
            "ratio": round(ours["step_s"] / theirs["step_s"], 4),
            "disttrain_pipeline_s": round(ours["pipeline_s"], 5),
            "torch_pipeline_s": round(theirs["pipeline_s"], 5),
            "pipeline_ratio": round(ours["pipeline_s"] / theirs["pipeline_s"], 4),
            "disttrain_cpu_s": round(ours["cpu_s"], 5), "torch_cpu_s": round(theirs["cpu_s"], 5),
            "cpu_ratio": round(ours["cpu_s"] / theirs["cpu_s"], 4),
            "bubble_disttrain": round(ours["bubble"], 4),
            "bubble_torch": round(theirs["bubble"], 4),
            "bubble_theory": round(analytic_bubble(name, pp, m, v), 4),
            "idle_per_rank_s": {DISTTRAIN: ours["idle_per_rank_s"],
                                TORCH: theirs["idle_per_rank_s"]},
            "start_per_rank_s": {DISTTRAIN: ours["start_per_rank_s"],
                                 TORCH: theirs["start_per_rank_s"]},
            "loss_disttrain": round(ours["losses"][-1], 6),
            "loss_torch": round(theirs["losses"][-1], 6),
            "loss_rel_diff": float(f"{max(diffs):.3g}")}


def _bench(cfg: ModelConfig, args: argparse.Namespace) -> list[dict]:
    comm = Communicator(None, CollectiveLedger(), name="pp")
    cases = []
    for k in args.m_per_pp:
        for name in args.schedules:
            t0 = time.perf_counter()
            case = _case(cfg, comm, name, k * comm.size, args.v, args)
            case["case_s"] = round(time.perf_counter() - t0, 2)
            if comm.rank == 0:
                print(f"[pp_vs_torch] {json.dumps(case)}", file=sys.stderr, flush=True)
            cases.append(case)
    return cases


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p.add_argument("--pp", type=ints, default=[2, 4], help="stage counts (default 2,4)")
    p.add_argument("--m-per-pp", type=ints, default=[2, 4],
                   help="micro-batches per step as multiples of p (default 2,4)")
    p.add_argument("--v", type=int, default=2, help="chunks per rank, interleaved")
    p.add_argument("--steps", type=int, default=6, help="timed steps per system and case")
    p.add_argument("--d-model", type=int, default=128, help="GPT width (default 128)")
    p.add_argument("--n-layer", type=int, default=8,
                   help="GPT blocks, a multiple of every p x v (default 8)")
    p.add_argument("--seq-len", type=int, default=32, help="tokens per sample")
    p.add_argument("--micro-batch", type=int, default=4, help="samples per micro-batch")
    p.add_argument("--schedules", type=lambda s: s.split(","), default=list(SCHEDULES),
                   help=f"schedules to compare (default {','.join(SCHEDULES)})")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    for pp in args.pp:
        if args.n_layer % (pp * args.v):
            sys.exit(f"--n-layer {args.n_layer} must be a multiple of p x v = {pp * args.v} "
                     "(equal chunks for every schedule)")
    cfg = ModelConfig(vocab_size=256, seq_len=args.seq_len, n_layer=args.n_layer, n_head=4,
                      d_model=args.d_model)
    load, t0 = os.getloadavg()[0], time.perf_counter()
    cases = []
    for pp in args.pp:  # forked ranks: torch and torch.distributed.pipelining imported once
        cases += run_distributed(_bench, pp, args=(cfg, args), timeout=600,
                                 start_method="fork")[0]
    ratios = {f"p{c['p']}_{c['schedule']}_m{c['m']}": c["ratio"] for c in cases}
    print(json.dumps({
        "bench": "pp_vs_torch", "target_ratio": TARGET_RATIO,
        "max_ratio": max(ratios.values()), "ratios": ratios,
        "missed": sorted(k for k, r in ratios.items() if r > TARGET_RATIO),
        "max_pipeline_ratio": max(c["pipeline_ratio"] for c in cases),
        "max_cpu_ratio": max(c["cpu_ratio"] for c in cases),
        "max_loss_rel_diff": max(c["loss_rel_diff"] for c in cases),
        "cases": cases, "steps": args.steps, "warmup_steps": WARMUP_STEPS,
        "d_model": args.d_model, "n_layer": args.n_layer, "seq_len": args.seq_len,
        "micro_batch": args.micro_batch, "v": args.v, "vocab_size": cfg.vocab_size,
        "torch": torch.__version__, "elapsed_s": round(time.perf_counter() - t0, 1),
        "machine": f"{os.cpu_count()} cpu cores, load average {load:.1f} at start"}))


if __name__ == "__main__":
    main()
