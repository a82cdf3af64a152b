"""A safetensors file written one tensor at a time, in bounded memory.

``safetensors.torch.save_file`` takes every tensor at once. :func:`write_streamed`
writes the header from the names, shapes and dtypes alone, then each tensor's bytes as
``fetch`` produces it, so the writer holds at most one whole tensor (the final weights
and ``disttrain export`` of a model no rank holds whole). The file appears atomically
(written beside, then renamed), with the permissions of any new file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..fsutil import new_file_mode
from .format import SAFETENSORS_DTYPES

Entry = tuple[str, tuple[int, ...], torch.dtype]


def write_streamed(path: Path, entries: Sequence[Entry],
                   fetch: Callable[[str], torch.Tensor],
                   metadata: dict[str, str] | None = None) -> Path:
    """Write ``entries`` (name, shape, dtype) to ``path``, each tensor's data from
    ``fetch(name)`` (which must match its entry), in the order given."""
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, shape, dtype in entries:
        numel = 1
        for n in shape:
            numel *= n
        size = numel * dtype.itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    try:
        with open(tmp, "wb") as f:
            f.write(len(raw).to_bytes(8, "little"))
            f.write(raw)
            for name, shape, dtype in entries:
                t = fetch(name)
                if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                    raise ValueError(f"{name}: got {tuple(t.shape)} {t.dtype}, expected "
                                     f"{tuple(shape)} {dtype}")
                data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
                # numpy's stubs declare ndarray.__buffer__ for Python >= 3.12 only
                f.write(memoryview(data.numpy()))  # type: ignore[arg-type]
        os.chmod(tmp, new_file_mode())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
