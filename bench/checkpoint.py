"""Checkpoint save throughput against the disk's own write bandwidth, and async stall.

    python bench/checkpoint.py [--reps 7] [--d-model 1024] [--n-layer 4] [--dir DIR]

The state is what the trainer saves for a GPT (default d_model 1024, 4 layers: 50.8M
parameters) after one AdamW step: ``model/...``, ``optim/.../exp_avg``,
``optim/.../exp_avg_sq``, ``optim/.../step`` and ``rng/rank0/cpu``, a 609 MB file of
fp32, all owned by one rank (world size 1, one writer). In a temporary directory under
``--dir`` (the disk being measured), repetitions rotate through three timings so that
drifting load hits all alike:

- disk: the same number of bytes as the checkpoint's shard file, written to one file in
  64 MiB writes from memory, then fsync'd;
- sync: ``CheckpointManager(async_save=False).save(...)``: shard file (written from the
  tensors in place), fsync, marker, index, rename and ``latest`` pointer (the commit);
- async: the training stall of ``CheckpointManager(async_save=True)``, as the trainer
  uses it: ``save(...)`` returns at once (a background thread copies the tensors into
  host buffers, then writes), the next step's forward and backward run (one
  micro-batch of ``--micro-batch`` x 128 tokens through the same GPT), then
  ``before_update()`` waits for the snapshot before the optimizer may change the
  tensors. The stall is the time blocked in save() and before_update(). Also measured:
  the same without the forward and backward in between (``async_stall_no_overlap_s``,
  the copy's full cost: what a step too short to hide it would pay), and the forward and
  backward's own time with and without a save in the background (the copy competes for
  the cores: ``async_slowdown_s``). The background write is then waited for, untimed.

Each manager saves once before timing (warmup: first-touch allocations, the disk's first
write). Prints one JSON line with the medians and the two ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from disttrain.checkpoint import CheckpointManager, find_checkpoint, open_checkpoint
from disttrain.checkpoint.state import model_tensors, optimizer_tensors, rng_tensors
from disttrain.checkpoint.storage import verify
from disttrain.config.schema import ModelConfig
from disttrain.models import GPT

WRITE_CHUNK = 64 * 2**20
TARGET_SAVE_VS_DISK = 0.5
TARGET_STALL_VS_SYNC = 0.1


def _log(msg: str) -> None:
    print(f"[checkpoint bench] {msg}", file=sys.stderr, flush=True)


def build_state(cfg: ModelConfig) -> tuple[GPT, dict[str, torch.Tensor]]:
    """A GPT and the trainer's checkpoint tensors for it after one AdamW step (random
    grads)."""
    torch.manual_seed(0)
    model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    return model, {**model_tensors(model), **optimizer_tensors(model, optimizer),
                   **rng_tensors(0)}


def forward_backward(model: GPT, micro_batch: int) -> Callable[[], float]:
    """One training micro-batch's forward and backward; returns its seconds."""
    tokens = torch.randint(0, model.cfg.vocab_size, (micro_batch, model.cfg.seq_len))

    def run() -> float:
        start = time.perf_counter()
        model(tokens).float().square().mean().backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start
    return run


def filesystem_of(path: Path) -> str:
    """'<device> <fstype> on <mount point>' for the mount holding ``path``."""
    real, best = str(path.resolve()), ("?", "?", "")
    with open("/proc/mounts", encoding="utf-8") as fh:
        for line in fh:
            device, mount, fstype = line.split()[:3]
            inside = real == mount or real.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) >= len(best[2]):
                best = (device, fstype, mount)
    return f"{best[0]} {best[1]} on {best[2]}"


def time_raw_write(path: Path, data: torch.Tensor) -> float:
    """Seconds to write ``data`` (uint8, 1-d) to a new file in large writes, then fsync."""
    view = memoryview(data.numpy())
    start = time.perf_counter()
    with open(path, "wb") as fh:
        for offset in range(0, len(view), WRITE_CHUNK):
            fh.write(view[offset:offset + WRITE_CHUNK])
        fh.flush()
        os.fsync(fh.fileno())
    elapsed = time.perf_counter() - start
    path.unlink()
    return elapsed


class SaveTimer:
    """One CheckpointManager saving the same state again and again into ``run_dir``;
    each committed checkpoint is deleted after its timing (so no save prunes another)."""

    def __init__(self, run_dir: Path, state: dict[str, torch.Tensor], async_save: bool
                 ) -> None:
        self.run_dir, self.state, self.step = run_dir, state, 0
        self.owners = {name: 0 for name in state}
        self.manager = CheckpointManager(run_dir, 0, 1, keep=1_000_000,
                                         async_save=async_save)

    def save(self) -> float:
        """Seconds the caller is blocked in save() (for a sync manager: all of it)."""
        self.step += 1
        meta = {"step": self.step, "position": self.step, "world_size": 1}
        start = time.perf_counter()
        self.manager.save(self.step, self.state, self.owners, meta)
        return time.perf_counter() - start

    def before_update(self) -> float:
        """Seconds blocked until the async save's snapshot is taken."""
        start = time.perf_counter()
        self.manager.before_update()
        return time.perf_counter() - start

    def finish(self) -> float:
        """Wait for the save to commit; seconds waited. Then delete the checkpoint."""
        start = time.perf_counter()
        self.manager.wait()
        waited = time.perf_counter() - start
        shutil.rmtree(self.run_dir / "checkpoints")
        return waited


def shard_bytes(run_dir: Path) -> int:
    """Bytes of the shard file(s) of the newest checkpoint, after checking its sha256."""
    directory = find_checkpoint(run_dir, warn=_log)
    problem = verify(directory)
    if problem is not None:
        raise RuntimeError(f"the benchmark's own checkpoint does not verify: {problem}")
    return sum(f["bytes"] for f in open_checkpoint(directory).index.files.values())


def _warm_up(sync: SaveTimer, async_: SaveTimer) -> tuple[int, float]:
    """One untimed save each; returns the shard file's bytes and the async save's stall
    (the first one: host buffers allocated and touched for the first time)."""
    sync.save()
    nbytes = shard_bytes(sync.run_dir)
    sync.finish()
    first_stall = async_.save()
    async_.finish()
    return nbytes, first_stall


def _bench(work: Path, state: dict[str, torch.Tensor], reps: int,
           step: Callable[[], float]) -> dict[str, Any]:
    sync = SaveTimer(work / "sync", state, async_save=False)
    async_ = SaveTimer(work / "async", state, async_save=True)
    nbytes, first_stall = _warm_up(sync, async_)
    data, raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8), work / "raw.bin"
    time_raw_write(raw, data)
    times: dict[str, list[float]] = {"disk": [], "sync": [], "stall": [], "async_total": [],
                                     "stall_no_overlap": [], "work": [], "work_alone": []}
    step()  # warm up the forward and backward

    def run_disk() -> None:
        times["disk"].append(time_raw_write(raw, data))

    def run_sync() -> None:
        times["sync"].append(sync.save())
        sync.finish()

    def run_async() -> None:
        blocked = async_.save()
        times["work"].append(step())
        times["stall"].append(blocked + async_.before_update())
        times["async_total"].append(times["stall"][-1] + times["work"][-1] + async_.finish())
        times["work_alone"].append(step())
        times["stall_no_overlap"].append(async_.save() + async_.before_update())
        async_.finish()

    runners: list[Callable[[], None]] = [run_disk, run_sync, run_async]
    for rep in range(reps):
        for runner in runners[rep % 3:] + runners[:rep % 3]:
            runner()
        _log(f"rep {rep + 1}/{reps}: disk {times['disk'][-1]:.3f}s, sync save "
             f"{times['sync'][-1]:.3f}s, async stall {times['stall'][-1]:.4f}s")
    return {"bytes": nbytes, "first_stall_s": first_stall, **times}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=7, help="rotating repetitions (default 7)")
    p.add_argument("--d-model", type=int, default=1024, help="GPT width (default 1024)")
    p.add_argument("--n-layer", type=int, default=4, help="GPT blocks (default 4)")
    p.add_argument("--micro-batch", type=int, default=2,
                   help="samples of 128 tokens in the forward and backward (default 2)")
    p.add_argument("--dir", default=None,
                   help="where the temporary directory goes (default: the system's temp "
                        "dir); it decides which disk is measured")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    cfg = ModelConfig(d_model=args.d_model, n_layer=args.n_layer, n_head=8)
    model, state = build_state(cfg)
    state_bytes = sum(t.numel() * t.element_size() for t in state.values())
    work = Path(tempfile.mkdtemp(prefix="disttrain-ckpt-bench-", dir=args.dir))
    fs = filesystem_of(work)
    _log(f"{len(state)} tensors, {state_bytes / 1e6:.0f} MB, in {work} ({fs})")
    try:
        r = _bench(work, state, args.reps, forward_backward(model, args.micro_batch))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    disk, save = statistics.median(r["disk"]), statistics.median(r["sync"])
    stall = statistics.median(r["stall"])
    print(json.dumps({
        "bench": "checkpoint", "world_size": 1, "tensors": len(state),
        "params": sum(t.numel() for n, t in state.items() if n.startswith("model/")),
        "bytes": r["bytes"], "disk_write_s": round(disk, 4),
        "disk_gbps": round(r["bytes"] / disk / 1e9, 3), "sync_save_s": round(save, 4),
        "save_gbps": round(r["bytes"] / save / 1e9, 3),
        "async_stall_s": round(stall, 5),
        "async_stall_no_overlap_s": round(statistics.median(r["stall_no_overlap"]), 4),
        "forward_backward_s": round(statistics.median(r["work_alone"]), 4),
        "async_slowdown_s": round(statistics.median(r["work"])
                                  - statistics.median(r["work_alone"]), 4),
        "async_total_s": round(statistics.median(r["async_total"]), 4),
        "first_async_stall_s": round(r["first_stall_s"], 4),
        "save_vs_disk": round(disk / save, 4), "async_stall_vs_sync": round(stall / save, 4),
        "async_no_overlap_vs_sync": round(statistics.median(r["stall_no_overlap"]) / save, 4),
        "target_save_vs_disk": TARGET_SAVE_VS_DISK,
        "target_async_stall_vs_sync": TARGET_STALL_VS_SYNC,
        "reps": args.reps, "filesystem": fs, "machine": f"{os.cpu_count()} cpu cores"}))


if __name__ == "__main__":
    main()
