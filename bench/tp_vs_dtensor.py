"""disttrain's tensor parallelism against torch's DTensor tensor parallelism, same everything.

    python bench/tp_vs_dtensor.py [--tp 2 4] [--models gpt llama] [--d-model 512]
                                  [--n-layer 2] [--seq-len 128] [--micro-batch 4]
                                  [--warmup 2] [--reps 6] [--steps 1]

For each tp size one world of ``tp`` Gloo ranks (one thread each) runs every case: the
built-in GPT with sequence parallelism off and on, and a transformers Llama of the same
width (``--models``). In each case two identical full models (same seed) are sharded,
one by disttrain (:func:`disttrain.parallel.tensor.apply_tensor_parallel`), one by
torch's ``parallelize_module`` as torch's tutorial and torchtitan set it up (the plans
are in ``bench/tp_models.py``, which the parity test imports too); both train on the
same batches with the same AdamW. After ``--warmup`` steps each, ``--reps`` rounds of
``--steps`` steps go round the two systems, so drifting machine load hits both alike; a
step's time is the slowest rank's. Each system does the same steps on the same batches
in the same order, so ``loss_diff`` (the last step's loss, disttrain minus DTensor)
must be fp32 noise: both train the same model.

Prints one JSON line: per case the median step times, ``ratio`` = disttrain / DTensor
(target <= 1.0), the last losses and their difference.

What the DTensor baseline cannot do here, and so does not:

- async TP (``torch._inductor.config._micro_pipeline_tp``, torchtitan's
  ``enable_async_tensor_parallel``) is an Inductor pass over ``torch.compile`` d
  graphs that fuses all-gather / reduce-scatter with matmuls through CUDA symmetric
  memory: it needs CUDA (and NCCL), so neither side uses it on CPU; both run eager.
- ``torch.compile`` (torchtitan compiles each block): neither side compiles, since
  Inductor's CPU code generation of both models would take longer than the whole
  bench's budget here; both run eager.
- the GPT's fused q|k|v projection has no DTensor style: its rows are reordered once
  (``[q_0; k_0; v_0; q_1; ...]``) so that ColwiseParallel's contiguous shard holds
  each rank's heads; the function is unchanged (the parity test checks the losses).
- the Llama runs without sequence parallelism on both sides: disttrain refuses it for
  transformers models (their forward builds positions and masks from the local
  sequence length), so there is nothing to compare with.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from disttrain.testing import run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tp_models import (  # noqa: E402 - the bench folder is not a package
    MODELS,
    Step,
    batches,
    build_model,
    disttrain_step,
    dtensor_step,
    model_config,
)

TARGET_RATIO = 1.0
SYSTEMS = ("disttrain", "dtensor")


def cases(models: list[str]) -> list[tuple[str, bool]]:
    """(model, sequence parallel) pairs: the Llama without sequence parallelism only."""
    return [(m, sp) for m in models for sp in (False, True) if m == "gpt" or not sp]


def _timed(step: Step, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[float, float]:
    """(the slowest rank's seconds, the loss) of one step."""
    dist.barrier()
    t0 = time.perf_counter()
    loss = float(step(*batch))
    took = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took), loss


def _run_case(kind: str, sp: bool, args: argparse.Namespace) -> dict:
    cfg = model_config(kind, d_model=args.d_model, n_layer=args.n_layer,
                       n_head=args.n_head, seq_len=args.seq_len)
    total = args.warmup + args.reps * args.steps
    data = batches(cfg, args.micro_batch, total)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    steps = {"disttrain": disttrain_step(build_model(cfg), sequence_parallel=sp),
             "dtensor": dtensor_step(build_model(cfg), mesh, sequence_parallel=sp)}
    done = dict.fromkeys(SYSTEMS, 0)  # each system's steps so far: its next batch
    times: dict[str, list[float]] = {s: [] for s in SYSTEMS}
    losses: dict[str, float] = {}

    def run(system: str, n: int, timed: bool) -> None:
        for _ in range(n):
            took, losses[system] = _timed(steps[system], data[done[system]])
            done[system] += 1
            if timed:
                times[system].append(took)

    for s in SYSTEMS:
        run(s, args.warmup, timed=False)
    for _ in range(args.reps):
        for s in SYSTEMS:
            run(s, args.steps, timed=True)
    step_s = {s: statistics.median(times[s]) for s in SYSTEMS}
    return {"model": kind, "tp": dist.get_world_size(), "sequence_parallel": sp,
            "disttrain_step_s": round(step_s["disttrain"], 5),
            "dtensor_step_s": round(step_s["dtensor"], 5),
            "ratio": round(step_s["disttrain"] / step_s["dtensor"], 4),
            "loss_disttrain": round(losses["disttrain"], 6),
            "loss_dtensor": round(losses["dtensor"], 6),
            "loss_diff": float(f"{losses['disttrain'] - losses['dtensor']:.3g}"),
            "loss_steps": total,
            "params": sum(p.numel() for p in build_model(cfg).parameters())}


def _world(args: argparse.Namespace) -> list[dict]:
    return [_run_case(kind, sp, args) for kind, sp in cases(args.models)]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, nargs="+", default=[2, 4], help="tp sizes (2 4)")
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--d-model", type=int, default=512, help="width (default 512)")
    p.add_argument("--n-layer", type=int, default=2, help="blocks (default 2)")
    p.add_argument("--n-head", type=int, default=8, help="attention heads (default 8)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sample (128)")
    p.add_argument("--micro-batch", type=int, default=4, help="samples per step (4)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per system")
    p.add_argument("--reps", type=int, default=6, help="alternating rounds (default 6)")
    p.add_argument("--steps", type=int, default=1, help="timed steps per round (1)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    start = time.perf_counter()
    results = [case for tp in args.tp
               for case in run_distributed(_world, tp, args=(args,), timeout=600)[0]]
    ratios = {f"{c['model']}_tp{c['tp']}{'_sp' if c['sequence_parallel'] else ''}":
              c["ratio"] for c in results}
    print(json.dumps({
        "bench": "tp_vs_dtensor", "backend": "gloo", "ratios": ratios,
        "max_ratio": max(ratios.values()), "target_ratio": TARGET_RATIO,
        "target_met": max(ratios.values()) <= TARGET_RATIO,
        "max_abs_loss_diff": max(abs(c["loss_diff"]) for c in results),
        "cases": results, "d_model": args.d_model, "n_layer": args.n_layer,
        "n_head": args.n_head, "seq_len": args.seq_len, "micro_batch": args.micro_batch,
        "warmup": args.warmup, "reps": args.reps, "steps": args.steps,
        "threads_per_rank": 1, "elapsed_s": round(time.perf_counter() - start, 1),
        "machine": f"{os.cpu_count()} cpu cores"}))


if __name__ == "__main__":
    main()
