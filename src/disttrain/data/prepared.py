"""A prepared corpus: what both preparers (text files, :mod:`.corpus`; pre-tokenized
shards, :mod:`.pretokenized`) hand to the loaders."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

TOKEN_RANGE = 256  # byte tokens take ids 0..255: a model needs at least this vocabulary


@dataclass(frozen=True)
class PreparedCorpus:
    """A prepared corpus: token shard files split into train / val (``uint16`` byte
    tokens for text; a pre-tokenized corpus's own dtype), and the vocabulary a model
    needs to embed every token id."""

    directory: Path
    train_shards: list[Path]
    val_shards: list[Path]
    train_tokens: int
    val_tokens: int
    num_files: int
    token_dtype: str = "uint16"
    vocab_needed: int = TOKEN_RANGE
    val_bytes: int | None = None  # text bytes behind the val tokens (None: not text)

    @property
    def val_tokens_per_byte(self) -> float | None:
        """Held-out tokens per byte of text (separators included): converts a loss per
        token into bits per byte, which compares runs with different tokenizers."""
        return self.val_tokens / self.val_bytes if self.val_bytes else None
