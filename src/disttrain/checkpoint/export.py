"""A run's model weights, unsharded: one safetensors file, or a Hugging Face directory
(``config.json`` + ``model.safetensors``) that ``from_pretrained`` loads."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..errors import UserError
from ..names import MODEL_CONFIG_FILE
from .format import dtype_from_name
from .manager import LoadedCheckpoint, find_checkpoint, open_checkpoint
from .state import MODEL
from .stream import write_streamed


def newest_checkpoint(run_dir: Path, warn: Callable[[str], None]) -> LoadedCheckpoint:
    """The newest intact checkpoint of ``run_dir``, open (refused in one line when the
    directory or any checkpoint is missing)."""
    if not Path(run_dir).is_dir():
        raise UserError(f"run directory {str(run_dir)!r} does not exist")
    directory = find_checkpoint(Path(run_dir), warn)
    if directory is None:
        raise UserError(f"{run_dir} holds no checkpoint (train with checkpoint.every > 0)")
    return open_checkpoint(directory)


def _write_model(ckpt: LoadedCheckpoint, out: Path, metadata: dict[str, str]) -> None:
    """Every ``model/...`` tensor under its plain parameter name (a tied weight once,
    under its first name), assembled and written one tensor at a time."""
    reader = ckpt.reader
    names = reader.names(MODEL)
    entries = [(n[len(MODEL):], reader.shape(n),
                dtype_from_name(reader.index.tensors[n].dtype)) for n in names]
    write_streamed(out, entries, lambda name: reader.tensor(MODEL + name), metadata)


def export_weights(run_dir: Path, out: Path, warn: Callable[[str], None]) -> tuple[Path, int]:
    """Assemble every ``model/...`` tensor of the newest intact checkpoint of ``run_dir``
    into ``out`` under its plain parameter name (load it with
    ``safetensors.torch.load_model(model, out)``). Returns (out, step)."""
    ckpt = newest_checkpoint(run_dir, warn)
    _write_model(ckpt, Path(out), {"format": "disttrain-export", "step": str(ckpt.step)})
    return Path(out), ckpt.step


def export_hf(run_dir: Path, out_dir: Path, warn: Callable[[str], None]) -> tuple[Path, int]:
    """``out_dir/config.json`` (the model's own config, kept by the run) and
    ``out_dir/model.safetensors`` (the newest checkpoint's weights under the model's own
    parameter names, tied weights stored once): what
    ``AutoModelForCausalLM.from_pretrained(out_dir)`` loads. Returns (out_dir, step)."""
    config = Path(run_dir) / MODEL_CONFIG_FILE
    if Path(run_dir).is_dir() and not config.is_file():
        raise UserError(f"{run_dir} has no {MODEL_CONFIG_FILE}: --format hf exports runs "
                        "of transformers models (use the default format for others)")
    ckpt = newest_checkpoint(run_dir, warn)
    out_dir = Path(out_dir)
    _write_model(ckpt, out_dir / "model.safetensors", {"format": "pt"})
    (out_dir / "config.json").write_text(config.read_text(encoding="utf-8"),
                                         encoding="utf-8")
    return out_dir, ckpt.step
