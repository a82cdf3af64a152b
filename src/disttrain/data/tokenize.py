"""How text files become token ids: ``data.tokenizer``.

- ``bytes`` (the default): each byte is a token (ids 0..255), documents separated by 0
  (NUL never occurs in a text file).
- a path to a Hugging Face ``tokenizer.json``: read from disk with the ``tokenizers``
  library, nothing downloaded. Documents are separated by the tokenizer's end-of-text
  token when it has one (``<|endoftext|>``, ``</s>``, ``<eos>``, ``<|end_of_text|>``),
  else by one id past its vocabulary.
- ``bpe:N``: a byte-level BPE of N tokens trained on the training split with
  ``tokenizers`` the first time the corpus is prepared, saved as ``tokenizer.json``
  beside the shards (so cached and keyed like them); ``<|endoftext|>`` is id 0 and
  separates documents.

Text is read as UTF-8, an invalid byte replaced by U+FFFD (the byte tokenizer keeps
every byte). Shards hold ``uint16`` ids when the vocabulary fits, else ``uint32``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from disttrain.config.consistency import BPE_PATTERN as _BPE
from disttrain.config.consistency import TOKENIZER_BYTES as BYTES
from disttrain.errors import ConfigError

END_OF_TEXT = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>")


class Encoder:
    """Text -> ids; ``separator`` follows every document; ids are below
    ``vocab_size``; ``key`` names it in cache keys."""

    key = BYTES
    separator = 0
    vocab_size = 256

    def encode(self, data: bytes) -> np.ndarray:
        return np.frombuffer(data, dtype=np.uint8)

    @property
    def dtype(self) -> str:
        return "uint16" if self.vocab_size <= 1 << 16 else "uint32"

    def save(self, directory: Path) -> None:
        """Write what the run needs to read its ids back (nothing for bytes)."""


class HFEncoder(Encoder):
    """A ``tokenizers.Tokenizer``: from a tokenizer.json file, or trained here."""

    def __init__(self, tokenizer: Any, key: str) -> None:
        self.tokenizer, self.key = tokenizer, key
        size = tokenizer.get_vocab_size(with_added_tokens=True)
        ids = [tokenizer.token_to_id(t) for t in END_OF_TEXT]
        found = [i for i in ids if i is not None]
        self.separator = found[0] if found else size
        self.vocab_size = size if found else size + 1

    def encode(self, data: bytes) -> np.ndarray:
        # the ids only: encode_batch_fast (tokenizers >= 0.20) skips the character
        # offsets that encode tracks (0.6x its time on source text); the same ids
        encode = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
        ids = encode([data.decode("utf-8", errors="replace")], add_special_tokens=False)[0].ids
        return np.asarray(ids, dtype=np.int64)

    def save(self, directory: Path) -> None:
        self.tokenizer.save(str(directory / "tokenizer.json"))


def tokenizer_key(value: str) -> str:
    """What the cache key holds for ``data.tokenizer``: a file by its content."""
    if value == BYTES or _BPE.match(value):
        return value
    digest = hashlib.sha256(Path(value).expanduser().read_bytes()).hexdigest()[:16]
    return f"file:{digest}"


def build_encoder(value: str, training_text: Iterable[bytes]) -> Encoder:
    """The encoder for ``data.tokenizer``; ``bpe:N`` trains on ``training_text``."""
    if value == BYTES:
        return Encoder()
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    match = _BPE.match(value)
    if match is None:
        try:
            return HFEncoder(Tokenizer.from_file(str(Path(value).expanduser())),
                             tokenizer_key(value))
        except Exception as exc:  # the library's own error type: one line
            raise ConfigError("data.tokenizer", value, f"cannot be read ({exc})",
                              "give a Hugging Face tokenizer.json") from None
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=int(match.group(1)),
                                  special_tokens=[END_OF_TEXT[0]],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(
        (data.decode("utf-8", errors="replace") for data in training_text), trainer)
    return HFEncoder(tokenizer, value)
