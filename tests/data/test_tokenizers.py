"""data.tokenizer: bytes (the default), a Hugging Face tokenizer.json, or bpe:N trained
on the training split; the corpus records the vocabulary the model must cover."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from disttrain.config import load_config
from disttrain.data import TokenWindowDataset, corpus_from_config
from disttrain.data.check import check_corpus_vocab
from disttrain.errors import ConfigError

pytestmark = pytest.mark.slow  # spawns worlds or trains: not in the quick check

pytest.importorskip("tokenizers")

TEXT = ("the quick brown fox jumps over the lazy dog. " * 40 + "\n",
        "pack my box with five dozen liquor jugs. " * 40 + "\n",
        "sphinx of black quartz, judge my vow. " * 40 + "\n")


def _texts(tmp_path):
    root = tmp_path / "text"
    root.mkdir()
    for i in range(12):
        (root / f"doc{i:02d}.txt").write_text(TEXT[i % 3])
    return root


def _config(root, tokenizer: str, *extra: str):
    return load_config(overrides=[f"data.path={root}", f"data.tokenizer={tokenizer}",
                                  f"data.cache_dir={root.parent / 'cache'}",
                                  "data.val_fraction=0.25", *extra])


def test_bpe_is_trained_once_cached_and_its_ids_decode_to_the_text(tmp_path):
    from tokenizers import Tokenizer

    root = _texts(tmp_path)
    corpus = corpus_from_config(_config(root, "bpe:300").data)
    assert corpus.vocab_needed == 300 and corpus.token_dtype == "uint16"
    tokenizer = Tokenizer.from_file(str(corpus.directory / "tokenizer.json"))
    ids = np.concatenate([np.fromfile(s, dtype=np.uint16) for s in corpus.train_shards])
    meta = json.loads((corpus.directory / "meta.json").read_text())
    assert int((ids == 0).sum()) == meta["train_files"]  # one <|endoftext|> per document
    ids = ids.tolist()
    first = ids[:ids.index(0)]  # up to the first <|endoftext|>
    assert tokenizer.decode(first) in TEXT
    assert len(first) < len(tokenizer.decode(first)) / 2  # merges: fewer ids than bytes
    again = corpus_from_config(_config(root, "bpe:300").data)
    assert again.directory == corpus.directory  # cached, keyed with the tokenizer
    assert corpus_from_config(_config(root, "bytes").data).directory != corpus.directory


def test_a_tokenizer_json_from_disk_with_its_end_of_text(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    root = _texts(tmp_path)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(
        vocab_size=120, special_tokens=["<unk>", "</s>"], show_progress=False))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    size = tok.get_vocab_size()
    config = _config(root, str(path), f"model.vocab_size={size - 1}")
    corpus = corpus_from_config(config.data)
    meta = json.loads((corpus.directory / "meta.json").read_text())
    assert meta["separator"] == tok.token_to_id("</s>")
    assert corpus.vocab_needed == size
    with pytest.raises(ConfigError, match=f"model.vocab_size={size - 1}"):
        check_corpus_vocab(config.model, corpus)
    windows = TokenWindowDataset(corpus.train_shards, 8, corpus.token_dtype)
    assert int(windows[0]["input_ids"].max()) < corpus.vocab_needed


@pytest.mark.parametrize("value, message", [
    ("bpe:12", "from 260"), ("bpe:lots", "is not bpe:N"),
    ("/no/such/tokenizer.json", "neither bytes, bpe:N nor a file")])
def test_bad_tokenizer_values_are_refused_before_launch(value, message):
    from disttrain.config.consistency import check_sections

    with pytest.raises(ConfigError, match=message):
        check_sections(load_config(overrides=[f"data.tokenizer={value}"]))


def test_a_tokenizer_with_pre_tokenized_shards_is_refused():
    from disttrain.config.consistency import check_sections

    with pytest.raises(ConfigError, match="data.format=tokens reads ids"):
        check_sections(load_config(overrides=["data.format=tokens",
                                              "data.tokenizer=bpe:300"]))


def test_the_models_vocabulary_follows_the_tokenizer_unless_set(tmp_path, monkeypatch):
    from disttrain.train import build_default_job

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    root = _texts(tmp_path)
    tiny = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.seq_len=16"]
    job = build_default_job(_config(root, "bpe:300", *tiny))
    embedding = next(m for m in job.model.modules() if isinstance(m, torch.nn.Embedding))
    assert embedding.num_embeddings == 320  # 300 rounded up to a multiple of 64
    with pytest.raises(ConfigError, match="model.vocab_size=256"):
        build_default_job(_config(root, "bpe:300", *tiny, "model.vocab_size=256"))


def _train(root: str, tokenizer: str) -> dict:
    from pathlib import Path

    from disttrain.train import train_default

    config = _config(Path(root), tokenizer, "model.n_layer=1", "model.d_model=32",
                     "model.n_head=2", "model.seq_len=16", "train.steps=3",
                     "train.global_batch=4", "train.eval_samples=4", "train.log_every=3",
                     "monitor.peak_tflops=1.0")
    return train_default(config, run_dir=str(Path(root).parent / f"run-{tokenizer[:3]}"),
                         progress=False)


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe:300"])
def test_held_out_loss_is_also_reported_in_bits_per_byte(tmp_path, tokenizer):
    import math

    from disttrain.testing import run_distributed

    root = _texts(tmp_path)
    summary = run_distributed(_train, 1, args=(str(root), tokenizer), timeout=120)[0]
    corpus = corpus_from_config(_config(root, tokenizer).data)
    per_byte = corpus.val_tokens / corpus.val_bytes
    assert per_byte < 0.7 if tokenizer != "bytes" else 1.0 < per_byte < 1.01
    assert summary["final_eval_bits_per_byte"] == pytest.approx(
        summary["final_eval_loss"] / math.log(2) * per_byte)
    stored = json.loads((tmp_path / f"run-{tokenizer[:3]}" / "summary.json").read_text())
    assert stored["final_eval_bits_per_byte"] == summary["final_eval_bits_per_byte"]


def _train_default_corpus(cache: str) -> dict:
    from pathlib import Path

    from disttrain.train import train_default

    config = load_config(overrides=[
        "data.tokenizer=bpe:512", f"data.cache_dir={cache}", "model.n_layer=1",
        "model.d_model=32", "model.n_head=2", "model.seq_len=32", "train.steps=3",
        "train.global_batch=4", "train.eval_samples=8", "train.log_every=3",
        "monitor.peak_tflops=1.0"])
    return train_default(config, run_dir=str(Path(cache).parent / "run"), progress=False)


def test_bpe_512_on_the_default_corpus_trains_once_and_reports_bits_per_byte(tmp_path):
    """The issue's acceptance case: the standard-library corpus (tens of MB of text),
    its BPE trained once and reused, a model of vocabulary 512, bits per byte."""
    import math
    import time

    from disttrain.testing import run_distributed

    cache = tmp_path / "cache"
    summary = run_distributed(_train_default_corpus, 1, args=(str(cache),), timeout=600)[0]
    config = load_config(overrides=["data.tokenizer=bpe:512", f"data.cache_dir={cache}"])
    tokenizer_file = next(cache.glob("*/tokenizer.json"))
    trained_at = tokenizer_file.stat().st_mtime_ns
    start = time.monotonic()
    corpus = corpus_from_config(config.data)  # the second preparation: from the cache
    assert time.monotonic() - start < 30 and corpus.vocab_needed == 512
    assert tokenizer_file.stat().st_mtime_ns == trained_at
    assert len([d for d in cache.iterdir() if d.is_dir()]) == 1  # one prepared corpus
    assert 'vocab_size = 512' in (tmp_path / "run" / "config.toml").read_text()
    per_byte = corpus.val_tokens / corpus.val_bytes
    assert 0.2 < per_byte < 0.7  # merges: well under one id per byte
    assert math.isfinite(summary["final_eval_bits_per_byte"])
    assert summary["final_eval_bits_per_byte"] == pytest.approx(
        summary["final_eval_loss"] / math.log(2) * per_byte)
