"""The default job: the byte-level GPT (or a transformers GPT-2 / Llama of the same
dimensions, or a pretrained directory) on the prepared corpus, or on instruction and
chat examples (``data.format = jsonl``), padded to ``model.seq_len`` (or packed into
rows of it by the Trainer, ``data.packing``)."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from ..config import Config
from ..data import TokenWindowDataset, collate_token_batch, corpus_from_config
from ..data.check import check_corpus_vocab, check_packable, check_samples, check_vocab
from ..data.example_cache import examples_from_config
from ..data.padding import PadToSeqLen
from ..models import GPT, flops_per_token, token_loss
from ..models.hf import build_hf_model, hf_dimensions, is_hf, matmul_flops_per_token
from ..names import DATA_JSONL
from . import rundir
from .batch import LossFn
from .trainer import Trainer


@dataclass(frozen=True)
class DefaultJob:
    model: nn.Module
    train_data: Dataset
    eval_data: Dataset
    flops_per_token: int
    loss_fn: LossFn | None  # None: the causal-LM loss on the output's logits
    eval_tokens_per_byte: float | None = None  # text corpora: for bits per byte
    # None: the Trainer's own (data.packing: it packs the examples into rows)
    collate_fn: Callable[[list], Any] | None = collate_token_batch


@dataclass(frozen=True)
class _Data:
    train: Dataset
    eval: Dataset
    collate: Callable[[list], Any] | None
    tokens_per_byte: float | None = None


def build_default_job(config: Config) -> DefaultJob:
    """Prepare (or reuse) the token shards, or the examples of ``data.format = jsonl``,
    and build the model on the meta device (the Trainer gives each rank's part its
    seeded values). The data checks the launcher makes are repeated here for jobs
    started with torchrun directly."""
    data = _prepared_data(config)
    with torch.device("meta"):  # each rank gives storage to its own part only
        model = build_hf_model(config.model) if is_hf(config.model) else GPT(config.model)
    if is_hf(config.model):
        flops = matmul_flops_per_token(model, *hf_dimensions(model, config.model))
        loss_fn = None
    else:
        flops, loss_fn = flops_per_token(config.model), token_loss
    if config.data.format == DATA_JSONL:
        loss_fn = None  # labels (transformers' convention): the default loss shifts them
    return DefaultJob(model=model, train_data=data.train, eval_data=data.eval,
                      flops_per_token=flops, loss_fn=loss_fn,
                      eval_tokens_per_byte=data.tokens_per_byte, collate_fn=data.collate)


def _prepared_data(config: Config) -> _Data:
    """The train and held-out datasets and how their samples are batched."""
    seq_len = config.model.seq_len
    check_packable(config.data)
    if config.data.format == DATA_JSONL:
        examples = examples_from_config(config.data, config.model)
        check_corpus_vocab(config.model, examples, config.explicit)
        return _Data(examples.dataset("train"), examples.dataset("val"),
                     None if config.data.packing else PadToSeqLen(seq_len, examples.pad_id))
    if config.data.format == "text":  # before preparing: refused without the work
        check_vocab(config.model)
    corpus = corpus_from_config(config.data)
    check_corpus_vocab(config.model, corpus, config.explicit)
    check_samples(corpus, config.data, seq_len)
    return _Data(TokenWindowDataset(corpus.train_shards, seq_len, corpus.token_dtype),
                 TokenWindowDataset(corpus.val_shards, seq_len, corpus.token_dtype),
                 collate_token_batch, corpus.val_tokens_per_byte)


def train_default(config: Config, run_dir: str | Path | None = None,
                  progress: bool = True) -> dict[str, Any]:
    """Train the default model on the default data; return the summary."""
    job = build_default_job(config)
    trainer = Trainer(job.model, job.train_data, job.loss_fn, config,
                      eval_dataset=job.eval_data, collate_fn=job.collate_fn,
                      run_dir=run_dir, flops_per_token=job.flops_per_token,
                      progress=progress, pretrained=config.model.pretrained or None)
    summary = trainer.fit()
    if job.eval_tokens_per_byte is not None:
        _add_bits_per_byte(trainer, summary, job.eval_tokens_per_byte, progress)
    return summary


def _add_bits_per_byte(trainer: Trainer, summary: dict[str, Any],
                       tokens_per_byte: float, say: bool) -> None:
    """The held-out losses (nats per token) as bits per byte of text, which compare
    across tokenizers; added to the summary (and summary.json, on rank 0)."""
    added = {}
    for key in ("initial_eval_loss", "final_eval_loss"):
        loss = summary.get(key)
        if isinstance(loss, float) and math.isfinite(loss):
            added[key.replace("_loss", "_bits_per_byte")] = loss / math.log(2) * tokens_per_byte
    if not added or all(summary.get(k) == v for k, v in added.items()):
        return  # nothing to add, or a finished run's stored summary already has it
    summary.update(added)
    if trainer.is_main and trainer.run_dir is not None:
        rundir.write_summary(trainer.run_dir, summary)
        final = added.get("final_eval_bits_per_byte")
        if final is not None and say:
            print(f"held-out loss {summary['final_eval_loss']:.4f} nats per token = "
                  f"{final:.4f} bits per byte", file=sys.stderr)
