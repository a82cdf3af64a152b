"""Corpus preparation: exact bytes, deterministic split, caching, errors, concurrency."""

from __future__ import annotations

import fcntl
import multiprocessing as mp
import os
import time
from pathlib import Path

import numpy as np
import pytest

from disttrain.config.schema import DataConfig
from disttrain.data import (
    PreparedCorpus,
    corpus_files,
    corpus_from_config,
    default_cache_dir,
    prepare_corpus,
    stdlib_source_dir,
)
from disttrain.errors import DataError

TEXTS = {
    "a.txt": b"alpha file\n" * 3,
    "b.txt": b"bravo\n",
    "sub/c.txt": "charlie \u00e9\u00e8 unicode\n".encode() * 5,
    "sub/deep/d.txt": b"delta" * 40,
    "e.txt": b"echo echo",
    "f.txt": b"foxtrot\n" * 7,
}


def _tokens(shards: list[Path]) -> np.ndarray:
    parts = [np.fromfile(s, dtype=np.uint16) for s in shards]
    return np.concatenate(parts) if parts else np.zeros(0, np.uint16)


def _documents(shards: list[Path]) -> list[bytes]:
    """Split the concatenated shards on the 0 separator back into file contents."""
    raw = _tokens(shards)
    assert raw.max(initial=0) < 256 and raw[-1] == 0
    return raw.astype(np.uint8).tobytes()[:-1].split(b"\0")


@pytest.fixture()
def text_dir(tmp_path: Path) -> Path:
    root = tmp_path / "texts"
    for rel, data in TEXTS.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    (root / "image.bin").write_bytes(b"\x89PNG\0\0\x01binary")
    (root / "empty.txt").write_bytes(b"")
    (root / "__pycache__").mkdir()
    (root / "__pycache__" / "x.txt").write_bytes(b"cached")
    (root / "site-packages").mkdir()
    (root / "site-packages" / "y.txt").write_bytes(b"installed")
    return root


def test_corpus_files_skips_binary_and_ignored_dirs(text_dir: Path) -> None:
    files = corpus_files(text_dir, "**/*")
    assert [f.relative_to(text_dir).as_posix() for f in files] == sorted(TEXTS)
    assert corpus_files(text_dir, "*.txt") == [text_dir / n for n in
                                               ("a.txt", "b.txt", "e.txt", "f.txt")]
    assert corpus_files(text_dir, "sub/**/*.txt") == [text_dir / "sub/c.txt",
                                                      text_dir / "sub/deep/d.txt"]


def test_shards_hold_exactly_the_text_bytes(text_dir: Path, tmp_path: Path) -> None:
    corpus = prepare_corpus(text_dir, "**/*", tmp_path / "cache", 0.3)
    train, val = _documents(corpus.train_shards), _documents(corpus.val_shards)
    assert train and val
    assert sorted(train + val) == sorted(TEXTS.values())
    assert corpus.num_files == len(TEXTS)
    assert corpus.train_tokens == _tokens(corpus.train_shards).size
    assert corpus.val_tokens == _tokens(corpus.val_shards).size
    assert corpus.train_tokens + corpus.val_tokens == sum(len(v) + 1 for v in TEXTS.values())
    assert [s.name for s in corpus.train_shards][0] == "train_00000.bin"
    assert (corpus.directory / "meta.json").exists()


def test_split_is_deterministic_by_path(text_dir: Path, tmp_path: Path) -> None:
    first = prepare_corpus(text_dir, "**/*", tmp_path / "c1", 0.3)
    second = prepare_corpus(text_dir, "**/*", tmp_path / "c2", 0.3)
    assert first.directory.name == second.directory.name
    assert _documents(first.val_shards) == _documents(second.val_shards)
    assert _documents(first.train_shards) == _documents(second.train_shards)


@pytest.mark.parametrize("val_fraction", [1e-9, 0.999999])
def test_both_splits_non_empty_at_extreme_fractions(text_dir: Path, tmp_path: Path,
                                                    val_fraction: float) -> None:
    corpus = prepare_corpus(text_dir, "**/*", tmp_path / "cache", val_fraction)
    assert corpus.train_tokens > 0 and corpus.val_tokens > 0


def test_single_file_is_split_by_bytes(tmp_path: Path) -> None:
    (tmp_path / "only").mkdir()
    (tmp_path / "only" / "book.txt").write_bytes(b"0123456789" * 10)
    corpus = prepare_corpus(tmp_path / "only", "*.txt", tmp_path / "cache", 0.1)
    train, val = _documents(corpus.train_shards), _documents(corpus.val_shards)
    assert train[0] + val[0] == b"0123456789" * 10
    assert len(val[0]) == 10


def test_second_call_reuses_cache(text_dir: Path, tmp_path: Path) -> None:
    first = prepare_corpus(text_dir, "**/*", tmp_path / "cache", 0.3)
    stamps = {p: p.stat().st_mtime_ns for p in first.directory.iterdir()}
    os.utime(first.directory / "meta.json", ns=(1, 1))  # a rewrite would reset this
    second = prepare_corpus(text_dir, "**/*", tmp_path / "cache", 0.3)
    assert second == first
    assert (first.directory / "meta.json").stat().st_mtime_ns == 1
    assert all(p.stat().st_mtime_ns == t for p, t in stamps.items() if p.name != "meta.json")


def test_changed_file_gives_new_key(text_dir: Path, tmp_path: Path) -> None:
    first = prepare_corpus(text_dir, "**/*", tmp_path / "cache", 0.3)
    (text_dir / "b.txt").write_bytes(b"bravo changed\n")
    second = prepare_corpus(text_dir, "**/*", tmp_path / "cache", 0.3)
    assert second.directory != first.directory
    docs = _documents(second.train_shards) + _documents(second.val_shards)
    assert b"bravo changed\n" in docs and b"bravo\n" not in docs
    other_fraction = prepare_corpus(text_dir, "**/*", tmp_path / "cache", 0.2)
    assert other_fraction.directory != second.directory


def test_big_files_pack_and_split_across_small_shards(tmp_path: Path) -> None:
    root = tmp_path / "big"
    root.mkdir()
    sizes = {"a.txt": 30, "b.txt": 30, "c.txt": 130, "d.txt": 10}
    for name, n in sizes.items():
        (root / name).write_bytes(name[0].encode() * n)
    corpus = prepare_corpus(root, "*.txt", tmp_path / "cache", 1e-9, shard_tokens=64)
    shards = corpus.train_shards + corpus.val_shards
    assert all(s.stat().st_size // 2 <= 64 for s in shards)
    # a, b (31 tokens each) share shard 0; c (131 tokens) is cut at 64-token boundaries.
    first = np.fromfile(corpus.train_shards[0], dtype=np.uint16).astype(np.uint8).tobytes()
    assert first == b"a" * 30 + b"\0" + b"b" * 30 + b"\0"
    assert sorted(_documents(corpus.train_shards) + _documents(corpus.val_shards)) == \
        sorted(name[0].encode() * n for name, n in sizes.items())


def test_missing_directory_is_a_one_line_data_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no such directory") as info:
        prepare_corpus(tmp_path / "nope", "**/*", tmp_path / "cache", 0.1)
    message = str(info.value)
    assert "\n" not in message and "data.path=" in message and "nope" in message


def test_directory_without_text_is_a_one_line_data_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "blob.dat").write_bytes(b"\0\1\2")
    for root in (tmp_path / "empty", tmp_path / "bin"):
        with pytest.raises(DataError, match="no text files") as info:
            prepare_corpus(root, "**/*", tmp_path / "cache", 0.1)
        message = str(info.value)
        assert "\n" not in message and str(root) in message and "'**/*'" in message
    assert not list((tmp_path / "cache").glob("corpus-*.tmp-*"))


def _flock_waiters(path: Path) -> int:
    """How many processes are blocked in flock on ``path`` (Linux /proc/locks)."""
    inode = f":{path.stat().st_ino} "
    lines = Path("/proc/locks").read_text().splitlines()
    return sum(1 for line in lines if "->" in line and "FLOCK" in line and inode in line)


@pytest.mark.skipif(not Path("/proc/locks").exists(), reason="needs Linux /proc/locks")
def test_concurrent_preparation_yields_one_directory(text_dir: Path, tmp_path: Path) -> None:
    # Hold the lock until all three preparers are queued on it, so every one of them has
    # already seen "not prepared": only the re-check under the lock stops a second build.
    key = prepare_corpus(text_dir, "**/*", tmp_path / "probe", 0.3).directory.name
    cache = tmp_path / "cache"
    cache.mkdir()
    lock_path = cache / f"{key}.lock"
    with mp.get_context("spawn").Pool(3) as pool, open(lock_path, "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        pending = pool.starmap_async(prepare_corpus, [(text_dir, "**/*", cache, 0.3)] * 3)
        deadline = time.monotonic() + 60
        while _flock_waiters(lock_path) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _flock_waiters(lock_path) == 3 and not pending.ready()
        fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
        results = pending.get(timeout=60)
    assert results[0] == results[1] == results[2]
    assert isinstance(results[0], PreparedCorpus)
    assert sorted(p.name for p in cache.iterdir()) == [key, f"{key}.lock"]
    assert sorted(_documents(results[0].train_shards) + _documents(results[0].val_shards)) \
        == sorted(TEXTS.values())


def test_stdlib_corpus(tmp_path: Path) -> None:
    corpus = prepare_corpus(None, "ignored", tmp_path, 0.05)
    files = corpus_files(stdlib_source_dir(), "**/*.py")
    assert corpus.num_files == len(files) > 500
    assert corpus.train_tokens + corpus.val_tokens == sum(f.stat().st_size + 1 for f in files)
    assert corpus.val_tokens > 0 and corpus.train_tokens > 10 * corpus.val_tokens
    assert all(s.stat().st_size // 2 <= 8 * 2**20 for s in corpus.train_shards)
    assert all("site-packages" not in f.parts for f in files)


def test_default_cache_dir_and_config(monkeypatch: pytest.MonkeyPatch, text_dir: Path,
                                      tmp_path: Path) -> None:
    monkeypatch.setenv("DISTTRAIN_CACHE", str(tmp_path / "envcache"))
    assert default_cache_dir() == tmp_path / "envcache"
    corpus = corpus_from_config(DataConfig(path=str(text_dir), val_fraction=0.3))
    assert corpus.directory.parent == tmp_path / "envcache"
    monkeypatch.delenv("DISTTRAIN_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "disttrain"
