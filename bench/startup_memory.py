"""Peak host memory per rank of starting and running a model that is sharded.

    python bench/startup_memory.py [--n-layer 16] [--d-model 1024] [--world 8] [--steps 2]

The built-in GPT of ``--n-layer`` x ``--d-model`` (16 x 1024: 201M parameters, 0.81 GB
of fp32 weights) trains ``--steps`` steps (two micro-batches each) with an evaluation
before the first and after the last, at world ``--world`` (Gloo, CPU), in two layouts:
dp ZeRO-3, and tp 2 x pp 2 x dp (world / 4) ZeRO-1. Each layout runs twice: built on
the meta device (what the command line does: each rank allocates and fills only its
part), and built with values on every rank (the model a user passes, moved whole before
sharding). Each rank reads its resident-set peak per phase: the kernel's high-water
mark, read and reset (``/proc/self/clear_refs``) as a phase begins: ``start``
(everything built and filled), ``eval`` (every evaluation), ``forward``, ``backward``
(with the reduce-scatters overlapping it), ``reduce`` (those left after it),
``optimizer`` (clipping, the update), ``between`` (records, logging) and
``final_weights`` (written, the run closed). ``step`` is the largest of a step's
phases, ``end`` the whole run's. Figures are each rank's peak above its RSS after a bare
``import torch, disttrain``, as a multiple of the whole model's fp32 bytes (the largest
over ranks). For ZeRO-3 the floor the run is held to: the sharded state (16 bytes per
parameter / world: 4 / world of the fp32 model), two blocks gathered (the running one
and the prefetched one), the process (what the start holds beyond its shard) and one
micro-batch's activations (the run's own saved-tensor meter); ``floor_run`` is their
sum, what a step holds at its peak before any transient.
``--trace-phases`` prints rank 0's phase changes.

The ranks start as the command line's workers do: spawned (a fresh interpreter), with
the launcher's allocator settings under ``DISTTRAIN_MALLOC=return``
(``disttrain.launch.allocator.allocator_env``: freed buffers returned to the system; a
``MALLOC_*`` variable set here wins); ``malloc_mmap_threshold`` in the output says
which. One JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile

import torch

from disttrain.launch.allocator import ALLOCATOR_CHOICE_ENV, ALLOCATOR_RETURN, allocator_env
from disttrain.testing import run_distributed


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


STEP_PHASES = ("forward", "backward", "reduce", "optimizer")


class PhasePeaks:
    """The resident peak of each phase of a run: the kernel's high-water mark
    (``VmHWM``) is read and reset (``/proc/self/clear_refs``) at every phase change,
    so each phase's figure is the peak reached while it ran (the largest over its
    repeats: every micro-batch's forward, every evaluation)."""

    def __init__(self, verbose: bool = False) -> None:
        self.current, self.verbose = "start", verbose
        self.peaks: dict[str, int] = {}

    @staticmethod
    def _hwm() -> int:
        with open("/proc/self/status") as f:
            line = next(x for x in f if x.startswith("VmHWM"))
        return int(line.split()[1]) * 1024

    def enter(self, phase: str) -> None:
        if phase == self.current:
            return
        self.peaks[self.current] = max(self.peaks.get(self.current, 0), self._hwm())
        if self.verbose:
            print(f"{self.current} -> {phase}: peak {self._hwm() / 2**20:.0f} MiB, "
                  f"now {_rss() / 2**20:.0f} MiB", file=sys.stderr)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self.current = phase

    def watch(self, trainer, steps: int) -> None:
        """Phase changes at the model's forward (with or without gradients: a step's
        forward, an evaluation's), its end (the backward starts), the gradients' sync
        (the reduce-scatters left), the optimizer's step (clipping and update) and the
        last evaluation (then the final weights)."""
        module, grads = trainer.parallel.module, trainer.parallel.grads
        module.register_forward_pre_hook(lambda m, a: self.enter(
            "forward" if torch.is_grad_enabled() else "eval"))

        def after_forward(_m, _a, _o) -> None:
            if torch.is_grad_enabled():
                self.enter("backward")
        module.register_forward_hook(after_forward)
        finish = grads.finish_gradient_sync

        def finish_sync(scale):  # this bench's own instance: the trainer calls it
            self.enter("reduce")
            finish(scale)
            self.enter("optimizer")
        grads.finish_gradient_sync = finish_sync
        trainer.optimizer.register_step_post_hook(lambda *a: self.enter("between"))
        self.last_step = steps


def _body(args: argparse.Namespace, layout: tuple[int, int, int, int], meta: bool,
          root: str) -> dict:
    import disttrain  # noqa: F401  (the baseline includes it)

    base = _rss()
    from torch.utils.data import Dataset

    from disttrain import Callback, Trainer
    from disttrain.config import load_config
    from disttrain.data import collate_token_batch
    from disttrain.models import GPT, token_loss

    class Tokens(Dataset):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> dict:
            g = torch.Generator().manual_seed(i)
            t = torch.randint(0, 256, (args.seq_len + 1,), generator=g)
            return {"input_ids": t[:-1], "targets": t[1:]}

    marks: dict[str, int] = {}
    phases = PhasePeaks(args.trace_phases and os.environ.get("RANK") == "0")

    class Mark(Callback):
        all_ranks = True

        def on_train_start(self, trainer) -> None:
            marks["start"] = _peak()
            phases.watch(trainer, args.steps)

        def on_eval(self, trainer, step, eval_loss) -> None:
            phases.enter("final_weights" if step == args.steps else "between")

    dp, pp, tp, zero = layout
    cfg = load_config(values={
        "model": {"vocab_size": 256, "seq_len": args.seq_len, "n_layer": args.n_layer,
                  "n_head": 16, "d_model": args.d_model},
        "train": {"steps": args.steps, "global_batch": dp * 2, "grad_accum": 2,
                  "eval_samples": 2 * dp, "log_every": 1},
        "parallel": {"dp": dp, "pp": pp, "tp": tp, "zero": zero},
        "checkpoint": {"every": 0}, "monitor": {"peak_tflops": 1.0}})
    if meta:
        with torch.device("meta"):
            model = GPT(cfg.model)
    else:
        torch.manual_seed(0)
        model = GPT(cfg.model)
    fp32 = 4 * sum(p.numel() for p in model.parameters())
    block = 4 * max(sum(p.numel() for p in b.parameters()) for b in model.blocks)
    run_dir = f"{root}/{'meta' if meta else 'whole'}-{dp}x{pp}x{tp}-z{zero}"
    Trainer(model, Tokens(), token_loss, cfg, eval_dataset=Tokens(),
            collate_fn=collate_token_batch, run_dir=run_dir,
            progress=False, callbacks=[Mark()]).fit()
    # the run's own meter of a micro-batch's saved activations (the largest rank's)
    with open(f"{run_dir}/summary.json") as f:
        activations = max(m["activations"] for m in json.load(f)["memory_bytes_per_rank"])
    phases.enter("done")
    marks["step"] = max(phases.peaks.get(k, 0) for k in STEP_PHASES)
    marks["end"] = max(phases.peaks.values())  # the whole run's (the phases' largest)
    out = {k: (v - base) / fp32 for k, v in marks.items()} | {
        "fp32_bytes": fp32, "block_x_model": block / fp32,
        "activations_x_model": activations / fp32}
    return out | {f"phase_{k}": (v - base) / fp32 for k, v in phases.peaks.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-layer", type=int, default=16)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--trace-phases", action="store_true")
    parser.add_argument("--timeout", type=float, default=1500)
    parser.add_argument("--only", default="", help="run only the cases whose name "
                        "(e.g. zero3_meta) contains this")
    args = parser.parse_args()
    w = args.world
    layouts = {"zero3": (w, 1, 1, 3), "tp2_pp2_zero1": (w // 4, 2, 2, 1)}
    out: dict = {"bench": "startup_memory", "world": w, "n_layer": args.n_layer,
                 "d_model": args.d_model, "target_start_x_model": 0.75,
                 "target_run_x_model": 0.75}
    # what the launcher adds for its workers under DISTTRAIN_MALLOC=return (the memory
    # floor is measured with freed buffers returned; the caller's MALLOC_* win)
    workers_env = allocator_env({**os.environ, ALLOCATOR_CHOICE_ENV: ALLOCATOR_RETURN})
    out["malloc_mmap_threshold"] = (dict(os.environ) | workers_env).get(
        "MALLOC_MMAP_THRESHOLD_", "glibc default")
    with tempfile.TemporaryDirectory() as root:
        for name, layout in layouts.items():
            for meta in (True, False):
                if args.only not in f"{name}_{'meta' if meta else 'whole'}":
                    continue
                ranks = run_distributed(_body, w, args=(args, layout, meta, root),
                                        timeout=args.timeout, env=workers_env,
                                        start_method="spawn")  # glibc reads it at start
                key = f"{name}_{'meta' if meta else 'whole'}"
                out["fp32_gb"] = round(ranks[0]["fp32_bytes"] / 1e9, 3)
                for point in ("start", "step", "end"):
                    out[f"{key}_{point}_x_model"] = round(
                        max(r[point] for r in ranks), 3)
                out[f"{key}_end_x_model_rank0"] = round(ranks[0]["end"], 3)
                if layout[3] == 3:  # the floor: state + the blocks gathered at once
                    state, gathered = 4 / layout[0], 2 * ranks[0]["block_x_model"]
                    out[f"{key}_floor_state_x_model"] = round(state, 3)
                    out[f"{key}_floor_gathered_x_model"] = round(gathered, 3)
                    process = max(r["start"] for r in ranks) - 1 / layout[0]
                    activations = max(r["activations_x_model"] for r in ranks)
                    out[f"{key}_process_x_model"] = round(process, 3)  # beyond the shard
                    out[f"{key}_activations_x_model"] = round(activations, 3)
                    # what a step must hold at once, with nothing transient: the target
                    # lies below it when it is above 0.75
                    out[f"{key}_floor_run_x_model"] = round(
                        state + gathered + process + activations, 3)
                for phase in sorted(k for k in ranks[0] if k.startswith("phase_")):
                    out[f"{key}_{phase}_x_model"] = round(max(r.get(phase, 0) for r in ranks), 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
