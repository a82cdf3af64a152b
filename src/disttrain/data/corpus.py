"""Text files -> token shards, prepared once and cached.

By default tokens are the raw bytes of each text file (values 0..255), stored as
``uint16`` in flat shard files (``train_00000.bin``, ``val_00000.bin``, ... written with
``ndarray.tofile``), and every document is followed by one ``0`` token: NUL never occurs
in a text file, so it marks document boundaries unambiguously. ``data.tokenizer`` may
name a Hugging Face ``tokenizer.json`` or ``bpe:N`` instead (:mod:`.tokenize`): the ids,
their separator and the shard dtype then follow that tokenizer, and ``meta.json``
records its vocabulary. A shard holds at most ``SHARD_TOKENS`` tokens and
a document never spans two shards unless it alone is longer than a shard.

The held-out split is by file and depends only on each file's relative path, so adding a
file never moves another one between train and val.

The cache directory ``corpus-{key}`` is keyed by the resolved root, the pattern, the
split fraction and every matched file's (relative path, size, mtime_ns): a changed
directory is prepared again. Preparation is safe when many ranks call it at once: one
takes an exclusive ``flock``, builds into a temporary sibling and renames it into place;
the others wait for the lock and then just read ``meta.json``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from disttrain.config.schema import DataConfig
from disttrain.data.files import default_cache_dir, exclusive_lock, in_val, matching_files
from disttrain.data.prepared import TOKEN_RANGE, PreparedCorpus
from disttrain.data.pretokenized import tokens_corpus
from disttrain.data.tokenize import BYTES, Encoder, build_encoder, tokenizer_key
from disttrain.errors import DataError
from disttrain.fsutil import fsync_dir, write_durably

FORMAT_VERSION = 2  # 2: meta.json records the tokenizer and the text bytes
SHARD_TOKENS = 8 * 1024 * 1024
STDLIB_PATTERN = "**/*.py"
TEXT_PROBE_BYTES = 8192
DOC_SEPARATOR = 0  # the byte tokenizer's (tokenize.Encoder.separator)
META_NAME = "meta.json"


@dataclass(frozen=True)
class _Doc:
    """One document: the bytes ``[start:stop]`` of a file (``None`` = to the end)."""

    path: Path
    start: int | None = None
    stop: int | None = None

    def read(self) -> bytes:
        return self.path.read_bytes()[self.start:self.stop]


def stdlib_source_dir() -> Path:
    """The running interpreter's standard-library directory (the built-in corpus)."""
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path, pattern: str) -> list[Path]:
    """Text files under ``root`` matching the glob ``pattern``, sorted by relative path.

    Skips directories, anything under ``site-packages`` / ``dist-packages`` /
    ``__pycache__``, empty files and files with a NUL byte in their first 8 KiB.
    """
    return [path for _, path in matching_files(Path(root), pattern) if _is_text(path)]


def prepare_corpus(root: Path | None, pattern: str, cache_dir: Path, val_fraction: float,
                   *, shard_tokens: int = SHARD_TOKENS,
                   tokenizer: str = BYTES) -> PreparedCorpus:
    """Tokenise the text files under ``root`` into cached shards (once) and describe them.

    ``root=None`` means the standard library's own ``**/*.py`` files (``pattern`` is
    ignored then). A file goes to val when the first 32 bits of the sha256 of its relative
    posix path, read as a fraction of 2**32, fall below ``val_fraction``; both splits are
    made non-empty. Returns at once (reading ``meta.json`` only) when already prepared.
    """
    root, pattern = _source(root, pattern)
    cache_dir = Path(cache_dir)
    entries = _stat_entries(root, pattern)
    key = _cache_key(root, pattern, val_fraction, shard_tokens, entries,
                     tokenizer_key(tokenizer))
    final = cache_dir / f"corpus-{key}"
    if not (final / META_NAME).exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        with exclusive_lock(cache_dir / f"corpus-{key}.lock"):
            if not (final / META_NAME).exists():
                _build(root, pattern, val_fraction, shard_tokens, final, tokenizer)
    return _load(final)


def corpus_from_config(data: DataConfig) -> PreparedCorpus:
    """``prepare_corpus`` for a ``[data]`` config section (empty strings = the defaults),
    or the pre-tokenized shards of ``data.format = "tokens"``."""
    if data.format == "tokens":
        return tokens_corpus(data)
    root = Path(data.path).expanduser() if data.path else None
    cache_dir = Path(data.cache_dir).expanduser() if data.cache_dir else default_cache_dir()
    return prepare_corpus(root, data.pattern, cache_dir, data.val_fraction,
                          tokenizer=data.tokenizer)


# ---- discovery -------------------------------------------------------------------------

def _source(root: Path | None, pattern: str) -> tuple[Path, str]:
    if root is None:
        return stdlib_source_dir().resolve(), STDLIB_PATTERN
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"data.path={str(root)!r}: no such directory (point data.path at a "
                        "directory of text files, or leave it empty for the built-in corpus)")
    return root.resolve(), pattern


def _is_text(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            head = f.read(TEXT_PROBE_BYTES)
    except OSError:
        return False
    return bool(head) and b"\0" not in head


def _stat_entries(root: Path, pattern: str) -> list[tuple[str, int, int]]:
    """(relative path, size, mtime_ns) of the candidate files: the cache key's input."""
    entries = []
    for rel, path in matching_files(root, pattern):
        st = path.stat()
        entries.append((rel, st.st_size, st.st_mtime_ns))
    if not entries:
        raise _no_text_files(root, pattern)
    return entries


def _no_text_files(root: Path, pattern: str) -> DataError:
    return DataError(f"data.path={str(root)!r} data.pattern={pattern!r}: no text files "
                     "matched (check data.pattern, e.g. '**/*.txt', or point data.path at "
                     "a directory of text files)")


def _cache_key(root: Path, pattern: str, val_fraction: float, shard_tokens: int,
               entries: list[tuple[str, int, int]], tokenizer: str = BYTES) -> str:
    # the byte tokenizer keeps the keys it always had
    extra = [] if tokenizer == BYTES else [tokenizer]
    blob = json.dumps([FORMAT_VERSION, str(root), pattern, val_fraction, shard_tokens,
                       entries, *extra])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


# ---- split -----------------------------------------------------------------------------

def _split(root: Path, files: list[Path], val_fraction: float) -> tuple[list[_Doc], list[_Doc]]:
    """(train, val) documents, both non-empty.

    A single file cannot be split by file: its last ``val_fraction`` of bytes (at least
    one) is held out instead.
    """
    if len(files) == 1:
        return _split_one_file(files[0], val_fraction)
    val = [f for f in files if in_val(f.relative_to(root).as_posix(), val_fraction)]
    if not val:
        val = [files[-1]]
    if len(val) == len(files):
        val = val[1:]
    held_out = set(val)
    train = [f for f in files if f not in held_out]
    return [_Doc(f) for f in train], [_Doc(f) for f in val]


def _split_one_file(path: Path, val_fraction: float) -> tuple[list[_Doc], list[_Doc]]:
    size = path.stat().st_size
    if size < 2:
        raise DataError(f"data.path={str(path.parent)!r}: the only text file {path.name!r} "
                        f"has {size} byte(s), too few to hold any out for evaluation "
                        "(add more text)")
    cut = size - min(size - 1, max(1, round(size * val_fraction)))
    return [_Doc(path, None, cut)], [_Doc(path, cut, None)]


# ---- writing ---------------------------------------------------------------------------

def _build(root: Path, pattern: str, val_fraction: float, shard_tokens: int,
           final: Path, tokenizer: str = BYTES) -> None:
    """Write shards and meta.json into a temporary sibling, then rename it to ``final``."""
    files = corpus_files(root, pattern)
    if not files:
        raise _no_text_files(root, pattern)
    train, val = _split(root, files, val_fraction)
    encoder = build_encoder(tokenizer, (doc.read() for doc in train))
    for stale in final.parent.glob(f"{final.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)  # left by a crashed preparer; we hold the lock
    tmp = final.parent / f"{final.name}.tmp-{os.getpid()}"
    tmp.mkdir()
    try:
        train_shards, train_tokens, train_bytes = _write_split(tmp, "train", train,
                                                               shard_tokens, encoder)
        val_shards, val_tokens, val_bytes = _write_split(tmp, "val", val, shard_tokens,
                                                         encoder)
        encoder.save(tmp)
        meta = {"version": FORMAT_VERSION, "root": str(root), "pattern": pattern,
                "val_fraction": val_fraction, "num_files": len(files),
                "train_files": len(train), "val_files": len(val),
                "train_tokens": train_tokens, "val_tokens": val_tokens,
                "train_bytes": train_bytes, "val_bytes": val_bytes,
                "train_shards": train_shards, "val_shards": val_shards,
                "tokenizer": encoder.key, "vocab_size": encoder.vocab_size,
                "separator": encoder.separator, "token_dtype": encoder.dtype}
        write_durably(tmp / META_NAME, json.dumps(meta, indent=2).encode())
        fsync_dir(tmp)
        os.replace(tmp, final)
        fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_split(directory: Path, split: str, docs: list[_Doc], shard_tokens: int,
                 encoder: Encoder | None = None) -> tuple[list[str], int, int]:
    """Pack documents (each followed by the separator) into shards; (shard names,
    tokens, bytes of text)."""
    encoder = encoder or Encoder()
    names: list[str] = []
    pending: list[np.ndarray] = []
    pending_len = total = nbytes = 0
    for doc in docs:
        text = doc.read()
        nbytes += len(text)
        data = np.append(encoder.encode(text).astype(np.int64), encoder.separator)
        total += len(data)
        if pending and pending_len + len(data) > shard_tokens:
            names.append(_write_shard(directory, split, len(names), pending, encoder.dtype))
            pending, pending_len = [], 0
        while len(data) > shard_tokens:  # only a document bigger than a whole shard
            names.append(_write_shard(directory, split, len(names), [data[:shard_tokens]],
                                      encoder.dtype))
            data = data[shard_tokens:]
        pending.append(data)
        pending_len += len(data)
    if pending:
        names.append(_write_shard(directory, split, len(names), pending, encoder.dtype))
    return names, total, nbytes


def _write_shard(directory: Path, split: str, index: int, chunks: list[np.ndarray],
                 dtype: str = "uint16") -> str:
    """One shard file: the chunks' ids as ``dtype``, raw ``tofile`` layout."""
    name = f"{split}_{index:05d}.bin"
    tokens = np.concatenate(chunks).astype(dtype)
    with open(directory / name, "wb") as f:
        tokens.tofile(f)
        f.flush()
        os.fsync(f.fileno())
    return name


def _load(directory: Path) -> PreparedCorpus:
    meta = json.loads((directory / META_NAME).read_text())
    return PreparedCorpus(directory=directory,
                          train_shards=[directory / n for n in meta["train_shards"]],
                          val_shards=[directory / n for n in meta["val_shards"]],
                          train_tokens=meta["train_tokens"], val_tokens=meta["val_tokens"],
                          num_files=meta["num_files"],
                          token_dtype=meta.get("token_dtype", "uint16"),
                          vocab_needed=meta.get("vocab_size", TOKEN_RANGE),
                          val_bytes=meta.get("val_bytes"))
