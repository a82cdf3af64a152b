"""The run's final weights written from every rank's pieces, one tensor at a time.

No rank gathers the model: each rank writes the pieces it holds
(:func:`~disttrain.parallel.pieces.weight_pieces`) to a staging file of its
own in the run directory; rank 0 then assembles each global tensor from the staging
files and streams it into ``model.safetensors`` (:func:`~disttrain.checkpoint.stream.
write_streamed`), holding at most one whole tensor, and removes the staging directory.
A piece seen twice (a replicated buffer) is written once; a tensor its pieces do not
cover exactly is an error, never a file with holes.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import cast

import torch
from safetensors import safe_open

from ..checkpoint.export import STEP_KEY
from ..checkpoint.state import MODEL
from ..checkpoint.stream import write_streamed
from ..comm.collectives import Communicator
from ..names import WEIGHTS_FILE
from ..parallel.placement import StatePiece

STAGING = ".final-weights"
# a rank's pieces: (name, global shape, offsets, piece shape, dtype) each
_Layout = list[tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...], torch.dtype]]


def write_final_weights(pieces: list[StatePiece], world: Communicator,
                        run_dir: Path, step: int) -> str | None:
    """Write ``run_dir/model.safetensors`` from every rank's ``pieces``, the weights
    after ``step`` steps (recorded in its header, for ``disttrain export``; collective:
    every rank calls it). Returns the problem (an I/O error) or None, on every rank."""
    staging, rank = Path(run_dir) / STAGING, world.rank
    problem = None
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)
        try:
            staging.mkdir(parents=True)
        except OSError as exc:
            problem = f"{staging}: {exc.strerror or exc}"
    problem = cast("str | None", world.broadcast_object(problem))
    if problem is not None:
        return problem
    layout: _Layout = [(p.name, tuple(p.global_shape), tuple(p.offsets),
                        tuple(p.tensor.shape), p.tensor.dtype) for p in pieces]
    try:  # piece by piece: no copy of this rank's whole share at once
        if pieces:
            write_streamed(staging / f"rank{rank:05d}.safetensors",
                           [(str(i), shape, dtype)
                            for i, (_, _, _, shape, dtype) in enumerate(layout)],
                           lambda key: pieces[int(key)].tensor)
    except (OSError, ValueError) as exc:
        problem = f"{staging}: {exc}"
    everyone = cast(list[tuple[_Layout, "str | None"]],
                    world.all_gather_object((layout, problem)))
    problems = [p for _, p in everyone if p is not None]
    if rank == 0 and not problems:
        try:
            _assemble(staging, [planned for planned, _ in everyone], Path(run_dir) / WEIGHTS_FILE,
                      {STEP_KEY: str(step)})
        except OSError as exc:
            problems.append(f"{run_dir / WEIGHTS_FILE}: {exc.strerror or exc}")
        shutil.rmtree(staging, ignore_errors=True)
    return cast("str | None", world.broadcast_object(problems[0] if problems else None))


def _assemble(staging: Path, layouts: list[_Layout], out: Path,
              metadata: dict[str, str]) -> None:
    where: dict[str, list[tuple[int, int, tuple, tuple]]] = {}
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for rank, layout in enumerate(layouts):
        for i, (name, global_shape, offsets, shape, dtype) in enumerate(layout):
            if any(o == offsets for _, _, o, _ in where.get(name, ())):
                continue  # the same box again (a replicated tensor): once
            where.setdefault(name, []).append((rank, i, offsets, shape))
            shapes[name] = (global_shape, dtype)

    def fetch(key: str) -> torch.Tensor:
        shape, dtype = shapes[MODEL + key]
        out_t = torch.empty(shape, dtype=dtype)
        covered = 0
        for rank, i, offsets, sizes in where[MODEL + key]:
            # opened per piece: a mapping kept open would keep every page read resident
            with safe_open(str(staging / f"rank{rank:05d}.safetensors"), "pt") as f:
                piece = f.get_tensor(str(i))
            out_t[tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))] = piece
            covered += piece.numel()
        if covered != out_t.numel():
            raise ValueError(f"final weights: the pieces of {key} cover {covered} of its "
                             f"{out_t.numel()} elements")
        return out_t

    names = sorted(n for n in where if n.startswith(MODEL))
    write_streamed(out, [(n[len(MODEL):], *shapes[n]) for n in names], fetch, metadata)
