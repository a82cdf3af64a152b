"""data.workers: micro-batches assembled by loader worker processes ahead of use, with
the same samples in the same order as loading in the training process."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from support import fit_tiny

from disttrain.config import load_config
from disttrain.data.loader import PrefetchingLoader
from disttrain.errors import ConfigError
from disttrain.faults import FAULT_ENV, FAULT_EXIT_CODE
from disttrain.testing import DistributedTestError, run_distributed

STEPS = 10


def _stack(samples: list) -> torch.Tensor:
    return torch.stack(samples)


def _from(start: int):
    """The plan after a step: pairs of consecutive indices from ``start``."""
    def lists():
        i = start
        while True:
            yield [i % 40, (i + 1) % 40]
            i += 2
    return lists


def test_workers_serve_the_plan_and_anything_off_it_is_loaded_by_the_caller():
    data = [torch.full((3,), i) for i in range(40)]
    loader = PrefetchingLoader(data, _stack, 2, prefetch=2)
    try:
        assert loader.take([0, 1]) is None  # nothing planned yet
        loader.follow([[0, 1], [2, 3]], _from(4))
        assert loader.take([0, 1])[:, 0].tolist() == [0, 1]
        assert loader.take([2, 3])[:, 0].tolist() == [2, 3]
        loader.follow([[4, 5], [9, 9], [6, 7]], _from(8))
        assert loader.take([4, 5])[:, 0].tolist() == [4, 5]
        # a batch the plan did not foresee: the caller loads it, the stream goes on
        # after it from the step's own lists
        assert loader.take([9, 8]) is None and loader.restarts == 1
        assert loader.take([6, 7])[:, 0].tolist() == [6, 7]
        loader.follow([[8, 9]], _from(10))
        assert loader.take([8, 9])[:, 0].tolist() == [8, 9]
        assert loader.restarts == 1
    finally:
        loader.close()


@pytest.fixture(scope="module")
def in_process(tmp_path_factory):
    """10 steps at 2 ranks, every micro-batch loaded by the training process."""
    return run_distributed(fit_tiny, 2, args=(STEPS, str(tmp_path_factory.mktemp("w0"))),
                           kwargs={"global_batch": 8, "micro_batch": 2, "grad_accum": None,
                                   "workers": 0},
                           timeout=120)[0]


def _equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_two_workers_give_exactly_the_parameters_of_none(in_process, tmp_path):
    with_workers = run_distributed(fit_tiny, 2, args=(STEPS, str(tmp_path)),
                                   kwargs={"global_batch": 8, "micro_batch": 2,
                                           "grad_accum": None, "workers": 2},
                                   timeout=120)[0]
    _equal(with_workers, in_process)


def test_resume_with_workers_is_exact(in_process, tmp_path, monkeypatch):
    train = {"global_batch": 8, "micro_batch": 2, "grad_accum": None, "workers": 2}
    checkpoint = {"every": 5, "async": False}
    monkeypatch.setenv(FAULT_ENV, "train.step:7")
    with pytest.raises(DistributedTestError,
                       match=f"exit code {FAULT_EXIT_CODE}|exit code 1|Connection|peer"):
        run_distributed(fit_tiny, 2, args=(STEPS, str(tmp_path)),
                        kwargs={"checkpoint": checkpoint, **train}, timeout=120)
    monkeypatch.delenv(FAULT_ENV)
    resumed = run_distributed(fit_tiny, 2, args=(STEPS, str(tmp_path)),
                              kwargs={"checkpoint": checkpoint, **train}, timeout=120)[0]
    _equal(resumed, in_process)


def _train_tokens(root: str, workers: int) -> None:
    from disttrain.train import train_default

    config = load_config(overrides=[
        "data.format=tokens", f"data.path={root}", f"data.workers={workers}",
        "data.token_dtype=uint32", "model.vocab_size=70000", "model.n_layer=1",
        "model.d_model=16", "model.n_head=2", "model.seq_len=16", "train.steps=6",
        "train.global_batch=8", "train.micro_batch=2", "train.eval_samples=8",
        "train.log_every=3", "monitor.peak_tflops=1.0"])
    train_default(config, run_dir=str(Path(root).parent / f"run{workers}"), progress=False)


def test_a_token_directory_loads_the_same_through_workers(tmp_path):
    root = tmp_path / "tokens"
    root.mkdir()
    rng = np.random.default_rng(0)
    rng.integers(0, 70000, 4000).astype(np.uint32).tofile(root / "train.bin")
    rng.integers(0, 70000, 600).astype(np.uint32).tofile(root / "val.bin")
    for workers in (0, 2):
        run_distributed(_train_tokens, 2, args=(str(root), workers), timeout=120)
    _equal(load_file(tmp_path / "run2" / "model.safetensors"),
           load_file(tmp_path / "run0" / "model.safetensors"))


@pytest.mark.parametrize("value", ["-1", "65", "two"])
def test_a_bad_worker_count_is_refused(value):
    with pytest.raises(ConfigError, match="data.workers"):
        load_config(overrides=[f"data.workers={value}"])
