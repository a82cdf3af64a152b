"""Whether the byte corpus can feed the configured model, checked before launch:
its token range against ``model.vocab_size``, at least one sample (a window of
``seq_len + 1`` tokens inside one shard) in each split, and no packing of its windows."""

from __future__ import annotations

import json
from pathlib import Path

from disttrain.config.schema import DataConfig, ModelConfig
from disttrain.data.corpus import stdlib_source_dir
from disttrain.data.dataset import tokens_per_shard
from disttrain.data.examples import PreparedExamples
from disttrain.data.prepared import TOKEN_RANGE, PreparedCorpus
from disttrain.errors import ConfigError, DataError
from disttrain.names import DATA_JSONL, DATA_TEXT, DATA_TOKENS

# data.format values whose samples are fixed windows of model.seq_len + 1 tokens
WINDOW_FORMATS = (DATA_TEXT, DATA_TOKENS)


def check_packable(data: DataConfig) -> None:
    """``data.packing`` packs examples of varying length; a corpus cut into full
    windows has none to pack."""
    if data.packing and data.format in WINDOW_FORMATS:
        raise ConfigError("data.packing", True, f"data.format = {data.format} cuts the "
                          "corpus into full windows of model.seq_len tokens, which leave "
                          "nothing to pack", f"set data.format = {DATA_JSONL} (examples), "
                          "or data.packing = false")


def check_vocab(model: ModelConfig, needed: int = TOKEN_RANGE,
                what: str = "the byte corpus") -> None:
    """The corpus has token ids up to ``needed - 1`` (the byte corpus: ``TOKEN_RANGE -
    1``); the embedding must cover them."""
    if model.vocab_size < needed:
        raise ConfigError("model.vocab_size", model.vocab_size,
                          f"is below {what}'s token range (ids 0..{needed - 1})",
                          f"set model.vocab_size to at least {needed}")


def check_corpus_vocab(model: ModelConfig, corpus: PreparedCorpus | PreparedExamples,
                       explicit: frozenset[str] = frozenset({"model.vocab_size"})) -> None:
    """:func:`check_vocab` against a prepared corpus's (or examples') own token range.
    Unless the user set ``model.vocab_size`` (it is not in ``explicit``), the model's
    vocabulary follows the corpus instead: raised to its range, rounded up to a multiple of 64 (the
    embedding's rows then fill whole matmul tiles)."""
    what = f"the corpus in {corpus.directory}"
    if model.hf_config:  # the transformers config's own vocabulary
        vocab = _hf_vocab(Path(model.hf_config).expanduser())
        if vocab is not None and vocab < corpus.vocab_needed:
            field, value = (("model.pretrained", model.pretrained) if model.pretrained
                            else ("model.hf_config", model.hf_config))
            raise ConfigError(field, value,
                              f"has vocab_size {vocab}, below {what}'s token range (ids "
                              f"0..{corpus.vocab_needed - 1})",
                              "use a model whose vocab_size covers the tokenizer's")
        return
    if "model.vocab_size" not in explicit:
        if model.vocab_size < corpus.vocab_needed:
            model.vocab_size = -(-corpus.vocab_needed // 64) * 64
        return
    check_vocab(model, corpus.vocab_needed, what)


def _hf_vocab(path: Path) -> int | None:
    try:
        vocab = json.loads(path.read_text(encoding="utf-8")).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return None
    return vocab if isinstance(vocab, int) else None


def check_samples(corpus: PreparedCorpus, data: DataConfig, seq_len: int) -> None:
    """Refuse a corpus whose train or val split holds no window of ``seq_len + 1``
    tokens, naming the data directory and the largest seq_len that fits."""
    for split, shards in (("train", corpus.train_shards), ("val", corpus.val_shards)):
        tokens = tokens_per_shard(shards, corpus.token_dtype)
        if max(tokens, default=0) >= seq_len + 1:
            continue
        where = str(Path(data.path).expanduser()) if data.path else str(stdlib_source_dir())
        fits = max(tokens, default=0) - 1
        fix = (f"lower model.seq_len to {fits} or less, or add text"
               if fits >= 1 else "add text")
        raise DataError(f"data.path={where!r}: its {split} split has {sum(tokens)} "
                        f"token(s), fewer than one sample of model.seq_len+1={seq_len + 1} "
                        f"({fix})")
