"""Data: corpus preparation into token shards, windows over them, instruction and chat
examples (one sample each, padded into batches), the global sample order."""

from disttrain.data.corpus import (
    corpus_files,
    corpus_from_config,
    prepare_corpus,
    stdlib_source_dir,
)
from disttrain.data.dataset import TokenWindowDataset, collate_token_batch
from disttrain.data.example_cache import examples_from_config, prepare_examples
from disttrain.data.examples import ExampleDataset, PreparedExamples
from disttrain.data.files import default_cache_dir
from disttrain.data.padding import PadToSeqLen
from disttrain.data.prepared import PreparedCorpus
from disttrain.data.sampler import GlobalOrderSampler, eval_indices
from disttrain.data.samples import BatchFetchDataset, fetch_samples, tensor_rows

__all__ = [
    "BatchFetchDataset",
    "ExampleDataset",
    "GlobalOrderSampler",
    "PadToSeqLen",
    "PreparedCorpus",
    "PreparedExamples",
    "TokenWindowDataset",
    "collate_token_batch",
    "corpus_files",
    "corpus_from_config",
    "default_cache_dir",
    "eval_indices",
    "examples_from_config",
    "fetch_samples",
    "prepare_corpus",
    "prepare_examples",
    "stdlib_source_dir",
    "tensor_rows",
]
