"""Pre-tokenized corpora (``data.format = "tokens"``): a directory of flat token shards
prepared by another tool (Megatron's and nanoGPT's ``.bin`` files, ``.npy`` arrays),
trained on in place.

Shards are the files under ``data.path`` matching ``data.pattern`` with the suffix
``.bin`` (flat ``data.token_dtype`` values, ``uint16`` or ``uint32``) or ``.npy`` (a 1-D
integer array; its own dtype). Nothing is copied or loaded whole: each shard is
memory-mapped when a sample first reads it, so a corpus larger than memory trains.
Documents are whatever the producing tool wrote between its own boundary tokens; windows
of ``seq_len + 1`` tokens are cut inside each shard as for the byte corpus.

Held-out data: the shards whose file name starts with ``val`` (``val.bin``,
``val_00003.npy``, ``validation.bin``) when there are any; otherwise the shards whose
relative path hashes below ``data.val_fraction``, as for text files (two shards at
least). The largest token id, which ``model.vocab_size`` must exceed, is read once per
corpus (a pass over every shard, in chunks) and cached beside the text caches, keyed
by each shard's path, size and modification time.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from disttrain.config.schema import DataConfig
from disttrain.data.dataset import open_shard, tokens_per_shard
from disttrain.data.files import default_cache_dir, in_val, matching_files
from disttrain.data.prepared import PreparedCorpus
from disttrain.errors import DataError

SUFFIXES = (".bin", ".npy")
_CHUNK = 1 << 24  # tokens per step of the max-id scan


def tokens_corpus(data: DataConfig) -> PreparedCorpus:
    """The pre-tokenized corpus ``data`` describes, split into train / val."""
    if not data.path:
        raise DataError("data.format='tokens' needs data.path: a directory of token "
                        "shards (.bin or .npy)")
    root = Path(data.path).expanduser()
    if not root.is_dir():
        raise DataError(f"data.path={str(root)!r}: no such directory (point it at a "
                        "directory of token shards)")
    root = root.resolve()
    found = [(rel, path) for rel, path in matching_files(root, data.pattern)
             if path.suffix in SUFFIXES]
    if not found:
        raise DataError(f"data.path={str(root)!r} data.pattern={data.pattern!r}: no token "
                        "shards matched (.bin or .npy files)")
    for _, path in found:
        _check_shard(path, data.token_dtype)
    train, val = _split(root, found, data.val_fraction)
    cache = Path(data.cache_dir).expanduser() if data.cache_dir else default_cache_dir()
    return PreparedCorpus(
        directory=root, train_shards=train, val_shards=val,
        train_tokens=sum(tokens_per_shard(train, data.token_dtype)),
        val_tokens=sum(tokens_per_shard(val, data.token_dtype)), num_files=len(found),
        token_dtype=data.token_dtype,
        vocab_needed=_largest_id([p for _, p in found], data.token_dtype, cache) + 1)


def _check_shard(path: Path, dtype: str) -> None:
    """A shard holds a flat run of integers: a ``.bin`` a whole number of ``dtype``
    values, a ``.npy`` a 1-D integer array."""
    if path.suffix == ".npy":
        try:
            array = np.load(path, mmap_mode="r")
        except (OSError, ValueError) as exc:
            raise DataError(f"{path}: not a readable .npy file ({exc})") from None
        if array.ndim != 1 or array.dtype.kind not in "iu":
            raise DataError(f"{path}: a token shard must be a 1-D integer array, this is "
                            f"{array.dtype} of shape {array.shape}")
        return
    size, itemsize = path.stat().st_size, np.dtype(dtype).itemsize
    if size % itemsize:
        raise DataError(f"{path}: {size} bytes is not a whole number of {dtype} tokens "
                        "(set data.token_dtype to the dtype the shards were written in)")


def _split(root: Path, found: list[tuple[str, Path]],
           val_fraction: float) -> tuple[list[Path], list[Path]]:
    named = [p for _, p in found if p.name.lower().startswith("val")]
    if named:
        train = [p for _, p in found if p not in set(named)]
        if not train:
            raise DataError(f"data.path={str(root)!r}: every shard is named val*; name the "
                            "training shards otherwise (e.g. train.bin)")
        return train, named
    if len(found) < 2:
        raise DataError(f"data.path={str(root)!r}: one shard and none named val*: name the "
                        "held-out shard val.bin (or val*.npy), or give several shards")
    val = [p for rel, p in found if in_val(rel, val_fraction)] or [found[-1][1]]
    if len(val) == len(found):
        val = val[1:]
    return [p for _, p in found if p not in set(val)], val


def _largest_id(paths: list[Path], dtype: str, cache: Path) -> int:
    """The largest token id over ``paths`` (cached by their path, size and mtime)."""
    stats = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in paths]
    key = hashlib.sha256(json.dumps([dtype, stats]).encode()).hexdigest()[:16]
    where = cache / f"tokens-{key}.json"
    try:
        return int(json.loads(where.read_text())["max_id"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    largest = -1
    for path in paths:
        tokens = open_shard(path, dtype)
        for start in range(0, len(tokens), _CHUNK):
            chunk = tokens[start:start + _CHUNK]
            if len(chunk):
                if chunk.dtype.kind == "i" and int(chunk.min()) < 0:
                    raise DataError(f"{path}: holds a negative token id ({int(chunk.min())})")
                largest = max(largest, int(chunk.max()))
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tmp = where.with_name(f"{where.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"max_id": largest, "shards": stats}))
        os.replace(tmp, where)
    except OSError:
        pass  # a read-only cache: scanned again next time
    return largest
