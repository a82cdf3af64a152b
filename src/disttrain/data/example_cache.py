"""Instruction and chat examples tokenized once and cached (``data.format = "jsonl"``).

Every example under ``data.path`` (:mod:`.records`) goes through
:class:`~.chat.ExampleEncoder`; a bad one stops preparation in one line (exit 2) or,
under ``data.on_bad_example = skip``, is left out and counted. Examples are split into
train and held-out by a hash of each one alone, so adding examples moves no other. The
cache is built as the text corpus's is: under an exclusive lock, into a temporary
sibling renamed into place. The user's view: ``docs/guides/finetune.md``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from disttrain.config.consistency import TOKENIZER_BYTES
from disttrain.config.schema import DataConfig, ModelConfig
from disttrain.data.chat import BadExample, ExampleEncoder, NoChatTemplate, load_tokenizer
from disttrain.data.examples import OFFSETS, TOKENS, TRAINED, PreparedExamples
from disttrain.data.files import default_cache_dir, exclusive_lock, in_val
from disttrain.data.records import Problem, Record, read_records, source_files
from disttrain.errors import DataError
from disttrain.fsutil import fsync_dir, write_durably
from disttrain.names import BAD_EXAMPLE_SKIP

FORMAT_VERSION = 1
META_NAME = "meta.json"
REPORTED = 3  # skipped examples the report names
# files of a model directory that are weights, not tokenizer (left out of the key)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack",
                    ".gguf", ".onnx")


@dataclass(frozen=True, kw_only=True)
class ExampleOptions:
    """The settings an example's tokens depend on (all in the cache key)."""

    seq_len: int
    truncate: bool = False
    skip: bool = False
    val_fraction: float = 0.05


def examples_from_config(data: DataConfig, model: ModelConfig) -> PreparedExamples:
    """:func:`prepare_examples` for the ``[data]`` and ``[model]`` sections."""
    field, tokenizer = (("model.pretrained", model.pretrained)
                        if data.tokenizer == TOKENIZER_BYTES
                        else ("data.tokenizer", data.tokenizer))
    cache = Path(data.cache_dir).expanduser() if data.cache_dir else default_cache_dir()
    options = ExampleOptions(seq_len=model.seq_len, truncate=data.truncate,
                             skip=data.on_bad_example == BAD_EXAMPLE_SKIP,
                             val_fraction=data.val_fraction)
    return prepare_examples(Path(data.path).expanduser(), data.pattern,
                            Path(tokenizer).expanduser(), options, cache,
                            tokenizer_field=field)


def prepare_examples(source: Path, pattern: str, tokenizer_dir: Path,
                     options: ExampleOptions, cache_dir: Path, *,
                     tokenizer_field: str = "data.tokenizer") -> PreparedExamples:
    """Tokenize the examples under ``source`` into the cache (once) and describe them;
    returns at once (reading ``meta.json`` only) when already prepared.

    The cache directory ``examples-{key}`` is keyed by the source path and pattern,
    each source file's (relative path, size, mtime_ns), the content of the tokenizer's
    files, the transformers version (it renders the templates), ``model.seq_len``,
    ``data.truncate``, ``data.on_bad_example`` and ``data.val_fraction``. An example is
    held out when the sha256 of its JSON (keys sorted), read as a fraction, falls below
    ``data.val_fraction``; both splits are made non-empty (the last example read, or
    the first, moves)."""
    if not source.exists():
        raise DataError(f"data.path={str(source)!r}: no such file or directory (point it "
                        "at a .jsonl file, a directory of them or a saved dataset)")
    source = source.resolve()
    entries = [(rel, p.stat().st_size, p.stat().st_mtime_ns)
               for rel, p in source_files(source, pattern)]
    blob = json.dumps([FORMAT_VERSION, str(source), pattern, entries,
                       _tokenizer_key(tokenizer_dir), _transformers_version(),
                       asdict(options)])
    key = hashlib.sha256(blob.encode()).hexdigest()[:16]
    final = Path(cache_dir) / f"examples-{key}"
    if not (final / META_NAME).exists():
        final.parent.mkdir(parents=True, exist_ok=True)
        with exclusive_lock(final.parent / f"{final.name}.lock"):
            if not (final / META_NAME).exists():
                encoder = ExampleEncoder(load_tokenizer(tokenizer_dir, tokenizer_field),
                                         tokenizer_dir)
                _build(read_records(source, pattern), encoder, options, final, source)
    return _load(final)


def _tokenizer_key(directory: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(directory.iterdir()) if directory.is_dir() else ():
        if path.is_file() and path.suffix not in _WEIGHT_SUFFIXES:
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def encode_example(encoder: ExampleEncoder, record: Record, options: ExampleOptions
                   ) -> tuple[list[int], list[bool]]:
    """The ids and trained flags of one record, within ``options.seq_len`` tokens
    (cut, or refused as :class:`BadExample`)."""
    if isinstance(record.value, Problem):
        raise BadExample(record.value.problem, record.value.fix)
    ids, trained = encoder.encode(record.value)
    cut = len(ids) > options.seq_len
    if cut and not options.truncate:
        raise BadExample(f"is {len(ids)} tokens long, more than model.seq_len="
                         f"{options.seq_len}", "raise model.seq_len, shorten the example, "
                         "or set data.truncate=true to cut it")
    ids, trained = ids[:options.seq_len], trained[:options.seq_len]
    if not any(trained):
        within = f" within its first model.seq_len={options.seq_len} tokens" if cut else ""
        raise BadExample(f"has no token to train on{within}", "give it a non-empty "
                         "completion or assistant message" + (", or raise model.seq_len"
                                                              if cut else ""))
    return ids, trained


class _Writer:
    """Appends examples to ``tokens.bin`` / ``trained.bin`` and keeps what the split
    and ``meta.json`` need."""

    def __init__(self, directory: Path, dtype: str) -> None:
        self.dtype = dtype
        self.tokens: BinaryIO = open(directory / TOKENS, "wb")
        self.trained: BinaryIO = open(directory / TRAINED, "wb")
        self.offsets: list[int] = [0]
        self.counts: list[int] = []  # trained tokens of each example
        self.held_out: list[bool] = []
        self.max_id = 0

    def add(self, ids: list[int], trained: list[bool], identity: str,
            val_fraction: float) -> None:
        np.asarray(ids, dtype=self.dtype).tofile(self.tokens)
        np.asarray(trained, dtype=np.uint8).tofile(self.trained)
        self.offsets.append(self.offsets[-1] + len(ids))
        self.counts.append(sum(trained))
        self.held_out.append(in_val(identity, val_fraction))
        self.max_id = max(self.max_id, max(ids))

    def close(self) -> None:
        for f in (self.tokens, self.trained):
            f.flush()
            os.fsync(f.fileno())
            f.close()


def _build(records: Iterable[Record], encoder: ExampleEncoder, options: ExampleOptions,
           final: Path, source: Path) -> None:
    vocab = len(encoder.tokenizer)
    dtype = "uint16" if vocab <= 1 << 16 else "uint32"
    for stale in final.parent.glob(f"{final.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)  # left by a crashed preparer; we hold the lock
    tmp = final.parent / f"{final.name}.tmp-{os.getpid()}"
    tmp.mkdir()
    try:
        writer, read, skipped = _Writer(tmp, dtype), 0, []
        try:
            for record in records:
                read += 1
                try:
                    ids, trained = encode_example(encoder, record, options)
                except BadExample as exc:
                    if isinstance(exc, NoChatTemplate) or not options.skip:
                        raise DataError(exc.detail.at(record.where)) from None
                    skipped.append(exc.detail.at(record.where))
                    continue
                writer.add(ids, trained, _identity(record.value), options.val_fraction)
        finally:
            writer.close()
        _finish(tmp, writer, encoder, (read, skipped, source), dtype)
        os.replace(tmp, final)
        fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _finish(tmp: Path, writer: _Writer, encoder: ExampleEncoder,
            seen: tuple[int, list[str], Path], dtype: str) -> None:
    """The split, ``offsets.npy`` and ``meta.json``; ``seen``: (examples read, the
    skipped ones' reports, the source)."""
    read, skipped, source = seen
    n = len(writer.counts)
    if n < 2:
        raise DataError(f"data.path={str(source)!r}: {n} usable example(s) of {read} read "
                        f"({len(skipped)} skipped); at least 2 are needed, one to hold "
                        "out (add examples)")
    held = np.asarray(writer.held_out, dtype=bool)
    if not held.any():
        held[-1] = True
    if held.all():
        held[0] = False
    counts = np.asarray(writer.counts, dtype=np.int64)
    np.save(tmp / OFFSETS, np.asarray(writer.offsets, dtype=np.int64))
    tok = encoder.tokenizer
    pad_id = next((i for i in (tok.pad_token_id, tok.eos_token_id) if i is not None), 0)
    examples, trained = {}, {}
    for split, mask in (("train", ~held), ("val", held)):
        np.save(tmp / f"{split}.npy", np.flatnonzero(mask).astype(np.int64))
        examples[split], trained[split] = int(mask.sum()), int(counts[mask].sum())
    meta = {"version": FORMAT_VERSION, "examples": examples, "trained_tokens": trained,
            "vocab_needed": max(writer.max_id, pad_id) + 1, "pad_id": pad_id,
            "token_dtype": dtype, "read": read, "skipped": len(skipped),
            "skipped_first": skipped[:REPORTED], "tokenizer": str(encoder.where)}
    write_durably(tmp / META_NAME, json.dumps(meta, indent=2).encode())
    fsync_dir(tmp)


def _identity(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)


def _load(directory: Path) -> PreparedExamples:
    meta = json.loads((directory / META_NAME).read_text())
    return PreparedExamples(directory=directory, examples=meta["examples"],
                            trained_tokens=meta["trained_tokens"],
                            vocab_needed=meta["vocab_needed"], pad_id=meta["pad_id"],
                            token_dtype=meta["token_dtype"], read=meta["read"],
                            skipped=meta["skipped"], skipped_first=meta["skipped_first"])
