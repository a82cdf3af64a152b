"""The trainer's side of checkpoints: what to save, when, and resuming from one."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checkpoint.manager import CheckpointManager, find_checkpoint, open_checkpoint
from ..checkpoint.state import (MODEL, OPTIM, assign_owners, buffer_tensors, model_tensors,
                                optimizer_tensors, restore_buffers, restore_model,
                                restore_named, restore_optimizer, restore_rng,
                                rng_tensors)
from ..parallel.hybrid import ModelParallel
from ..parallel.zero import ZeroDataParallel
from ..comm import Communicator
from ..config import Config, RunPlan
from ..errors import UserError


class RunCheckpoints:
    """Saves every ``checkpoint.every`` steps and at the end; resumes a run directory."""

    def __init__(self, run_dir: Path, config: Config, plan: RunPlan, world: Communicator,
                 model: nn.Module, optimizer: torch.optim.Optimizer,
                 zero: ZeroDataParallel | None = None, mp: ModelParallel | None = None,
                 dp_rank: int = 0) -> None:
        self.run_dir, self.config, self.plan = run_dir, config, plan
        self.world, self.model, self.optimizer = world, model, optimizer
        self.zero, self.mp, self.dp_rank = zero, mp, dp_rank
        ck = config.checkpoint
        self.every = ck.every
        self.manager = CheckpointManager(run_dir, world.rank, world.size, keep=ck.keep,
                                         async_save=ck.async_)
        self.stall_s = 0.0

    def resume(self, say: Callable[[str], None]) -> tuple[int, int] | None:
        """Load the newest intact checkpoint, if any: returns (step, sample position).
        Rank 0 chooses (verifying checksums) and tells the others."""
        choice: tuple[str, str | None] = ("none", None)
        if self.world.rank == 0:
            try:
                found = find_checkpoint(self.run_dir, warn=say)
                choice = ("load", str(found)) if found else ("none", None)
            except UserError as exc:
                choice = ("error", str(exc))
        kind, value = self.world.broadcast_object(choice)
        if kind == "error":
            raise UserError(value)
        self.manager.prepare()
        if kind == "none":
            return None
        ckpt = open_checkpoint(Path(value))
        if self.mp is not None:  # any saved layout, cut to this rank's boxes
            restore_named(ckpt.reader, {MODEL + n: p for n, p in self.mp.named_parameters()},
                          self.mp.local_from_global)
            restore_optimizer(ckpt.reader, self.mp.module, self.optimizer, self.mp.names,
                              self.mp.local_from_global)
        elif self.zero is not None:
            self.zero.load_checkpoint(ckpt.reader, self.optimizer)
            restore_buffers(ckpt.reader, self.model)
        else:
            restore_model(ckpt.reader, self.model)
            restore_optimizer(ckpt.reader, self.model, self.optimizer)
        restore_rng(ckpt.reader, self.world.rank)
        saved_world = ckpt.meta.get("world_size")
        say(f"resuming from {Path(value).name}: step {ckpt.step}, sample "
            f"{ckpt.meta['position']} (saved on {saved_world} rank(s), now "
            f"{self.world.size})")
        return ckpt.step, int(ckpt.meta["position"])

    def due(self, step: int) -> bool:
        return bool(self.every) and (step % self.every == 0 or
                                     step == self.config.train.steps)

    def save(self, step: int, position: int) -> None:
        start = time.perf_counter()
        parts: dict = {}
        if self.mp is not None:  # each rank writes the boxes it alone holds
            mine, parts = model_parallel_pieces(self.mp, self.optimizer, self.dp_rank,
                                                self.world.rank)
            shared, owners = {}, {k: self.world.rank for k in mine}
        elif self.zero is not None:  # every rank writes its shard of each tensor
            pieces = self.zero.checkpoint_pieces(self.optimizer)
            mine = {k: v[0] for k, v in pieces.items()}
            parts = {k: v[1:] for k, v in pieces.items() if v[3] is not None}
            shared = buffer_tensors(self.model)
            owners = {n: 0 for n in shared} | {k: self.world.rank for k in mine}
        else:  # replicated: each tensor written once, by an owner balancing bytes
            shared = {**model_tensors(self.model),
                      **optimizer_tensors(self.model, self.optimizer)}
            mine = {}
            owners = assign_owners({n: t.numel() * t.element_size()
                                    for n, t in shared.items()}, self.world.size)
        own_rng = rng_tensors(self.world.rank)
        owners.update({n: self.world.rank for n in own_rng})
        self.manager.save(step, {**shared, **mine, **own_rng}, owners,
                          self._meta(step, position), parts,
                          eager=frozenset(buffer_tensors(self.model)))
        self.stall_s = time.perf_counter() - start

    def before_update(self) -> None:
        """Before the optimizer changes parameters and state: wait until an async save
        has its snapshot (normally taken during the forward and backward)."""
        self.stall_s += self.manager.before_update()

    def _meta(self, step: int, position: int) -> dict[str, Any]:
        lay = self.plan.layout
        return {"step": step, "position": position, "world_size": self.world.size,
                "layout": {"dp": lay.dp, "pp": lay.pp, "tp": lay.tp, "zero": lay.zero},
                "global_batch": self.plan.batch.global_batch,
                "seed": self.config.train.seed, "optimizer": self.config.train.optimizer,
                "config": self.config.to_dict(), "saved_at": time.time()}

    def close(self) -> None:
        self.manager.wait()


def model_parallel_pieces(mp: ModelParallel, optimizer: torch.optim.Optimizer,
                          dp_rank: int, rank: int) -> tuple[dict[str, torch.Tensor], dict]:
    """The parameter and optimizer-state boxes this rank writes (dp rank 0; tp rank 0
    for replicated tensors; never the tied copy), keyed uniquely, with their parts."""
    tensors: dict[str, torch.Tensor] = {}
    parts: dict[str, tuple] = {}
    for name, p in mp.named_parameters():
        if not mp.writes(p, dp_rank):
            continue
        state = {k: v if isinstance(v, torch.Tensor) else torch.tensor(v)
                 for k, v in optimizer.state.get(p, {}).items()}
        for prefix, t in [(MODEL + name, p), *((f"{OPTIM}{name}/{k}", v)
                                                for k, v in state.items())]:
            if t.dim() == 0:  # a scalar (Adam's step): whole, from tp rank 0
                if mp.tp_comm.rank == 0:
                    tensors[prefix] = t.detach()
                continue
            for i, box in enumerate(mp.boxes(name, p)):
                key = f"{prefix}#r{rank}.{i}"
                tensors[key] = t.detach()[box.local_slices()].contiguous()
                parts[key] = (prefix, box.global_shape,
                              {"offsets": list(box.global_offsets), "shape": list(box.shape)})
    return tensors, parts
