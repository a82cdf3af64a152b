"""How the planner prices context parallelism: the ring's messages by hand, the
attention work and the activations divided by the token split, the split's figure in
the step, and the search proposing cp where a sequence fits no other way."""

from __future__ import annotations

from dataclasses import replace

import pytest

from disttrain.parallel.context.pricing import PRICING
from disttrain.plan import PRESETS, ModelShape, Options, PlannedLayout, estimate, search
from disttrain.plan.costs import attention_time
from disttrain.plan.steptime import TOKEN_COMM
from disttrain.plan.work import layer_work
from disttrain.shape import token_part

A100 = PRESETS["a100-80gb"]
LONG = ModelShape(name="long", layers=8, hidden=2048, heads=16, seq=131072, vocab=32000,
                  ffn=5632, gated=True, bias=False, tied=False, norm="rmsnorm")


def _gb(nbytes: float) -> float:
    """A link of 1 GB/s with no latency: a message's seconds are its gigabytes."""
    return nbytes / 1e9


@pytest.mark.parametrize("n", [2, 4, 8])
def test_the_rings_messages_counted_by_hand(n):
    """N - 1 key/value blocks forward, N - 1 again backward beside N fp32 gradient
    blocks (the last one exposed); a block's attention hides as much of its messages."""
    values, bf16 = 1e9, 2  # 2 GB of keys and values per block, 4 GB of gradients
    lay = PlannedLayout(cp=n)
    bare = PRICING.communication(lay, values, bf16, 0.0, 0.0, _gb)
    assert bare.forward == pytest.approx((n - 1) * 2.0)
    assert bare.backward == pytest.approx((n - 1) * (2.0 + 4.0) + 4.0)
    # each step's attention (a / N) longer than its messages: only the last gradient
    hidden = PRICING.communication(lay, values, bf16, 10.0 * n, 10.0 * n, _gb)
    assert (hidden.forward, hidden.backward) == (0.0, pytest.approx(4.0))
    # half hidden: 1 s of attention per step against 2 s forward, 6 s backward
    half = PRICING.communication(lay, values, bf16, 1.0 * n, 1.0 * n, _gb)
    assert half.forward == pytest.approx((n - 1) * 1.0)
    assert half.backward == pytest.approx((n - 1) * 5.0 + 4.0)
    # recomputation runs the forward's ring again in backward
    again = PRICING.communication(PlannedLayout(cp=n, recompute="full"), values, bf16,
                                  0.0, 0.0, _gb)
    assert again.backward == pytest.approx(bare.backward + bare.forward)
    assert PRICING.buffer_bytes(lay, values, bf16) == values * (2 + 2 * 4)
    one = PRICING.communication(PlannedLayout(), values, bf16, 0.0, 0.0, _gb)
    assert (one.forward, one.backward) == (0.0, 0.0)


@pytest.mark.parametrize("n", [2, 4])
def test_a_ranks_attention_is_one_nth_of_the_sequences(n):
    """The balanced split: one rank's attention over its T / N queries against every
    key is 1/N of the whole sequence's (a kernel that skips no masked block: 4 b T^2 w
    FLOPs), by hand."""
    cluster = replace(A100, attention_block=0, attention_seq_half=0.0)
    whole = attention_time(cluster, 2, LONG.seq, LONG.hidden, "bf16")
    flops = 4 * 2 * LONG.seq ** 2 * LONG.hidden
    assert whole == pytest.approx(flops / (cluster.peak_flops("bf16")
                                           * cluster.attention_efficiency))
    _, _, attn = layer_work(token_part(LONG, n), cluster, 1, 2, "bf16", token_split=n)
    assert attn.attention == pytest.approx(whole / n, rel=1e-12)


def test_activations_divide_by_the_token_split_and_the_ring_has_a_figure():
    cluster = replace(A100, nodes=2)
    # the loss on the full logits: the fused loss's weight gradient [V, d] and its chunk
    # of at most 256 MiB of logits do not shrink with a rank's tokens
    full_logits = Options(fused_loss=False)
    base = estimate(LONG, cluster, PlannedLayout(dp=16, mbs=1), 16, full_logits)
    split = estimate(LONG, cluster, PlannedLayout(cp=4, dp=4, mbs=1), 16, full_logits)
    act = [e.stage_memory(e.worst_stage).activations for e in (base, split)]
    # every activation is of T / 4 positions; autocast's cast weights stay whole
    assert 0.25 <= act[1] / act[0] < 0.26
    assert base.times[TOKEN_COMM] == 0.0 and split.times[TOKEN_COMM] > 0.0
    assert sum(split.times.values()) == pytest.approx(split.step_time_s, rel=1e-9)
    assert split.model_flops == base.model_flops  # the same tokens and model
    comm = [e.stage_memory(e.worst_stage).communication for e in (base, split)]
    assert comm[1] > comm[0]  # the ring's buffers


def test_a_sequence_no_other_layout_fits_is_planned_with_cp():
    """262144 tokens of a 0.5B multi-query model (one key/value head: tp cannot split
    its attention) on 4 x A100-40GB: no layout without cp fits (pipeline stages, ZeRO
    and recomputation leave each rank the whole sequence's activations of a layer),
    and the fastest that fits splits the sequence; at 4096 tokens it does not."""
    cluster = replace(PRESETS["a100-40gb"], gpus_per_node=4)
    mqa = replace(LONG, seq=262144, kv_heads=1)
    result = search(mqa, cluster, 8, top=0)
    assert result.rows, result.rejections()
    assert all(row.layout.degree("cp") > 1 for row in result.rows)
    assert result.rejected["does not fit in memory"] > 0
    short = search(replace(mqa, seq=4096), cluster, 8, top=1)
    assert short.rows[0].layout.degree("cp") == 1
