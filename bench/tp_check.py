"""The cost of the first step's tensor-parallel proof (``parallel.tp_check_grads``),
against a training step of the same model at the same tp.

    python bench/tp_check.py [--tp 2] [--d-model 256] [--n-layer 6] [--reps 5]

The built-in GPT (seq_len 256, byte vocabulary, batch 8) is sharded over ``--tp`` Gloo
ranks on this machine. Each rank runs forward and backward on the same batch, then the
proof (:func:`disttrain.parallel.tensor.dimension.check_identical_grads`: checksums of every
identically-classified gradient, one all-gather over tp, one object gather over the
world) is timed ``--reps`` times on those gradients, and a whole step (forward, backward,
AdamW) ``--reps`` times. The proof runs once per run, so its share of a run of N steps is
``check_s / (N x step_s)``. Prints one JSON line (rank 0's medians).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from disttrain.comm import CollectiveLedger
from disttrain.config.layout import Layout
from disttrain.config.schema import ModelConfig, ParallelConfig
from disttrain.models import GPT, gpt_spec
from disttrain.parallel.compose import Groups
from disttrain.parallel.model_parallel import apply_model_parallel
from disttrain.parallel.tensor.dimension import TensorShards, check_identical_grads
from disttrain.parallel.topology import build_topology
from disttrain.testing import run_distributed


def _body(args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=256, seq_len=256, n_layer=args.n_layer, n_head=8,
                      d_model=args.d_model, dropout=0.0)
    model = GPT(cfg)
    topology = build_topology(Layout.of(dp=1, tp=args.tp), "cpu")
    groups = Groups.build(topology, CollectiveLedger())
    world = groups.world
    model_parallel = apply_model_parallel(model, gpt_spec(cfg), ParallelConfig(tp=args.tp),
                              dict(groups.axes), micro_batches=1)
    shards = next(p for p in model_parallel.parts if isinstance(p, TensorShards))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 256, (8, cfg.seq_len + 1), generator=torch.Generator().manual_seed(1))

    def step() -> None:
        loss, count = shards.tp.loss_fn(model(ids[:, :-1]), ids[:, 1:])
        opt.zero_grad()
        (loss / count).backward()
        model_parallel.fix_gradients({id(p): p.grad for p in model.parameters()})

    step()
    pieces = [(p, p.grad) for p in model.parameters()]
    checks, steps = [], []
    for _ in range(args.reps):
        world.barrier()
        t0 = time.perf_counter()
        check_identical_grads(shards.tp, model_parallel.placement, pieces, world)
        checks.append(time.perf_counter() - t0)
    for _ in range(args.reps):
        world.barrier()
        t0 = time.perf_counter()
        step()
        opt.step()
        steps.append(time.perf_counter() - t0)
    return {"check_s": statistics.median(checks), "step_s": statistics.median(steps),
            "params": sum(p.numel() for p in GPT(cfg).parameters())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    got = run_distributed(_body, args.tp, args=(args,), timeout=600)[0]
    print(json.dumps({"bench": "tp_check", "tp": args.tp, "backend": "gloo",
                      "d_model": args.d_model, "n_layer": args.n_layer,
                      "params": got["params"], "check_s": round(got["check_s"], 6),
                      "step_s": round(got["step_s"], 4),
                      "check_vs_step": round(got["check_s"] / got["step_s"], 4),
                      "machine": f"{os.cpu_count()} cpu cores"}))


if __name__ == "__main__":
    main()
