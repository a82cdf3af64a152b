"""Pretrained weights from a Hugging Face model directory, read as untrusted input.

A directory holds ``config.json`` and either ``model.safetensors`` or several
safetensors files listed by ``model.safetensors.index.json``. :func:`read_directory`
checks everything it will read before anything is allocated: index paths stay inside
the directory, headers are bounded JSON, dtypes are fp32 / bf16 / fp16, every tensor's
bytes lie inside its file (a truncated file is refused), no tensor is named twice.
:func:`check_against` then compares names and shapes with the model.

:class:`PretrainedWeights` is a source of global tensors by ``model/<name>`` (the
names the model's own ``state_dict`` uses, a tied weight under its first name), read
through a mapping of the file: the caller copies only the boxes this rank holds
(:meth:`PretrainedWeights.want` says which) straight into its fp32 parameters, so a
rank reads its own slices and nothing else, each byte copied once, whatever the file's
dtype (fp32 / bf16 / fp16).
"""

from __future__ import annotations

import json
import mmap
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..adapters import AdapterFactor
from ..checkpoint.state import MODEL
from ..errors import UserError
from ..param_names import canonical_name

SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"
DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
MAX_HEADER_BYTES = 100 << 20  # a header lists names, dtypes, shapes: never this large
MAX_INDEX_BYTES = 64 << 20


@dataclass(frozen=True)
class FileTensor:
    """Where one tensor lies: its file, dtype (safetensors' name), shape, and the byte
    offset of its data in the file."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int


def _refuse(directory: Path, problem: str) -> UserError:
    return UserError(f"model.pretrained {directory}: {problem}")


def read_directory(directory: str | Path) -> dict[str, FileTensor]:
    """Every tensor of the directory's safetensors files, by name, checked (see the
    module docstring); raises :class:`UserError` in one line naming the problem."""
    root = Path(directory).expanduser()
    if not root.is_dir():
        raise _refuse(root, "no such directory (give a transformers model directory: "
                            "config.json and model.safetensors)")
    files: Mapping[str, list[str] | None]  # file -> the tensors the index puts in it
    if (root / INDEX_FILE).is_file():
        files = _index_files(root)
    elif (root / SINGLE_FILE).is_file():
        files = {SINGLE_FILE: None}
    else:
        raise _refuse(root, f"has neither {SINGLE_FILE} nor {INDEX_FILE} (only safetensors "
                            "weights are read: save them with save_pretrained)")
    out: dict[str, FileTensor] = {}
    for name, listed in files.items():
        path = _inside(root, name)
        found = _header(root, path)
        for tensor, where in found.items():
            if tensor in out:
                raise _refuse(root, f"tensor {tensor} is in both {out[tensor].file.name} "
                                    f"and {path.name}")
            out[tensor] = where
        for tensor in listed or ():
            if tensor not in found:
                raise _refuse(root, f"{INDEX_FILE} puts tensor {tensor} in {name}, which "
                                    "does not hold it")
    return out


def _index_files(root: Path) -> dict[str, list[str]]:
    index = root / INDEX_FILE
    if index.stat().st_size > MAX_INDEX_BYTES:
        raise _refuse(root, f"{INDEX_FILE} is larger than {MAX_INDEX_BYTES >> 20} MiB")
    try:
        data = json.loads(index.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise _refuse(root, f"{INDEX_FILE} is not JSON ({e})") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise _refuse(root, f"{INDEX_FILE} has no weight_map of tensor name -> file name")
    files: dict[str, list[str]] = {}
    for tensor, name in weight_map.items():
        files.setdefault(name, []).append(tensor)
    return files


def _inside(root: Path, name: str) -> Path:
    path = (root / name).resolve()
    if not path.is_relative_to(root.resolve()) or path.parent != root.resolve():
        raise _refuse(root, f"the weights file {name!r} lies outside the directory")
    if not path.is_file():
        raise _refuse(root, f"the weights file {name} is missing")
    return path


def _header(root: Path, path: Path) -> dict[str, FileTensor]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise _refuse(root, f"{path.name} is truncated (no safetensors header)")
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER_BYTES or 8 + length > size:
            raise _refuse(root, f"{path.name} has a header of {length} bytes in a file of "
                                f"{size} (not a safetensors file, or truncated)")
        raw = f.read(length)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise _refuse(root, f"{path.name}'s header is not JSON (not a safetensors "
                            "file)") from None
    if not isinstance(header, dict):
        raise _refuse(root, f"{path.name}'s header is not a JSON object")
    data_bytes = size - 8 - length
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        out[name] = _entry(root, path, name, entry, data_bytes, 8 + length)
    return out


def _entry(root: Path, path: Path, name: str, entry: object, data_bytes: int,
           data_start: int) -> FileTensor:
    where = f"tensor {name} in {path.name}"
    if not isinstance(entry, dict):
        raise _refuse(root, f"{where}: its header entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPES:
        raise _refuse(root, f"{where} has dtype {dtype!r} (fp32, bf16 and fp16 are read: "
                            "F32, BF16, F16)")
    if not isinstance(shape, list) or not all(
            isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 2 ** 40
            for n in shape) or len(shape) > 8:
        raise _refuse(root, f"{where} has shape {shape!r} (not a list of sizes)")
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * DTYPES[dtype].itemsize
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] or offsets[1] - offsets[0] != nbytes):
        raise _refuse(root, f"{where} has data offsets {offsets!r} that do not fit its "
                            f"shape {shape} and dtype {dtype}")
    if offsets[1] > data_bytes:
        raise _refuse(root, f"{where} ends at byte {offsets[1]} of a data section of "
                            f"{data_bytes} (the file is truncated)")
    if (data_start + offsets[0]) % DTYPES[dtype].itemsize:
        raise _refuse(root, f"{where} starts at a byte offset that is not a multiple of "
                            "its element size")
    return FileTensor(path, dtype, tuple(shape), data_start + offsets[0])


def model_tensor_shapes(model: nn.Module) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """The tensors a pretrained file of ``model`` holds, by name: parameters (a tied
    weight once, under its first name; a LoRA adapter's base under its plain name, the
    adapter itself never) and persistent buffers; and each tied weight's other names ->
    its first name."""
    shapes: dict[str, tuple[int, ...]] = {}
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    adapters = {id(p) for m in model.modules() if isinstance(m, AdapterFactor)
                for p in m.parameters()}
    for raw, p in model.named_parameters(remove_duplicate=False):
        name = canonical_name(raw)
        if id(p) in adapters:
            continue
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
            shapes[name] = tuple(p.shape)
    persistent = set(model.state_dict().keys())
    for name, b in model.named_buffers():
        if name in persistent:
            shapes[canonical_name(name)] = tuple(b.shape)
    return shapes, aliases


def check_against(directory: str | Path, tensors: dict[str, FileTensor],
                  model: nn.Module) -> None:
    """Refuse a directory whose tensors are not exactly the model's: one missing, one
    the model does not have (a tied weight's second name is allowed), a shape that
    differs."""
    root = Path(directory).expanduser()
    shapes, aliases = model_tensor_shapes(model)
    missing = [n for n in shapes if n not in tensors]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise _refuse(root, f"has no tensor {missing[0]}{more}, which the model "
                            f"{type(model).__name__} has (weights of another model?)")
    for name, where in tensors.items():
        expected = shapes.get(name) or shapes.get(aliases.get(name, ""))
        if expected is None:
            raise _refuse(root, f"tensor {name} in {where.file.name} is not in the model "
                                f"{type(model).__name__} (weights of another model?)")
        if where.shape != expected:
            raise _refuse(root, f"tensor {name} in {where.file.name} has shape "
                                f"{list(where.shape)}, the model's is {list(expected)}")


class PretrainedWeights:
    """Global tensors by ``model/<name>`` from a checked directory (see the module
    docstring), with ``rest`` (e.g. the seeded initialiser) for tensors the files do
    not hold (non-persistent buffers such as rotary frequencies).

    :meth:`tensor` returns a view of the file itself (a private, copy-on-write mapping,
    in the file's dtype): nothing is read until the caller copies from it, and the
    caller copies only the boxes this rank holds, straight into its fp32 parameters
    (one copy per byte). ``bytes_read``: the bytes of the boxes handed out
    (:meth:`want`), or of whole tensors where no boxes were given. The mapping is
    released with the last view of it."""

    def __init__(self, tensors: dict[str, FileTensor], rest=None) -> None:
        self.tensors, self.rest = tensors, rest
        self.wanted: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
        self.bytes_read = 0

    def want(self, boxes: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]]) -> None:
        """The (global offsets, sizes) boxes of each named tensor the caller will read."""
        self.wanted = dict(boxes)

    def names(self, prefix: str = "") -> list[str]:
        """The checkpoint names of the directory's tensors (then the fallback's)
        starting with ``prefix``."""
        mine = [MODEL + n for n in self.tensors if (MODEL + n).startswith(prefix)]
        rest = [] if self.rest is None else [n for n in self.rest.names(prefix)
                                             if n[len(MODEL):] not in self.tensors]
        return mine + rest

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor ``name``, from the file header (nothing read)."""
        key = name[len(MODEL):]
        if key in self.tensors:
            return self.tensors[key].shape
        return self.rest.shape(name)

    def tensor(self, name: str) -> torch.Tensor:
        """The whole tensor, as a view of its file (see the class docstring)."""
        key = name[len(MODEL):]
        if key not in self.tensors:
            return self.rest.tensor(name)
        where = self.tensors[key]
        dtype = DTYPES[where.dtype]
        numel = 1
        for n in where.shape:
            numel *= n
        boxes = self.wanted.get(name)
        counted = numel if not boxes else min(numel, sum(_numel(s) for _, s in boxes))
        self.bytes_read += counted * dtype.itemsize
        if numel == 0:
            return torch.empty(where.shape, dtype=dtype)
        with open(where.file, "rb") as f:
            mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        return torch.frombuffer(mapping, dtype=dtype, count=numel,
                                offset=where.start).view(where.shape)


def _numel(sizes: tuple[int, ...]) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def open_pretrained(directory: str | Path, model: nn.Module, rest=None) -> PretrainedWeights:
    """The checked weights of ``directory`` for ``model`` (on meta or not)."""
    tensors = read_directory(directory)
    check_against(directory, tensors, model)
    return PretrainedWeights(tensors, rest)
