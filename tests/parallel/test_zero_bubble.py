"""Zero-bubble pipelines without processes: the backward of a chunk split into B (input
gradient) and W (weight gradients) against autograd's fused backward, and the zb1 /
zbv schedules as data (complete, deadlock-free under NCCL's matching, their bubble and
their activation memory)."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch
from support import TINY_MODEL

from disttrain.config.schema import ModelConfig
from disttrain.models import GPT, gpt_spec, token_loss
from disttrain.parallel.pipeline import (
    analytic_bubble,
    bubble_fractions,
    build_chunks,
    build_schedule,
    check_nccl_order,
    check_schedule,
    plan_stages,
    simulate,
    validate_schedule,
)
from disttrain.parallel.pipeline.split_backward import backward_input, backward_weight


def _split_equals_fused(chunk: torch.nn.Module, run, x: torch.Tensor | None,
                        grad: torch.Tensor | None) -> None:
    """B then W give bitwise the fused backward's input and weight gradients (the same
    autograd nodes on the same inputs), and no parameter gradient appears before W."""
    params = [p for p in chunk.parameters() if p.requires_grad]
    chunk.zero_grad(set_to_none=True)
    run().backward(grad)
    fused = [p.grad.clone() for p in params]
    fused_x = None if x is None else x.grad.clone()
    chunk.zero_grad(set_to_none=True)
    fired: list[int] = []
    hooks = [p.register_post_accumulate_grad_hook(lambda p: fired.append(id(p)))
             for p in params]
    dx, kept = backward_input(run(), grad, x, params)
    assert all(p.grad is None for p in params) and not fired
    backward_weight(kept)
    for h in hooks:
        h.remove()
    assert sorted(fired) == sorted(id(p) for p in params)  # each hook once, in W
    if x is not None:
        torch.testing.assert_close(dx, fused_x, rtol=0, atol=0)
    for p, want in zip(params, fused, strict=True):
        torch.testing.assert_close(p.grad, want, rtol=0, atol=0)


def test_split_backward_is_the_fused_one_for_every_gpt_chunk():
    cfg = ModelConfig(**{**TINY_MODEL, "n_layer": 3})
    torch.manual_seed(0)
    model, spec = GPT(cfg), gpt_spec(cfg)
    plan = plan_stages(spec, pp=3)
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    targets = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    for r in range(3):
        (chunk,) = build_chunks(model, spec, plan, r)
        x = None if chunk.is_first else torch.randn(2, cfg.seq_len, cfg.d_model,
                                                     requires_grad=True)
        grad = None if chunk.is_last else torch.randn(2, cfg.seq_len, cfg.d_model)

        def run(chunk=chunk, x=x):
            y = chunk(x, ids)
            return token_loss(y, targets)[0] if chunk.is_last else y
        _split_equals_fused(chunk, run, x, grad)


def test_split_backward_is_the_fused_one_for_transformers_llama_chunks():
    transformers = pytest.importorskip("transformers")
    from disttrain.models.hf import hf_spec

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=12,
        bos_token_id=0, eos_token_id=0))
    spec = hf_spec(model)
    plan = plan_stages(spec, pp=3)
    ids = torch.randint(1, 64, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, :3] = 0  # left padding: the mask reaches every chunk's attention

    class Inputs:
        args = ()
        kwargs = {"input_ids": ids, "attention_mask": mask}
    for r in range(3):
        (chunk,) = build_chunks(model, spec, plan, r)
        x = None if chunk.is_first else torch.randn(2, 12, 32, requires_grad=True)
        grad = torch.randn(2, 12, 64 if chunk.is_last else 32)

        def run(chunk=chunk, x=x):
            return chunk(x, Inputs())
        _split_equals_fused(chunk, run, x, grad)


def _zero_bubble_schedules():
    for pp, m in itertools.product((2, 3, 4, 6), (1, 2, 3, 4, 5, 8, 12)):
        yield build_schedule("zb1", pp=pp, m=m)
        yield build_schedule("zbv", pp=pp, m=m, v=2)


def test_zero_bubble_schedules_are_complete_and_nccl_can_run_them():
    for schedule in _zero_bubble_schedules():
        check_schedule(schedule)  # every F, B, W once; B after F, W after B
        simulate(schedule, message_time=0.3)  # raises if some rank waits forever
        check_nccl_order(schedule)  # per-pair posting order, rendezvous sends


def test_zbv_places_the_chunks_in_a_v():
    schedule = build_schedule("zbv", pp=4, m=4, v=2)
    assert [schedule.rank_of(c) for c in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert plan_stages(gpt_spec(ModelConfig(**{**TINY_MODEL, "n_layer": 8})), pp=4, v=2,
                       vshape=True).chunks_of(1) == [1, 6]


def _held(actions, until: str) -> int:
    """Most micro-batch chunks a rank holds: forwards not yet through ``until``."""
    alive = peak = 0
    for a in actions:
        alive += 1 if a.kind == "F" else -1 if a.kind == until else 0
        peak = max(peak, alive)
    return peak


def test_zb1_bubble_is_a_third_of_1f1bs_at_1f1bs_memory():
    for pp, m in itertools.product((2, 3, 4, 8), (4, 8, 16)):
        if m < pp:
            continue
        schedule = build_schedule("zb1", pp=pp, m=m)
        # F = B = W = 1: B + W is 1F1B's backward of 2
        bubbles = bubble_fractions(simulate(schedule, forward_time=1.0, backward_time=2.0))
        want = (pp - 1) / (3 * m + pp - 1)  # pp - 1 idle forward slots of 3m busy ones
        assert max(bubbles) == pytest.approx(want) == analytic_bubble("zb1", pp, m)
        onef1b = build_schedule("1f1b", pp=pp, m=m)
        # memory: no rank holds more than 1F1B's first rank; B never runs further ahead
        assert max(_held(a, "W") for a in schedule.actions) == \
            max(_held(a, "B") for a in onef1b.actions) == pp
        for r in range(pp):
            assert _held(schedule.actions[r], "B") <= pp - r


def test_zbv_bubble_is_under_a_quarter_of_1f1bs():
    for pp, m in ((2, 4), (4, 8), (4, 16), (8, 16)):
        schedule = build_schedule("zbv", pp=pp, m=m, v=2)
        # each of the two chunks costs half a stage: F = B = W = 1/2
        bubbles = bubble_fractions(simulate(schedule, forward_time=0.5, backward_time=1.0))
        assert max(bubbles) == pytest.approx(analytic_bubble("zbv", pp, m, 2))
        assert max(bubbles) <= 0.25 * analytic_bubble("1f1b", pp, m), (pp, m)
        # 2 pp chunk activations of half a stage each: 1F1B's peak of pp stages
        assert max(_held(a, "W") for a in schedule.actions) <= 2 * pp


@pytest.mark.parametrize("args, message", [
    (("zbv", 2, 4, 1, 4), "set v=2"),
    (("zbv", 1, 4, 2, 4), "pp >= 2"),
    (("zb1", 2, 4, 2, 4), "set v=1"),
    (("zbv", 4, 4, 2, 4), "n_layer=4"),
])
def test_zero_bubble_validation_names_the_fix(args, message):
    with pytest.raises(ValueError, match=message):
        validate_schedule(*args)


def test_zero_bubble_idle_stops_growing_so_the_planner_can_price_any_m():
    from disttrain.parallel.pipeline.schedules import zero_bubble_idle

    for name, pp in itertools.product(("zb1", "zbv"), (2, 3, 4, 8)):
        for m in range(2 * pp, 5 * pp + 1):
            idle = analytic_bubble(name, pp, m, 2 if name == "zbv" else 1)  # full build
            assert zero_bubble_idle(name, pp, m) == pytest.approx(idle / (1 - idle))


def test_the_planner_prices_the_zero_bubble_schedules_and_proposes_them():
    from disttrain.parallel.pipeline.pricing import PRICING, in_flight
    from disttrain.plan import PRESETS, ModelShape, Options, PlannedLayout, estimate, search

    # the bubble as priced: 1F1B's pp - 1 mean stage times; zb1's a third of that
    for zb, name in ((0, "1f1b"), (1, "zb1"), (2, "zbv")):
        lay = PlannedLayout(pp=4, dp=1, mbs=1, **({"zb": zb, "v": zb} if zb else {}))
        cut = PRICING.cut(lay)
        assert cut.schedule == name
        _, bubble = cut.step(8, [3.0] * 4, 0.0)
        want = {0: 3 * 3.0, 1: 3.0, 2: analytic_bubble("zbv", 4, 8, 2) / (
            1 - analytic_bubble("zbv", 4, 8, 2)) * 8 * 3.0}[zb]
        assert bubble == pytest.approx(want)
        assert PRICING.config_values(lay)["pp_schedule"] == name
    # what a zero-bubble stage holds: read off the schedule (until each W)
    for name, v in (("zb1", 1), ("zbv", 2)):
        for pp, m in ((2, 4), (4, 8)):
            schedule = build_schedule(name, pp=pp, m=m, v=v)
            for r in range(pp):
                assert in_flight(name, pp, m, v, r) == _held(schedule.actions[r], "W")
    # GPT-3 175B on 8 nodes needs a pipeline: the fastest layout runs a zero-bubble
    # schedule, priced below 1F1B on the same layout
    shape = ModelShape(name="175b", layers=96, hidden=12288, heads=96, seq=2048,
                       vocab=51200, dropout=False, flash=True)
    cluster = replace(PRESETS["a100-80gb"], nodes=8)
    best = search(shape, cluster, 512, Options(), top=3).rows[0].layout
    assert best.degree("pp") > 1 and best.option("zb") > 0, best.label()
    onef1b = PlannedLayout.of(best.degrees, tuple(
        0 if k == "zb" else 1 if k == "v" else value for k, value in _options(best)),
        best.mbs, best.zero, best.recompute)
    assert estimate(shape, cluster, onef1b, 512, Options()).step_time_s > \
        estimate(shape, cluster, best, 512, Options()).step_time_s


def _options(lay):
    from disttrain.plan.layout import OPTIONS

    return [(o.name, lay.option(o.name)) for o in OPTIONS]
