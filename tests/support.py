"""Shared pieces for the tests: a tiny GPT config and synthetic token data."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset

from disttrain.config import load_config
from disttrain.models import IGNORE_INDEX
from disttrain.parallel.compose import Parallelized
from disttrain.parallel.placement import tensor_pieces
from disttrain.param_names import canonical_name

TINY_MODEL = {"vocab_size": 64, "seq_len": 16, "n_layer": 2, "n_head": 2, "d_model": 32}


class SyntheticTokens(Dataset):
    """Random token windows; with ``mask`` each sample hides a different number of its
    targets (IGNORE_INDEX), so samples carry different numbers of loss terms."""

    def __init__(self, n: int = 96, seq_len: int = 16, vocab: int = 64, mask: bool = False,
                 seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, vocab, (n, seq_len + 1), generator=g)
        self.hidden = (torch.randint(0, seq_len, (n,), generator=g) if mask
                       else torch.zeros(n, dtype=torch.long))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        window = self.tokens[i]
        targets = window[1:].clone()
        targets[: int(self.hidden[i])] = IGNORE_INDEX
        return {"input_ids": window[:-1], "targets": targets}


def _tiny_train() -> dict[str, Any]:
    return {"steps": 20, "global_batch": 8, "grad_accum": 1, "lr": 3e-3, "warmup_steps": 3,
            "eval_samples": 8, "log_every": 5}


def tiny_config(checkpoint: dict | None = None, **keys: Any):
    """The tiny GPT's config; checkpoints off unless ``checkpoint`` says otherwise.
    Keyword arguments go to the section that has a field of that name ([train] if
    several do)."""
    from dataclasses import fields

    from disttrain.config.schema import CommConfig, DataConfig, MonitorConfig, ParallelConfig

    values: dict[str, dict] = {"model": dict(TINY_MODEL), "train": _tiny_train(),
                               "checkpoint": checkpoint or {"every": 0},
                               "parallel": {}, "monitor": {}, "comm": {}, "data": {}}
    owners = {f.name: "parallel" for f in fields(ParallelConfig)}
    owners |= {f.name: "monitor" for f in fields(MonitorConfig)}
    owners |= {f.name: "comm" for f in fields(CommConfig)}
    owners |= {f.name: "data" for f in fields(DataConfig)}
    for key, value in keys.items():
        values[owners.get(key, "train")][key] = value
    return load_config(values=values)


def state_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def fit_tiny(steps: int, run_dir: str, mask: bool = False, checkpoint: dict | None = None,
             **train: Any) -> dict[str, torch.Tensor]:
    """Train the tiny GPT on synthetic tokens through Trainer; the final state."""
    from disttrain import Trainer
    from disttrain.data import collate_token_batch
    from disttrain.models import GPT, token_loss

    cfg = tiny_config(checkpoint, **train, steps=steps)
    torch.manual_seed(cfg.train.seed)
    model = GPT(cfg.model)
    Trainer(model, SyntheticTokens(mask=mask), token_loss, cfg, run_dir=run_dir,
            collate_fn=collate_token_batch, progress=False).fit()
    return state_of(model)


def copy_checkpoint(src, dst, step: int) -> None:
    """Inside a spawned world: a run dir ``dst`` holding only ``src``'s checkpoint of
    ``step`` (as if that run had stopped there); rank 0 copies, every rank waits."""
    import shutil
    from pathlib import Path

    import torch.distributed as dist

    if dist.get_rank() == 0:
        name = f"step-{step:08d}"
        (Path(dst) / "checkpoints").mkdir(parents=True)
        shutil.copytree(Path(src) / "checkpoints" / name, Path(dst) / "checkpoints" / name)
        (Path(dst) / "checkpoints" / "latest").write_text(name + "\n")
    dist.barrier()


def full_state(parallel: Parallelized) -> dict[str, torch.Tensor] | None:
    """The unsharded model's parameters and buffers on global rank 0 (None
    elsewhere), after ``grads.finalize()`` (a Trainer's ``parallel`` after ``fit()``).
    Where no dimension changed the model every rank holds them; otherwise each
    replica-rank-0 rank sends the boxes it saves (one gather of small objects: meant for
    tests' tiny models, not for models too large for one host)."""
    world = parallel.groups.world
    if not parallel.model_parallel.applied:
        return ({canonical_name(k): v for k, v in parallel.module.state_dict().items()}
                if world.rank == 0 else None)
    mine = []
    if parallel.groups.replicas.rank == 0:
        for name, p in parallel.model_parallel.named_parameters():
            if parallel.placement.writes(p):
                mine += [(name, g.global_shape, g.offsets, g.tensor.detach().cpu().clone())
                         for g in tensor_pieces(name, parallel.placement.boxes(name, p), p)]
    everyone = world.all_gather_object(mine)
    if world.rank != 0:
        return None
    full: dict[str, torch.Tensor] = {}
    for pieces in everyone:
        for name, shape, offsets, t in pieces:
            out = full.setdefault(name, torch.empty(shape, dtype=t.dtype))
            out[tuple(slice(o, o + n) for o, n in zip(offsets, t.shape, strict=True))] = t
    return full


def _train_default_rank(run_dir: str, overrides: list[str]) -> None:
    from disttrain.train import train_default

    train_default(load_config(overrides=overrides), run_dir=run_dir, progress=False)


def reference_of_cli_run(run_dir, argv: list[str], nproc: int, cache: str) -> None:
    """The uninterrupted run of ``disttrain train --nproc NPROC ARGV --run-dir RUN_DIR``
    (its ``--set`` overrides; the cache ``cache``) as its workers train it, each calling
    ``train_default``, in ``nproc`` forked ranks: the reference of a run that is
    interrupted, without the launcher's and each worker's import of torch (~4 s of CPU
    a process)."""
    from disttrain.testing import run_distributed

    overrides = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--set"]
    run_distributed(_train_default_rank, nproc, args=(str(run_dir), overrides),
                    timeout=240, env={"DISTTRAIN_CACHE": str(cache)})
