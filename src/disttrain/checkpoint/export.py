"""A run's model weights, unsharded: one safetensors file, or a Hugging Face directory
(``config.json`` + ``model.safetensors``) that ``from_pretrained`` loads.

They come from the newest intact checkpoint, or from the run's final weights
(``model.safetensors``, written when a run finishes) where there is no checkpoint
(``checkpoint.every = 0``) or the final weights are of a later step (their header
records it); at the same step the checkpoint is used (its checksums are verified). The
caller is told which.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from ..errors import UserError
from ..names import MODEL_CONFIG_FILE, WEIGHTS_FILE
from .format import SAFETENSORS_DTYPES, dtype_from_name
from .manager import find_checkpoint, open_checkpoint
from .state import MODEL
from .stream import Entry, write_streamed

STEP_KEY = "step"  # the final weights' header: the step they are of
_FROM_SAFETENSORS = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}


@dataclass(frozen=True)
class ExportedWeights:
    """Where exported weights come from: every tensor's (plain name, shape, dtype), how
    to read one whole, the step (None: not recorded), the source in words, and the
    checkpoint's records (its ``meta``: the run's config, a fingerprint of frozen
    tensors) when they come from one (None: the final weights)."""

    entries: list[Entry]
    fetch: Callable[[str], torch.Tensor]
    step: int | None
    source: str
    meta: dict[str, Any] | None = None


def newest_weights(run_dir: Path, warn: Callable[[str], None]) -> ExportedWeights:
    """The newest weights of ``run_dir`` (see the module docstring)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"run directory {str(run_dir)!r} does not exist")
    directory = find_checkpoint(run_dir, warn)
    final = _final_weights(run_dir / WEIGHTS_FILE)
    if directory is not None:
        ckpt = open_checkpoint(directory)
        reader = ckpt.reader
        step = reader.index.step
        if final is None or final.step is None or final.step <= step:
            names = reader.names(MODEL)
            return ExportedWeights(
                [(n[len(MODEL):], reader.shape(n),
                  dtype_from_name(reader.index.tensors[n].dtype)) for n in names],
                lambda name: reader.tensor(MODEL + name), step,
                f"checkpoint {directory.name}", dict(ckpt.meta))
    if final is None:
        raise UserError(f"{run_dir} holds no checkpoint and no final weights "
                        f"({WEIGHTS_FILE}: the run has not finished); train with "
                        "checkpoint.every > 0, or let the run finish")
    return final


def _final_weights(path: Path) -> ExportedWeights | None:
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), "pt") as f:
            step = (f.metadata() or {}).get(STEP_KEY)
            entries = [(n, tuple(f.get_slice(n).get_shape()),
                        _FROM_SAFETENSORS[f.get_slice(n).get_dtype()]) for n in f.keys()]
    except (OSError, KeyError, ValueError, SafetensorError) as exc:
        raise UserError(f"{path}: not a readable safetensors file ({exc})") from None

    def fetch(name: str) -> torch.Tensor:
        with safe_open(str(path), "pt") as f:  # one tensor read at a time
            return f.get_tensor(name)
    return ExportedWeights(sorted(entries), fetch,
                           int(step) if step and step.isdigit() else None,
                           f"the final weights {WEIGHTS_FILE}")


def export_weights(run_dir: Path, out: Path, warn: Callable[[str], None]
                   ) -> tuple[Path, ExportedWeights]:
    """Write every model tensor of the newest weights of ``run_dir`` into ``out`` under
    its plain parameter name (load it with ``safetensors.torch.load_model(model,
    out)``). Returns (out, where they came from)."""
    weights = newest_weights(run_dir, warn)
    write_streamed(Path(out), weights.entries, weights.fetch,
                   {"format": "disttrain-export", STEP_KEY: str(weights.step)})
    return Path(out), weights


def export_hf(run_dir: Path, out_dir: Path, warn: Callable[[str], None]
              ) -> tuple[Path, ExportedWeights]:
    """``out_dir/config.json`` (the model's own config, kept by the run) and
    ``out_dir/model.safetensors`` (the newest weights under the model's own parameter
    names, tied weights stored once): what ``AutoModelForCausalLM.from_pretrained(
    out_dir)`` loads. Returns (out_dir, where they came from)."""
    config = Path(run_dir) / MODEL_CONFIG_FILE
    if Path(run_dir).is_dir() and not config.is_file():
        raise UserError(f"{run_dir} has no {MODEL_CONFIG_FILE}: --format hf exports runs "
                        "of transformers models (use the default format for others)")
    weights = newest_weights(run_dir, warn)
    out_dir = Path(out_dir)
    write_streamed(out_dir / WEIGHTS_FILE, weights.entries, weights.fetch, {"format": "pt"})
    (out_dir / "config.json").write_text(config.read_text(encoding="utf-8"),
                                         encoding="utf-8")
    return out_dir, weights
