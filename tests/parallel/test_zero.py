"""ZeRO stages 1-3 against the single-process oracle."""

from __future__ import annotations

import pytest
from support import fit_tiny
from test_data_parallel import assert_states_close, reference_train

from disttrain.testing import run_distributed

VARIANTS = [{"grad_accum": 1, "grad_clip": 1.0}, {"grad_accum": 2, "grad_clip": 0.0}]


def _zero_runs(stage: int, run_dir: str) -> list[dict]:
    return [fit_tiny(20, f"{run_dir}/{i}", mask=True, zero=stage, **v)
            for i, v in enumerate(VARIANTS)]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_follows_single_process(stage, world_size, tmp_path):
    results = run_distributed(_zero_runs, world_size, args=(stage, str(tmp_path)),
                              timeout=240)
    for variant, state in zip(VARIANTS, results[0]):
        assert_states_close(state, reference_train(20, mask=True, **variant))
    for other in results[1:]:  # every rank ends with the same full parameters
        for mine, theirs in zip(results[0], other):
            assert_states_close(theirs, mine, atol=0)
