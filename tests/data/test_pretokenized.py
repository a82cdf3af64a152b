"""data.format = tokens: pre-tokenized shards trained on in place, memory-mapped."""

from __future__ import annotations

import numpy as np
import pytest

from disttrain.config import load_config
from disttrain.data import TokenWindowDataset, corpus_from_config
from disttrain.data.check import check_corpus_vocab
from disttrain.errors import ConfigError, DataError
from disttrain.testing import run_distributed


def _config(path, *extra: str):
    return load_config(overrides=["data.format=tokens", f"data.path={path}",
                                  f"data.cache_dir={path.parent / 'cache'}", *extra])


def _nanogpt_dir(tmp_path, dtype=np.uint16, top: int = 999):
    """train.bin / val.bin as nanoGPT writes them: flat token ids."""
    root = tmp_path / "tokens"
    root.mkdir()
    rng = np.random.default_rng(0)
    train = rng.integers(0, top + 1, 5000).astype(dtype)
    train[17] = top  # the largest id is somewhere in the middle
    train.tofile(root / "train.bin")
    rng.integers(0, top, 700).astype(dtype).tofile(root / "val.bin")
    return root, train


def test_named_shards_split_and_windows_read_the_files(tmp_path):
    root, train = _nanogpt_dir(tmp_path)
    corpus = corpus_from_config(_config(root).data)
    assert [p.name for p in corpus.train_shards] == ["train.bin"]
    assert [p.name for p in corpus.val_shards] == ["val.bin"]
    assert (corpus.train_tokens, corpus.val_tokens, corpus.vocab_needed) == (5000, 700, 1000)
    ds = TokenWindowDataset(corpus.train_shards, 15, corpus.token_dtype)
    assert len(ds) == 5000 // 16
    sample = ds[3]
    assert sample["input_ids"].tolist() == train[48:63].tolist()
    assert sample["targets"].tolist() == train[49:64].tolist()
    assert isinstance(ds._map(0), np.memmap)  # mapped, not read into memory


def test_uint32_shards_and_the_vocabulary_they_need(tmp_path):
    root, _ = _nanogpt_dir(tmp_path, np.uint32, top=70_000)
    config = _config(root, "data.token_dtype=uint32", "model.vocab_size=50257")
    corpus = corpus_from_config(config.data)
    assert corpus.vocab_needed == 70_001
    with pytest.raises(ConfigError, match=r"model.vocab_size=50257.*ids 0..70000.*70001"):
        check_corpus_vocab(config.model, corpus)
    # read as uint16 the same bytes are other (twice as many) tokens: the sizes agree
    # here, so the dtype must be said; an odd size is refused
    (root / "train.bin").write_bytes((root / "train.bin").read_bytes() + b"x")
    with pytest.raises(DataError, match="not a whole number of uint32 tokens"):
        corpus_from_config(config.data)


def test_npy_shards_split_by_path_when_none_is_named_val(tmp_path):
    root = tmp_path / "npy"
    root.mkdir()
    for i in range(8):
        np.save(root / f"shard_{i:03d}.npy", np.arange(i * 100, i * 100 + 100, dtype=np.int32))
    corpus = corpus_from_config(_config(root, "data.val_fraction=0.3").data)
    assert len(corpus.train_shards) + len(corpus.val_shards) == 8
    assert corpus.train_shards and corpus.val_shards
    assert corpus.vocab_needed == 800 and corpus.train_tokens + corpus.val_tokens == 800
    ds = TokenWindowDataset(corpus.val_shards, 9, corpus.token_dtype)
    first = int(corpus.val_shards[0].stem.split("_")[1]) * 100
    assert ds[0]["input_ids"].tolist() == list(range(first, first + 9))


@pytest.mark.parametrize("make, message", [
    (lambda d: None, "no token shards matched"),
    (lambda d: np.arange(10, dtype=np.uint16).tofile(d / "all.bin"), "one shard and none"),
    (lambda d: np.save(d / "x.npy", np.zeros((2, 3), dtype=np.int64)), "1-D integer array"),
    (lambda d: np.save(d / "x.npy", np.zeros(4, dtype=np.float32)), "1-D integer array"),
    (lambda d: (d / "x.npy").write_bytes(b"not numpy"), "not a readable .npy"),
    (lambda d: [np.save(d / f"{n}.npy", np.array([1, -3], dtype=np.int64))
                for n in ("train", "val")], "negative token id"),
])
def test_bad_shards_are_one_line(tmp_path, make, message):
    root = tmp_path / "bad"
    root.mkdir()
    make(root)
    with pytest.raises(DataError, match=message) as caught:
        corpus_from_config(_config(root).data)
    assert "\n" not in str(caught.value)


def _train_on_tokens(root: str) -> list[float]:
    from pathlib import Path

    from disttrain.train import train_default

    config = _config(Path(root), "model.vocab_size=1000", "model.n_layer=1",
                     "model.d_model=32", "model.n_head=2", "model.seq_len=16",
                     "train.steps=4", "train.global_batch=8", "train.eval_samples=8",
                     "train.log_every=2", "monitor.peak_tflops=1.0")
    summary = train_default(config, run_dir=str(Path(root).parent / "run"), progress=False)
    return [summary["steps"], summary["final_eval_loss"]]


def test_a_pre_tokenized_corpus_trains(tmp_path):
    root, _ = _nanogpt_dir(tmp_path)
    (steps, loss), _ = run_distributed(_train_on_tokens, 2, args=(str(root),), timeout=120)
    assert steps == 4 and np.isfinite(loss) and loss < 1.2 * np.log(1000)
