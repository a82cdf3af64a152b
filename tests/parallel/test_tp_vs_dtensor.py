"""The DTensor baseline of ``bench/tp_vs_dtensor.py`` trains the same model as disttrain.

The bench's own set-ups (``bench/tp_models.py``: the models, torch's
``parallelize_module`` plans with ``loss_parallel``, disttrain's
``apply_tensor_parallel``) train tiny copies of the GPT (sequence parallelism off and
on) and of a transformers Llama at tp 2, one world shared by the cases, for a few
AdamW steps on one batch; their losses must agree step by step, so the bench's speed
ratio compares like with like.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import tp_models  # noqa: E402 - bench/ is not a package

from disttrain.testing import run_distributed  # noqa: E402

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

TP = 2
STEPS = 5
CASES = [("gpt", False), ("gpt", True), ("llama", False)]
# Each step's loss is the mean of B*T fp32 cross-entropy terms, summed in a different
# order on each side (disttrain's vocabulary-parallel loss against loss_parallel's, and
# the matmuls' and collectives' partial sums), so the two differ by a few ulps of a loss
# near 4 (ulp 4.8e-7), which five AdamW steps carry through the weights: up to 5e-7 seen
# here, 5e-6 at the bench's sizes. 2e-5 leaves room for that and is far below what one
# wrong gradient does: with the sequence-parallel norms' partial gradients left
# unsummed the losses part by 1e-2 within these five steps.
LOSS_ATOL = 2e-5
MIN_DROP = 0.5  # the repeated batch's loss falls by ~0.9: the comparison is of training


def _train(kind: str, sequence_parallel: bool) -> dict[str, list[float]]:
    from torch.distributed.device_mesh import init_device_mesh

    cfg = tp_models.model_config(kind, d_model=64, n_layer=2, n_head=4, seq_len=16,
                                 vocab_size=64)
    batch = tp_models.batches(cfg, micro_batch=2, n=1)[0]
    mesh = init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))
    steps = {"disttrain": tp_models.disttrain_step(tp_models.build_model(cfg),
                                                   sequence_parallel=sequence_parallel),
             "dtensor": tp_models.dtensor_step(tp_models.build_model(cfg), mesh,
                                               sequence_parallel=sequence_parallel)}
    return {name: [float(step(*batch)) for _ in range(STEPS)]
            for name, step in steps.items()}


def _all_cases() -> dict[tuple[str, bool], dict[str, list[float]]]:
    return {case: _train(*case) for case in CASES}


@functools.cache
def _results() -> dict | Exception:
    try:
        return run_distributed(_all_cases, TP, timeout=240)[0]
    except Exception as exc:  # cached: one broken world is not rerun per case
        return exc


@pytest.mark.parametrize("kind, sequence_parallel", CASES)
def test_dtensor_baseline_trains_the_same_model(kind, sequence_parallel):
    results = _results()
    if isinstance(results, Exception):
        raise results
    losses = results[(kind, sequence_parallel)]
    ours, theirs = torch.tensor(losses["disttrain"]), torch.tensor(losses["dtensor"])
    torch.testing.assert_close(ours, theirs, atol=LOSS_ATOL, rtol=0.0)
    assert ours[0] - ours[-1] > MIN_DROP, losses


def test_the_llama_baseline_refuses_sequence_parallelism():
    cfg = tp_models.model_config("llama", d_model=64, n_layer=1, n_head=4, seq_len=16,
                                 vocab_size=64)
    with pytest.raises(ValueError, match="sequence parallelism"):
        tp_models.dtensor_step(tp_models.build_model(cfg), None,  # type: ignore[arg-type]
                               sequence_parallel=True)
