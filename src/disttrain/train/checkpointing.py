"""The trainer's side of checkpoints: what to save, when, and resuming from one.

What this rank saves is whatever its composed training state says it owns
(:meth:`~disttrain.parallel.interfaces.ShardedState.state_pieces`: boxes of global
tensors under global names) plus its own RNG streams; loading hands the checkpoint's
reader to the same state, which cuts out its part whatever layout wrote it. Frozen
parameters are not saved: each checkpoint records their fingerprint
(:mod:`disttrain.checkpoint.fingerprint`), and a resume refuses a base that differs.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch

from ..checkpoint.fingerprint import FROZEN_KEY, first_difference
from ..checkpoint.manager import CheckpointManager, SaveFailed, find_checkpoint, open_checkpoint
from ..checkpoint.state import restore_rng, rng_tensors
from ..checkpoint.storage import step_name
from ..comm import Communicator, ReduceOp
from ..config import Config, RunPlan
from ..errors import CheckpointSaveError, DivergenceError, UserError
from ..names import SUMMARY_FILE
from ..parallel.interfaces import ShardedState
from ..parallel.placement import StatePiece

# torch's stubs type ReduceOp's members as ReduceOp.RedOpType; at run time they
# are ReduceOp instances, what Communicator.all_reduce takes
_MAX = cast(ReduceOp, ReduceOp.MAX)
# a rank's outcome of one part of a save: None, or (its own write failed, one line)
_Problem = tuple[bool, str] | None


def finished_run(run_dir: Path, steps: int, warn: Callable[[str], None]) -> str | None:
    """One line saying ``run_dir``'s run is finished: its summary (written once the final
    weights are) and its newest intact checkpoint, if it has any, both reached
    ``steps``. None while steps remain, or when a run stopped between its last
    checkpoint and its final weights (resuming writes them). UserError if every
    checkpoint is damaged (as :func:`find_checkpoint`)."""
    found = find_checkpoint(run_dir, warn)
    completed = _summary_steps(run_dir / SUMMARY_FILE)
    step = completed if found is None else open_checkpoint(found).step
    if completed is None or step is None or min(completed, step) < steps:
        return None
    if found is not None:
        more = (f"raise train.steps to continue it, e.g. --run-dir {run_dir} "
                f"--set train.steps={step + steps}")
    else:
        more = "it saved no checkpoint to continue from: give a new --run-dir to train again"
    return (f"{run_dir} is a finished run: it reached step {step} and train.steps is "
            f"{steps}; nothing to do, no file was changed ({more})")


def _summary_steps(path: Path) -> int | None:
    try:
        steps = json.loads(path.read_text()).get("steps")
    except (OSError, ValueError, AttributeError):
        return None
    return steps if isinstance(steps, int) else None


class RunCheckpoints:
    """Saves every ``checkpoint.every`` steps and at the end; resumes a run directory."""

    def __init__(self, run_dir: Path, config: Config, plan: RunPlan, world: Communicator,
                 state: ShardedState, optimizer: torch.optim.Optimizer,
                 boxes: dict[str, list] | None = None,
                 frozen: dict[str, list[float]] | None = None) -> None:
        self.run_dir, self.config, self.plan = run_dir, config, plan
        self.world, self.state, self.optimizer = world, state, optimizer
        self.boxes = boxes  # what this rank holds of each tensor: read only that
        self.frozen = frozen or {}  # the frozen parameters' fingerprints (not saved)
        self.bytes_read = 0  # of the checkpoint resumed from
        ck = config.checkpoint
        self.every = ck.every
        self.manager = CheckpointManager(run_dir, world.rank, world.size, keep=ck.keep,
                                         async_save=ck.async_)
        self.stall_s = 0.0
        self.last_saved = -1  # the step of this run's latest save
        self.saving: int | None = None  # the step of a save not yet known to be done
        self.completed: list[int] = []  # steps saved since the last take_completed()

    def resume(self, say: Callable[[str], None]) -> tuple[int, int] | None:
        """Load the newest intact checkpoint, if any: returns (step, sample position).
        Rank 0 chooses (verifying checksums) and tells the others."""
        choice: tuple[str, str | None] = ("none", None)
        if self.world.rank == 0:
            try:
                found = find_checkpoint(self.run_dir, warn=say)
                if found and not self.config.checkpoint.allow_changes:
                    meta = open_checkpoint(found).meta
                    self._check_unchanged(meta)
                    self._check_frozen(meta)
                choice = ("load", str(found)) if found else ("none", None)
            except UserError as exc:
                choice = ("error", str(exc))
        kind, value = cast(tuple[str, "str | None"], self.world.broadcast_object(choice))
        if kind == "error":
            raise UserError(value)
        self.manager.prepare()
        if kind == "none" or value is None:  # "load" always names the checkpoint
            return None
        ckpt = open_checkpoint(Path(value))
        if self.boxes is not None:
            ckpt.reader.want(self.boxes)
        self.state.load_state(ckpt.reader, self.optimizer)
        self.bytes_read = ckpt.reader.bytes_read
        restore_rng(ckpt.reader, self.world.rank)
        saved_world = ckpt.meta.get("world_size")
        total = self.config.train.steps
        say(f"resuming from {Path(value).name}: step {ckpt.step}, sample "
            f"{ckpt.meta['position']} (saved on {saved_world} rank(s), now "
            f"{self.world.size}); training steps {ckpt.step + 1}-{total} of {total}")
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

    def _check_frozen(self, meta: dict[str, Any]) -> None:
        """Refuse to continue a checkpoint whose frozen parameters (not in it: they came
        from the run's source) differ from this run's (a checkpoint written before
        frozen parameters were left out holds them all and records none)."""
        saved = meta.get(FROZEN_KEY)
        if saved is None:
            return
        diff = first_difference(saved, self.frozen)
        if diff is not None:
            raise UserError(f"{self.run_dir} holds a checkpoint trained on another frozen "
                            f"base: {diff} (the frozen parameters come from "
                            "model.pretrained or the seed, not the checkpoint; give the "
                            "run's own, or --set checkpoint.allow_changes=true to "
                            "continue anyway)")

    def due(self, step: int) -> bool:
        return bool(self.every) and (step % self.every == 0 or
                                     step == self.config.train.steps)

    def directory(self, step: int) -> Path:
        """Where the checkpoint of ``step`` is (once committed)."""
        return self.manager.root / step_name(step)

    def save(self, step: int, position: int) -> None:
        """Save after step ``step`` (a collective). Raises, on every rank alike,
        :class:`~disttrain.errors.DivergenceError` if the state holds a nan / inf
        (nothing written) and :class:`~disttrain.errors.CheckpointSaveError` if a rank
        could not write its part (a synchronous save at once, an asynchronous one at
        the first step boundary after every rank is done); either way ``latest`` still
        names the previous checkpoint."""
        start = time.perf_counter()
        self._collect()  # the previous asynchronous save, if still pending
        pieces = self.state.state_pieces(self.optimizer)
        self._refuse_nonfinite(step, pieces)
        tensors, parts, eager = _layout(pieces, self.world.rank)
        own_rng = rng_tensors(self.world.rank)
        tensors.update(own_rng)
        owners = dict.fromkeys(tensors, self.world.rank)
        meta = self._meta(step, position)
        self.saving = step
        if self.manager.async_save:
            self.manager.save(step, tensors, owners, meta, parts, eager=frozenset(eager))
        else:  # every rank's part is written before rank 0 commits
            self._agree(_attempt(lambda: self.manager.save(
                step, tensors, owners, meta, parts, eager=frozenset(eager), commit=False)))
            if self.world.rank == 0:
                committed = _attempt(lambda: self.manager.commit(step, meta))
            self._agree(cast(_Problem, self.world.broadcast_object(
                committed if self.world.rank == 0 else None)))
            self.saving = None
            self.completed.append(step)
        self.stall_s = time.perf_counter() - start
        self.last_saved = step

    def check(self) -> None:
        """At a step boundary, while an asynchronous save is pending: once no rank is
        still writing, collect its outcome (a failure stops training here). One
        one-element all-reduce per step while a save is in flight, none otherwise."""
        if not self.manager.pending:  # the same on every rank: saves start together
            return
        writing = self.world.zeros(1)
        writing[0] = float(self.manager.writing)
        self.world.all_reduce(writing, op=_MAX)
        if not writing.item():
            self._collect()

    def _collect(self) -> None:
        """Wait for this rank's asynchronous save and agree on every rank's outcome."""
        if self.manager.pending:
            self._agree(_attempt(self.manager.wait))
            if self.saving is not None:
                self.completed.append(self.saving)
                self.saving = None

    def take_completed(self) -> list[int]:
        """The steps whose checkpoints were committed since the last call."""
        done, self.completed = self.completed, []
        return done

    def _agree(self, problem: _Problem) -> None:
        """Every rank learns whether any rank's part of the save in progress failed
        (``problem``: (the rank's own write failed, one line)); if one did, rank 0
        removes the staging directory and every rank raises the failing rank's line."""
        gathered = cast(list[_Problem], self.world.all_gather_object(problem))
        problems = [p for p in gathered if p is not None]
        if not problems:
            return
        step, self.saving = self.saving, None
        if self.world.rank == 0 and step is not None:
            self.manager.abandon(step)
        own = [text for mine, text in problems if mine] or [problems[0][1]]
        raise CheckpointSaveError(f"{own[0]}; the save was abandoned (staging removed), "
                                  "the previous checkpoint is still the latest")

    def _refuse_nonfinite(self, step: int, pieces: list[StatePiece]) -> None:
        """A state holding nan / inf is never saved, so retention can never drop a
        finite checkpoint for it: one all-reduce of a flag, then the name of the
        first bad tensor."""
        floats = [p for p in pieces if p.tensor.is_floating_point()]
        flags = [torch.isfinite(p.tensor).all() for p in floats]
        bad = self.world.zeros(1)
        if flags:
            bad[0] = (~torch.stack(flags).all()).float().to(bad.device)
        self.world.all_reduce(bad, op=_MAX)
        if not bad.item():
            return
        mine = next((p.name for p, ok in zip(floats, flags, strict=True) if not ok), None)
        names = [n for n in self.world.all_gather_object(mine) if n is not None]
        raise DivergenceError(step, f"model state ({names[0]})")

    def before_update(self) -> None:
        """Before the optimizer changes parameters and state: wait until an async save
        has its snapshot (normally taken during the forward and backward)."""
        self.stall_s += self.manager.before_update()

    def _meta(self, step: int, position: int) -> dict[str, Any]:
        planned = self.plan.layout
        return {"step": step, "position": position, "world_size": self.world.size,
                "layout": planned.as_dict(),
                "global_batch": self.plan.batch.global_batch,
                "seed": self.config.train.seed, "optimizer": self.config.train.optimizer,
                "config": self.config.to_dict(), "saved_at": time.time(),
                **({FROZEN_KEY: self.frozen} if self.frozen else {})}

    def close(self) -> None:
        """Wait for a pending asynchronous save (a collective: it may have failed)."""
        self._collect()


def _attempt(save: Callable[[], None]) -> _Problem:
    """Run one part of a save: None if it worked, else (this rank's own write failed,
    the one-line message)."""
    try:
        save()
    except SaveFailed as exc:
        return exc.own, str(exc)
    return None


# what a resumed run must share with the checkpoint to follow the same trajectory
# (data.cache_dir only says where shards are cached; train.steps may grow)
TRAJECTORY_SECTIONS = ("model", "data")
TRAJECTORY_KEYS = ("train.seed",)
TRAJECTORY_IGNORED = ("data.cache_dir",)


def _trajectory(config: dict[str, dict[str, Any]], global_batch: Any) -> dict[str, Any]:
    """The settings of ``config`` (a ``Config.to_dict()``, or its JSON: a list there is
    a tuple here) that fix the trajectory."""
    out = {f"{s}.{k}": list(v) if isinstance(v, tuple) else v
           for s in TRAJECTORY_SECTIONS for k, v in config.get(s, {}).items()}
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
