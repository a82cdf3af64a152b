"""The trainer's side of checkpoints: what to save, when, and resuming from one.

What this rank saves is whatever its composed training state says it owns
(:meth:`~disttrain.parallel.interfaces.ShardedState.state_pieces`: boxes of global
tensors under global names) plus its own RNG streams; loading hands the checkpoint's
reader to the same state, which cuts out its part whatever layout wrote it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..checkpoint.manager import CheckpointManager, find_checkpoint, open_checkpoint
from ..checkpoint.state import restore_rng, rng_tensors
from ..comm import Communicator
from ..config import Config, RunPlan
from ..errors import UserError
from ..parallel.interfaces import ShardedState, StatePiece


class RunCheckpoints:
    """Saves every ``checkpoint.every`` steps and at the end; resumes a run directory."""

    def __init__(self, run_dir: Path, config: Config, plan: RunPlan, world: Communicator,
                 state: ShardedState, optimizer: torch.optim.Optimizer) -> None:
        self.run_dir, self.config, self.plan = run_dir, config, plan
        self.world, self.state, self.optimizer = world, state, optimizer
        ck = config.checkpoint
        self.every = ck.every
        self.manager = CheckpointManager(run_dir, world.rank, world.size, keep=ck.keep,
                                         async_save=ck.async_)
        self.stall_s = 0.0
        self.last_saved = -1  # the step of this run's latest save

    def resume(self, say: Callable[[str], None]) -> tuple[int, int] | None:
        """Load the newest intact checkpoint, if any: returns (step, sample position).
        Rank 0 chooses (verifying checksums) and tells the others."""
        choice: tuple[str, str | None] = ("none", None)
        if self.world.rank == 0:
            try:
                found = find_checkpoint(self.run_dir, warn=say)
                if found and not self.config.checkpoint.allow_changes:
                    self._check_unchanged(open_checkpoint(found).meta)
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
        self.state.load_state(ckpt.reader, self.optimizer)
        restore_rng(ckpt.reader, self.world.rank)
        saved_world = ckpt.meta.get("world_size")
        say(f"resuming from {Path(value).name}: step {ckpt.step}, sample "
            f"{ckpt.meta['position']} (saved on {saved_world} rank(s), now "
            f"{self.world.size})")
        return ckpt.step, int(ckpt.meta["position"])

    def _check_unchanged(self, meta: dict[str, Any]) -> None:
        """Refuse to continue a checkpoint under settings that change the trajectory."""
        saved = _trajectory(meta.get("config", {}), meta.get("global_batch"))
        now = _trajectory(self.config.to_dict(), self.plan.batch.global_batch)
        changed = sorted(k for k in saved.keys() & now.keys() if saved[k] != now[k])
        if changed:
            diffs = ", ".join(f"{k}: {saved[k]!r} -> {now[k]!r}" for k in changed)
            raise UserError(f"{self.run_dir} holds a checkpoint of a different run "
                            f"({diffs}); resuming would change its trajectory (give "
                            "another run directory, or --set checkpoint.allow_changes=true "
                            "to continue it anyway)")

    def due(self, step: int) -> bool:
        return bool(self.every) and (step % self.every == 0 or
                                     step == self.config.train.steps)

    def save(self, step: int, position: int) -> None:
        start = time.perf_counter()
        tensors, parts, eager = _layout(self.state.state_pieces(self.optimizer),
                                        self.world.rank)
        own_rng = rng_tensors(self.world.rank)
        tensors.update(own_rng)
        owners = dict.fromkeys(tensors, self.world.rank)
        self.manager.save(step, tensors, owners, self._meta(step, position), parts,
                          eager=frozenset(eager))
        self.stall_s = time.perf_counter() - start
        self.last_saved = step

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


# what a resumed run must share with the checkpoint to follow the same trajectory
# (data.cache_dir only says where shards are cached; train.steps may grow)
TRAJECTORY_SECTIONS = ("model", "data")
TRAJECTORY_KEYS = ("train.seed",)
TRAJECTORY_IGNORED = ("data.cache_dir",)


def _trajectory(config: dict[str, dict[str, Any]], global_batch: Any) -> dict[str, Any]:
    """The settings of ``config`` (a ``Config.to_dict()``) that fix the trajectory."""
    out = {f"{s}.{k}": v for s in TRAJECTORY_SECTIONS for k, v in config.get(s, {}).items()}
    for key in TRAJECTORY_KEYS:
        section, _, name = key.partition(".")
        out[key] = config.get(section, {}).get(name)
    for key in TRAJECTORY_IGNORED:
        out.pop(key, None)
    return out | {"train.global_batch": global_batch}


def _layout(pieces: list[StatePiece], rank: int
            ) -> tuple[dict[str, torch.Tensor], dict[str, tuple], list[str]]:
    """The manager's view of this rank's pieces: tensors by unique key, the global
    name / shape / box of each key that is not a whole tensor, and the eager keys."""
    tensors: dict[str, torch.Tensor] = {}
    parts: dict[str, tuple] = {}
    eager = []
    for piece in pieces:
        key = piece.name
        if not piece.is_whole:
            key = f"{piece.name}#r{rank}@{','.join(map(str, piece.offsets))}"
            parts[key] = (piece.name, piece.global_shape,
                          {"offsets": list(piece.offsets), "shape": list(piece.tensor.shape)})
        tensors[key] = piece.tensor
        if piece.eager:
            eager.append(key)
    return tensors, parts, eager
