"""``disttrain export`` takes a run's newest weights: its newest intact checkpoint, or
its final ``model.safetensors`` when there is no checkpoint or they are of a later step
(their header's ``step``); at the same step, or with no step recorded, the checkpoint.
The command says which it used."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from disttrain.checkpoint import CheckpointManager
from disttrain.checkpoint.export import STEP_KEY, export_weights
from disttrain.checkpoint.stream import write_streamed
from disttrain.cli import main
from disttrain.errors import UserError


def _checkpoint(run_dir, step: int) -> None:
    tensors = {"model/w": torch.full((2, 3), float(step)), "model/b": torch.zeros(3)}
    CheckpointManager(run_dir, 0, 1, keep=2, async_save=False).save(
        step, tensors, dict.fromkeys(tensors, 0), {"position": step, "world_size": 1})


def _final(run_dir, step: int | None, value: float = 100.0) -> None:
    tensors = {"w": torch.full((2, 3), value), "b": torch.ones(3)}
    write_streamed(run_dir / "model.safetensors",
                   [(n, tuple(t.shape), t.dtype) for n, t in tensors.items()],
                   tensors.__getitem__, None if step is None else {STEP_KEY: str(step)})


# (checkpoint step or None, final weights' step ("none": not recorded; None: no file),
#  the source expected, the step it reports)
CASES = {
    "only-final": (None, 7, "the final weights model.safetensors", 7),
    "final-newer": (5, 7, "the final weights model.safetensors", 7),
    "same-step": (5, 5, "checkpoint step-", 5),
    "final-without-step": (5, "none", "checkpoint step-", 5),
    "only-checkpoint": (5, None, "checkpoint step-", 5),
    "only-final-without-step": (None, "none", "the final weights model.safetensors", None),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_newest_weights_are_exported_and_named(tmp_path, capsys, case):
    checkpoint, final, source, step = CASES[case]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    if checkpoint is not None:
        _checkpoint(run_dir, checkpoint)
    if final is not None:
        _final(run_dir, None if final == "none" else final)
    out, weights = export_weights(run_dir, tmp_path / "out.safetensors", warn=pytest.fail)
    assert weights.source.startswith(source) and weights.step == step
    expected = 100.0 if source.startswith("the final") else float(checkpoint)
    assert torch.equal(load_file(str(out))["w"], torch.full((2, 3), expected))
    assert main(["export", str(run_dir), "--out", str(tmp_path / "cli.safetensors")]) == 0
    said = "step unknown" if step is None else f"step {step}"
    assert capsys.readouterr().out.startswith(f"wrote {tmp_path / 'cli.safetensors'} "
                                              f"({said}, from {source}")


def test_a_run_with_neither_is_refused(tmp_path):
    with pytest.raises(UserError, match="holds no checkpoint and no final weights"):
        export_weights(tmp_path, tmp_path / "out.safetensors", warn=pytest.fail)


def test_a_damaged_final_weights_file_is_a_user_error(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    with pytest.raises(UserError, match="model.safetensors: not a readable safetensors"):
        export_weights(tmp_path, tmp_path / "out.safetensors", warn=pytest.fail)
