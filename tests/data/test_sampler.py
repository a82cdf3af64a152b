"""GlobalOrderSampler: the same global stream on every world size, resumable anywhere."""

from __future__ import annotations

import pickle

import pytest

from disttrain.data import GlobalOrderSampler, eval_indices

NUM_SAMPLES = 2000
GLOBAL_BATCH = 840  # a multiple of 1..8
SEED = 1234


def _global_stream(start: int, count: int, seed: int = SEED) -> list[int]:
    return GlobalOrderSampler(NUM_SAMPLES, seed).indices(start, count)


def _ranks_concat(sampler: GlobalOrderSampler, start: int, dp: int) -> list[int]:
    return [i for r in range(dp) for i in sampler.rank_slice(start, GLOBAL_BATCH, r, dp)]


def test_each_epoch_is_a_permutation() -> None:
    sampler = GlobalOrderSampler(NUM_SAMPLES, SEED)
    for epoch in range(3):
        assert sorted(sampler.indices(epoch * NUM_SAMPLES, NUM_SAMPLES)) == \
            list(range(NUM_SAMPLES))


@pytest.mark.parametrize("dp", range(1, 9))
def test_rank_slices_reassemble_the_global_order(dp: int) -> None:
    sampler = GlobalOrderSampler(NUM_SAMPLES, SEED)
    steps = -(-NUM_SAMPLES // GLOBAL_BATCH) + 1  # past the end of epoch 0
    seen: list[int] = []
    for step in range(steps):
        batch = _ranks_concat(sampler, step * GLOBAL_BATCH, dp)
        assert batch == _global_stream(step * GLOBAL_BATCH, GLOBAL_BATCH)
        seen += batch
    assert sorted(seen[:NUM_SAMPLES]) == list(range(NUM_SAMPLES))  # no loss, no repeat


def test_order_depends_on_seed_and_epoch_only() -> None:
    a, b = GlobalOrderSampler(NUM_SAMPLES, SEED), GlobalOrderSampler(NUM_SAMPLES, SEED)
    assert a.indices(0, NUM_SAMPLES) == b.indices(0, NUM_SAMPLES)
    assert a.indices(0, NUM_SAMPLES) != a.indices(NUM_SAMPLES, NUM_SAMPLES)
    assert a.indices(0, 50) != _global_stream(0, 50, seed=SEED + 1)
    # Cache state (which epoch was computed last) does not change the answer.
    a.indices(5 * NUM_SAMPLES, 1)
    assert a.indices(10, 100) == b.indices(10, 100)


def test_crossing_an_epoch_boundary() -> None:
    sampler = GlobalOrderSampler(NUM_SAMPLES, SEED)
    start = NUM_SAMPLES - 30
    crossing = sampler.indices(start, 100)
    assert crossing[:30] == sampler.permutation(0)[-30:].tolist()
    assert crossing[30:] == sampler.permutation(1)[:70].tolist()
    assert sampler.epoch_of(start) == 0 and sampler.epoch_of(start + 30) == 1


def test_resume_with_another_world_size_continues_the_stream() -> None:
    reference = _global_stream(0, 6 * GLOBAL_BATCH)
    got: list[int] = []
    first = GlobalOrderSampler(NUM_SAMPLES, SEED)
    for step in range(3):
        got += _ranks_concat(first, step * GLOBAL_BATCH, dp=4)
    resumed = pickle.loads(pickle.dumps(GlobalOrderSampler(NUM_SAMPLES, SEED)))
    for step in range(3, 6):
        got += _ranks_concat(resumed, step * GLOBAL_BATCH, dp=3)
    assert got == reference


@pytest.mark.parametrize("dp,grad_accum", [(1, 1), (2, 4), (4, 3), (8, 5)])
def test_micro_batches_split_the_rank_slice(dp: int, grad_accum: int) -> None:
    sampler = GlobalOrderSampler(NUM_SAMPLES, SEED)
    start = GLOBAL_BATCH * 2
    for rank in range(dp):
        micro = sampler.micro_batches(start, GLOBAL_BATCH, rank, dp, grad_accum)
        assert len(micro) == grad_accum
        assert {len(m) for m in micro} == {GLOBAL_BATCH // dp // grad_accum}
        assert [i for m in micro for i in m] == sampler.rank_slice(start, GLOBAL_BATCH, rank, dp)


def test_indivisible_batches_raise() -> None:
    sampler = GlobalOrderSampler(NUM_SAMPLES, SEED)
    with pytest.raises(ValueError, match="not divisible"):
        sampler.rank_slice(0, 10, 0, 3)
    with pytest.raises(ValueError, match="grad_accum=4"):
        sampler.micro_batches(0, 12, 0, 2, 4)
    with pytest.raises(ValueError):
        sampler.rank_slice(0, 12, 3, 3)
    with pytest.raises(ValueError):
        sampler.indices(-1, 3)


@pytest.mark.parametrize("num_samples,limit", [(100, 37), (20, 50), (64, 64)])
@pytest.mark.parametrize("dp", [1, 3, 8])
def test_eval_indices_cover_the_first_limit(num_samples: int, limit: int, dp: int) -> None:
    parts = [eval_indices(num_samples, limit, r, dp) for r in range(dp)]
    union = sorted(i for p in parts for i in p)
    assert union == list(range(min(limit, num_samples)))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
