"""Zero-bubble pipelines without processes: the backward of a chunk split into B (input
gradient) and W (weight gradients) against autograd's fused backward, and the zb1 /
zbv schedules as data (complete, deadlock-free under NCCL's matching, their bubble and
their activation memory)."""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from support import TINY_MODEL

from disttrain.config.schema import ModelConfig
from disttrain.models import GPT, gpt_spec, token_loss
from disttrain.monitor.saved_activations import SavedActivationMeter
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
from disttrain.parallel.pipeline.schedules import Action, Schedule
from disttrain.parallel.pipeline.split_backward import (
    WeightPassSaves,
    backward_input,
    backward_weight,
)


def _split_equals_fused(chunk: torch.nn.Module, run, x: torch.Tensor | None,
                        grad: torch.Tensor | None) -> None:
    """B then W give bitwise the fused backward's input and weight gradients (the same
    autograd nodes on the same inputs), also when B released the saved tensors W does
    not read, and no parameter gradient appears before W."""
    params = [p for p in chunk.parameters() if p.requires_grad]
    chunk.zero_grad(set_to_none=True)
    run().backward(grad)
    fused = [p.grad.clone() for p in params]
    fused_x = None if x is None else x.grad.clone()
    for saves in (None, WeightPassSaves()):
        chunk.zero_grad(set_to_none=True)
        fired: list[int] = []
        hooks = [p.register_post_accumulate_grad_hook(
            lambda p, fired=fired: fired.append(id(p))) for p in params]
        with saves or contextlib.nullcontext():
            out = run()
        dx, kept = backward_input(out, grad, x, params, saves)
        assert all(p.grad is None for p in params) and not fired
        backward_weight(kept)
        for h in hooks:
            h.remove()
        assert sorted(fired) == sorted(id(p) for p in params)  # each hook once, in W
        if x is not None:
            torch.testing.assert_close(dx, fused_x, rtol=0, atol=0)
        for p, want in zip(params, fused, strict=True):
            torch.testing.assert_close(p.grad, want, rtol=0, atol=0)


def test_b_keeps_for_w_only_the_weights_inputs_and_output_gradients():
    # x [4, 3] -> LayerNorm(3) -> Linear(3, 5) -> GELU -> Linear(5, 7). W reads the
    # inputs of the two linear layers (the norm's output n, GELU's output h) and the
    # gradients of their outputs; the norm's scale and shift (vectors) get their
    # gradients in B, so its input x, mean and rstd go with GELU's input. In floats:
    # x 12, mean 4, rstd 4, n 12, GELU's input 20, h 20; recorded gradients 20 and 28
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.LayerNorm(3), torch.nn.Linear(3, 5),
                              torch.nn.GELU(), torch.nn.Linear(5, 7))
    x, grad = torch.randn(4, 3, requires_grad=True), torch.randn(4, 7)
    meter = SavedActivationMeter(mlp.parameters())
    saves = WeightPassSaves(meter)
    with saves:
        out = mlp(x)
    assert meter.live_bytes == 4 * (12 + 4 + 4 + 12 + 20 + 20)
    _, kept = backward_input(out, grad, x, list(mlp.parameters()), saves)
    del out
    assert meter.live_bytes == 4 * (12 + 20 + 20 + 28)  # n, h and the two gradients
    assert all(p.grad is None for p in mlp.parameters())
    backward_weight(kept)
    assert meter.live_bytes == 0
    want = torch.func.vjp(lambda w: torch.func.functional_call(mlp, w, (x,)),
                          dict(mlp.named_parameters()))[1](grad)[0]
    for name, p in mlp.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=0, atol=0)


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


def _torch_zbv(pp: int, m: int) -> Schedule:
    """torch's ``ScheduleZBVZeroBubble`` order (its per-rank list, computed without
    stages or groups) as a disttrain schedule: stage index = chunk, I = B."""
    from torch.distributed.pipelining.schedules import (
        ScheduleZBVZeroBubble,
        _ComputationType,
    )

    kinds = {_ComputationType.FORWARD: "F", _ComputationType.BACKWARD_INPUT: "B",
             _ComputationType.BACKWARD_WEIGHT: "W"}
    fake = SimpleNamespace(pp_group_size=pp, _n_microbatches=m, num_stages=2 * pp)
    actions = tuple(tuple(Action(kinds[a.computation_type], a.stage_index,
                                 a.microbatch_index)
                          for a in ScheduleZBVZeroBubble._calculate_single_rank_operations(
                              fake, r) if a is not None) for r in range(pp))
    return Schedule(name="zbv", pp=pp, m=m, v=2, actions=actions, split=True, vshape=True)


def _span(schedule: Schedule, message_time: float) -> float:
    timeline = simulate(schedule, forward_time=0.5, backward_time=1.0,
                        message_time=message_time)
    return max(t.end for rank in timeline for t in rank)


def test_zbv_reaches_the_bound_of_a_synchronised_step_and_hides_latency():
    for pp, m in ((2, 4), (4, 8)):
        schedule = build_schedule("zbv", pp=pp, m=m, v=2)
        # F = B = W = 1/2 (a chunk is half a stage). No order does better than: the last
        # rank starts after pp - 1 chunk forwards down the V, then has 2 chunks x m x 3
        # halves of work, and every rank has the same work, so span >= 3m + (pp-1)/2 and
        # the bubble >= (pp-1)/2 / span (0.059 at pp 4, m 8: 0.216x 1F1B's 0.273); the
        # papers' "zero" leaves out this ramp (no optimizer barrier between steps)
        bound = 3 * m + (pp - 1) / 2
        timeline = simulate(schedule, forward_time=0.5, backward_time=1.0)
        assert max(t.end for rank in timeline for t in rank) == pytest.approx(bound)
        assert max(bubble_fractions(timeline)) == pytest.approx((pp - 1) / 2 / bound)
        # against torch's ZBV order, an independent construction of the same paper: as
        # short with free messages, and no longer when a message costs 5% of a forward
        theirs = _torch_zbv(pp, m)
        check_schedule(theirs)
        assert _span(theirs, 0.0) == pytest.approx(bound)
        assert _span(schedule, 0.025) <= _span(theirs, 0.025) + 1e-9
        # the messages cost the step at most 6 of them per stage of depth (the greedy
        # order zbv ran before lost 10 at pp 2 and 11 at pp 4: no W between dependent Bs)
        assert _span(schedule, 0.025) - bound <= 6 * 0.025 * (pp - 1) + 1e-9


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


def test_the_planner_puts_the_head_where_the_v_puts_the_last_chunk():
    from disttrain.plan import PRESETS, ModelShape, Options, PlannedLayout, estimate

    # a tied 128k vocabulary: the embedding (and the head's tied copy, the final norm
    # and the head's activations) outweigh a stage's 4 layers
    shape = ModelShape(name="tied", layers=16, hidden=1024, heads=16, seq=1024,
                       vocab=128000, dropout=False, flash=True)

    def stages(**options):
        return estimate(shape, PRESETS["a100-80gb"], PlannedLayout(pp=4, dp=1, mbs=1,
                        **options), 8, Options(), all_stages=True).stages

    onef1b, zbv = stages(), stages(zb=2, v=2)
    assert onef1b[3].params > onef1b[1].params  # 1F1B: the head's tied copy at the end
    # the V: chunk 0 and chunk 7 on stage 0, with the final norm but one copy of the
    # tied weight (a second would add 35%); the last stage holds layers only, and the
    # head's once-per-step activations left it
    assert onef1b[0].params < zbv[0].params < 1.001 * onef1b[0].params
    assert zbv[3].params == zbv[1].params
    assert zbv[3].activations == zbv[1].activations < zbv[0].activations


def _options(lay):
    from disttrain.plan.layout import OPTIONS

    return [(o.name, lay.option(o.name)) for o in OPTIONS]


def test_the_planner_refuses_what_the_trainer_refuses_under_zero_bubble():
    """Recomputation under ZeRO-3 with a zero-bubble schedule (its W would recompute
    blocks whose weights ZeRO-3 freed after B) is a rule of the pipeline's pricing,
    the trainer's own (``check.split_backward_problem``): the planner never proposes
    a layout the trainer would refuse; ZeRO-2 with it, or 1F1B, stays."""
    from disttrain.dimensions import dimension
    from disttrain.parallel.dimensions import behaviour
    from disttrain.plan.layout import PlannedLayout

    pricing = behaviour(dimension("pp")).pricing
    for zb, zero, recompute, refused in ((1, 3, "full", True), (2, 3, "selective", True),
                                         (1, 2, "full", False), (0, 3, "full", False),
                                         (1, 3, "none", False)):
        planned = PlannedLayout(pp=2, dp=2, v=2 if zb == 2 else 1, zb=zb, zero=zero,
                                recompute=recompute)
        assert (pricing.batch_problem(planned, 4) is not None) == refused, (zb, zero,
                                                                             recompute)
