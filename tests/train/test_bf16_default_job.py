"""bf16 on the default job (a smaller model, same data and loop) ends within 2% of fp32."""

from __future__ import annotations

import os

import pytest

from disttrain.config import load_config
from disttrain.testing import run_distributed
from disttrain.train import train_default

SMALL = {"model": {"n_layer": 2, "d_model": 64, "n_head": 4, "seq_len": 64},
         "train": {"steps": 60, "global_batch": 16, "eval_samples": 64, "warmup_steps": 6},
         "checkpoint": {"every": 0}}


def _job(precision: str, run_dir: str) -> float:
    values = {**SMALL, "train": {**SMALL["train"], "precision": precision}}
    return train_default(load_config(values=values), run_dir=run_dir,
                         progress=False)["final_eval_loss"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    path = tmp_path_factory.mktemp("cache")
    old = os.environ.get("DISTTRAIN_CACHE")
    os.environ["DISTTRAIN_CACHE"] = str(path)
    yield path
    if old is None:
        os.environ.pop("DISTTRAIN_CACHE")
    else:
        os.environ["DISTTRAIN_CACHE"] = old


def test_bf16_held_out_loss_within_two_percent_of_fp32(cache, tmp_path):
    fp32 = run_distributed(_job, 2, args=("fp32", str(tmp_path / "fp32")), timeout=300)[0]
    bf16 = run_distributed(_job, 2, args=("bf16", str(tmp_path / "bf16")), timeout=300)[0]
    assert fp32 < 4.0  # it learned something (starts near ln 256 = 5.5)
    assert abs(bf16 - fp32) <= 0.02 * fp32, (bf16, fp32)
