"""Hybrid dp x pp x tp layouts through the Trainer: each follows the single-process run.

Every layout of the issue, with each pipeline schedule that applies, trains the tiny GPT
(4 blocks) for 6 steps and must end with the final weights of the one-process run on
the same global batch (fp32, atol 1e-4); the layouts with dp = 2 also run under ZeRO-1,
(2, 1, 2) under ZeRO-2 and 3 (also with sequence parallelism), (2, 2, 1) under ZeRO-2
and 3 with every schedule, and (2, 2, 2) under ZeRO-2 and 3 with 1F1B.
The runs of one world size share one spawn (a new DeviceMesh per run). A checkpoint
saved at (2, 2, 1) resumes at (1, 1, 4) and at (1, 1, 1) on the same trajectory; a
ZeRO-3 one saved at (2, 2, 1) resumes at (1, 1, 4), at (2, 1, 1) under ZeRO-1 and on
one rank unsharded.

atol 1e-4: the layouts sum the same terms in other orders (micro-batches, tp shards,
reduce-scatter vs all-reduce), so fp32 rounding differs by ~1e-7 per step; AdamW's
normalised steps of lr 3e-3 keep that far below 1e-4 over 6 steps, while a wrong
gradient (a missing micro-batch, a tied weight not summed, a shard reduced twice)
moves weights by 1e-3 or more in one step.

6 steps: 2 of warmup, then 4 at full lr, with a metrics step (and the checkpoint the
resume tests load) half-way; every step costs the 21 layouts of world 4 about 1.5 s on
2 cores, and a step beyond those checks nothing the earlier ones did not.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support import TINY_MODEL, SyntheticTokens, _tiny_train

from disttrain.config import load_config
from disttrain.errors import ConfigError
from disttrain.run_checks import resolve
from disttrain.testing import run_distributed

pytestmark = pytest.mark.slow  # spawns worlds or trains: not in the quick check

STEPS = 6
HALF = STEPS // 2  # the metrics step and the resume tests' checkpoint
MODEL = {**TINY_MODEL, "n_layer": 4, "n_head": 4}
# (dp, pp, tp) -> schedules to run (None: no pipeline)
LAYOUTS = {
    2: [((2, 1, 1), [None]), ((1, 2, 1), ["gpipe", "1f1b", "interleaved"]),
        ((1, 1, 2), [None])],
    4: [((2, 2, 1), ["gpipe", "1f1b"]), ((2, 1, 2), [None]),
        ((1, 2, 2), ["1f1b", "interleaved"]), ((1, 4, 1), ["gpipe", "1f1b"]),
        ((1, 1, 4), [None])],
    8: [((2, 2, 2), ["1f1b"])],
}


def _config(layout: tuple[int, int, int] = (1, 1, 1), schedule: str | None = None,
            zero: int = 0, steps: int = STEPS, checkpoint: dict | None = None,
            extra: dict | None = None):
    dp, pp, tp = layout
    extra = extra or {}
    train = {**_tiny_train(), "steps": steps, "grad_accum": 4, "schedule": "constant",
             "warmup_steps": 2, "log_every": HALF, **extra.get("train", {})}
    parallel = {"dp": dp, "pp": pp, "tp": tp, "zero": zero, **extra.get("parallel", {})}
    if schedule:
        parallel["pp_schedule"] = schedule
    return load_config(values={"model": MODEL, "train": train, "parallel": parallel,
                               "checkpoint": checkpoint or {"every": 0},
                               "monitor": {"peak_tflops": 1.0}})


def smoothed_loss(logits: torch.Tensor, targets: torch.Tensor):
    """A loss the vocabulary-parallel cross-entropy does not compute: label smoothing
    0.1 (summed over the counted positions, with their count)."""
    keep = targets != -1
    loss = torch.nn.functional.cross_entropy(logits[keep].float(), targets[keep],
                                             label_smoothing=0.1, reduction="sum")
    return loss, keep.sum()


def _fit(run_dir: str, loss_fn=None, **kw) -> None:
    from disttrain import Trainer
    from disttrain.data import collate_token_batch
    from disttrain.models import GPT, token_loss

    cfg = _config(**kw)
    torch.manual_seed(cfg.train.seed)
    model = GPT(cfg.model)
    Trainer(model, SyntheticTokens(mask=True), loss_fn or token_loss, cfg, run_dir=run_dir,
            collate_fn=collate_token_batch, progress=False).fit()


def _weights(run_dir: str | Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(run_dir) / "model.safetensors"))


def _run_layouts(root: str, cases: list[tuple]) -> None:
    """Every case in this one set of processes; rank 0's final weights land on disk."""
    for name, layout, schedule, zero, extra in cases:
        _fit(f"{root}/{name}", layout=layout, schedule=schedule, zero=zero, extra=extra)


def _cases(world: int) -> list[tuple]:
    out = []
    for layout, schedules in LAYOUTS[world]:
        for schedule in schedules:
            for zero in (0, 1) if layout[0] > 1 else (0,):
                name = "x".join(map(str, layout)) + f"-{schedule}-z{zero}"
                out.append((name, layout, schedule, zero, None))
    if world == 4:  # ZeRO-2/3 under tensor parallelism and under every schedule
        out += [(f"2x1x2-None-z{z}", (2, 1, 2), None, z, None) for z in (2, 3)]
        out += [(f"2x2x1-{s}-z{z}", (2, 2, 1), s, z, None)
                for s in ("gpipe", "1f1b", "interleaved") for z in (2, 3)]
        # sequence parallelism's partial gradients summed on ZeRO-2 shards
        out.append(("2x1x2-sp-z2", (2, 1, 2), None, 2,
                    {"parallel": {"sequence_parallel": True}}))
        # sequence parallelism and activation checkpointing inside a pipeline
        out.append(("1x2x2-sp-ac", (1, 2, 2), "1f1b", 0,
                    {"parallel": {"sequence_parallel": True},
                     "train": {"activation_checkpointing": "full"}}))
    if world == 8:
        out += [(f"2x2x2-1f1b-z{z}", (2, 2, 2), "1f1b", z, None) for z in (2, 3)]
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, torch.Tensor]:
    root = tmp_path_factory.mktemp("ref")
    run_distributed(_fit, 1, args=(str(root),), timeout=120)
    return _weights(root)


def _assert_close(a: dict, b: dict, atol: float, what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0,
                                   msg=lambda m, k=k: f"{what}: {k}: {m}")


@pytest.mark.parametrize("world", [2, 4, 8])
def test_every_layout_follows_the_single_process_run(world, reference, tmp_path):
    cases = _cases(world)
    run_distributed(_run_layouts, world, args=(str(tmp_path), cases), timeout=300)
    for name, *_ in cases:
        _assert_close(_weights(tmp_path / name), reference, 1e-4, name)


def _resume_at(run_dir: str, layout: tuple[int, int, int]) -> None:
    _fit(run_dir, layout=layout, schedule="1f1b", checkpoint={"every": HALF, "async": False})


def test_checkpoint_from_dp2_pp2_resumes_at_tp4_and_one_rank(reference, tmp_path):
    saved = tmp_path / "saved"
    run_distributed(_fit, 4, args=(str(saved),), timeout=180,
                    kwargs={"layout": (2, 2, 1), "schedule": "1f1b", "steps": HALF,
                            "checkpoint": {"every": HALF, "async": False}})
    for world, layout in ((4, (1, 1, 4)), (1, (1, 1, 1))):
        run_dir = tmp_path / f"resumed-{world}"
        shutil.copytree(saved, run_dir)
        run_distributed(_resume_at, world, args=(str(run_dir), layout), timeout=180)
        _assert_close(_weights(run_dir), reference, 1e-4, f"resumed at {layout}")


def _resume_zero(run_dir: str, layout: tuple[int, int, int], zero: int) -> None:
    _fit(run_dir, layout=layout, zero=zero, checkpoint={"every": HALF, "async": False})


def test_zero3_checkpoint_from_dp2_pp2_resumes_in_any_layout_and_stage(reference, tmp_path):
    """The ZeRO-3 shards of a pipeline are pieces of the global tensors: they load at
    (1, 1, 4), at (2, 1, 1) under ZeRO-1 and on one rank without ZeRO."""
    saved = tmp_path / "saved"
    run_distributed(_fit, 4, args=(str(saved),), timeout=180,
                    kwargs={"layout": (2, 2, 1), "schedule": "1f1b", "zero": 3,
                            "steps": HALF, "checkpoint": {"every": HALF, "async": False}})
    for world, layout, zero in ((4, (1, 1, 4), 0), (2, (2, 1, 1), 1), (1, (1, 1, 1), 0)):
        run_dir = tmp_path / f"resumed-{world}-z{zero}"
        shutil.copytree(saved, run_dir)
        run_distributed(_resume_zero, world, args=(str(run_dir), layout, zero), timeout=180)
        _assert_close(_weights(run_dir), reference, 1e-4, f"resumed at {layout} z{zero}")


@pytest.mark.parametrize("parallel, train, field", [
    ({"pp": 2, "pp_schedule": "interleaved"}, {"grad_accum": 3, "global_batch": 12},
     "train.grad_accum"),
    ({"pp": 2, "pp_schedule": "interleaved", "pp_virtual": 1}, {}, "parallel.pp_virtual"),
    ({"pp": 4, "pp_schedule": "interleaved"}, {"grad_accum": 4}, "parallel.pp_schedule"),
    ({"pp": 2, "pp_split": "0,9"}, {}, "parallel.pp_split"),
    ({"tp": 8}, {}, "model.n_head"),
    ({"pp": 2, "balance": "dynamic"}, {}, "parallel.balance"),
])
def test_invalid_pipeline_and_tensor_layouts_are_refused_with_the_fix(parallel, train, field):
    values = {"model": MODEL, "train": {"grad_accum": 4, **train},
              "parallel": parallel, "checkpoint": {"every": 0}}
    with pytest.raises(ConfigError) as info:
        resolve(load_config(values=values), 8)
    assert info.value.field == field and info.value.fix
    assert "\n" not in str(info.value)


def _fit_smoothed(root: str, layouts: list[tuple]) -> None:
    for name, layout, schedule, extra in layouts:
        _fit(f"{root}/{name}", loss_fn=smoothed_loss, layout=layout, schedule=schedule,
             extra=extra)


def test_a_custom_loss_under_a_vocabulary_parallel_head_is_honoured(tmp_path):
    """The head's logits are sharded over tp: the user's loss (label smoothing) gets the
    gathered logits and trains the one-process run's weights, at tp 2 (with and without
    sequence parallelism) and in a (1, 2, 2) pipeline; it is never swapped for the plain
    causal-LM loss, whose weights differ from it by far more than the tolerance."""
    run_distributed(_fit_smoothed, 1, args=(str(tmp_path), [("ref", (1, 1, 1), None, None)]),
                    timeout=120)
    run_distributed(_fit, 1, args=(str(tmp_path / "plain"),), timeout=120)
    cases = [("tp2", (1, 1, 2), None, None),
             ("tp2-sp", (1, 1, 2), None, {"parallel": {"sequence_parallel": True}})]
    run_distributed(_fit_smoothed, 2, args=(str(tmp_path), cases), timeout=180)
    run_distributed(_fit_smoothed, 4, args=(str(tmp_path), [("pp2tp2", (1, 2, 2), "1f1b",
                                                              None)]), timeout=180)
    ref = _weights(tmp_path / "ref")
    for name in ("tp2", "tp2-sp", "pp2tp2"):
        _assert_close(_weights(tmp_path / name), ref, 1e-4, name)
    plain = _weights(tmp_path / "plain")
    assert max((plain[k] - ref[k]).abs().max().item() for k in ref) > 1e-3

