"""One consolidated, unsharded safetensors file of a run's model weights."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from safetensors.torch import save_file

from ..errors import UserError
from .manager import find_checkpoint, open_checkpoint
from .state import MODEL


def export_weights(run_dir: Path, out: Path, warn: Callable[[str], None]) -> tuple[Path, int]:
    """Assemble every ``model/...`` tensor of the newest intact checkpoint of ``run_dir``
    into ``out`` under its plain parameter name (load it with
    ``safetensors.torch.load_model(model, out)``). Returns (out, step)."""
    if not Path(run_dir).is_dir():
        raise UserError(f"run directory {str(run_dir)!r} does not exist")
    directory = find_checkpoint(Path(run_dir), warn)
    if directory is None:
        raise UserError(f"{run_dir} holds no checkpoint (train with checkpoint.every > 0)")
    ckpt = open_checkpoint(directory)
    tensors = {name[len(MODEL):]: ckpt.reader.tensor(name).contiguous()
               for name in ckpt.reader.names(MODEL)}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".part")
    save_file(tensors, str(tmp), metadata={"format": "disttrain-export",
                                           "step": str(ckpt.step)})
    tmp.replace(out)
    return out, ckpt.step
