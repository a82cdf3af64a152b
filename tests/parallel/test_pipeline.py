"""Pipeline parallelism: schedules as data, stage cutting, and the runner against the
single-process GPT (same micro-batches: same loss, gradients and AdamW steps)."""

from __future__ import annotations

import itertools

import pytest
import torch
from support import TINY_MODEL, SyntheticTokens

from disttrain.config.schema import ModelConfig
from disttrain.models import GPT, gpt_spec, token_loss
from disttrain.parallel.pipeline import (
    Action,
    Schedule,
    ScheduleDeadlock,
    StageCosts,
    analytic_bubble,
    balanced_cuts,
    bubble_fractions,
    build_chunks,
    build_schedule,
    check_nccl_order,
    check_posts,
    check_schedule,
    chunk_param_names,
    message_groups,
    plan_stages,
    simulate,
    validate_schedule,
)
from disttrain.parallel.pipeline.p2p import Message, destination, source
from disttrain.testing import run_distributed


def _all_schedules():
    for pp in (2, 3, 4):
        for m in (1, 2, 3, 4, 5, 8):
            yield build_schedule("gpipe", pp=pp, m=m)
            yield build_schedule("1f1b", pp=pp, m=m)
        for v, k in itertools.product((2, 3), (1, 2, 3)):
            yield build_schedule("interleaved", pp=pp, m=k * pp, v=v)


def test_schedules_run_everything_once_and_cannot_deadlock():
    for schedule in _all_schedules():
        check_schedule(schedule)
        simulate(schedule, message_time=0.3)  # raises ScheduleDeadlock if stuck


def test_simulated_bubble_is_the_analytic_one():
    for schedule in _all_schedules():
        for f, b in ((1.0, 2.0), (1.0, 1.0)):
            v = schedule.v
            timeline = simulate(schedule, forward_time=f / v, backward_time=b / v)
            want = analytic_bubble(schedule.name, schedule.pp, schedule.m, v)
            for got in bubble_fractions(timeline):
                assert got == pytest.approx(want, abs=1e-9), schedule


def _max_in_flight(actions) -> int:
    alive = peak = 0
    for a in actions:
        alive += 1 if a.kind == "F" else -1
        peak = max(peak, alive)
    return peak


def test_1f1b_holds_at_most_pp_minus_rank_micro_batches():
    for pp, m in itertools.product((2, 3, 4), (1, 3, 8)):
        onef1b, gpipe = (build_schedule(n, pp=pp, m=m) for n in ("1f1b", "gpipe"))
        for r in range(pp):
            assert _max_in_flight(onef1b.actions[r]) == min(pp - r, m)
            assert _max_in_flight(gpipe.actions[r]) == m
            assert [a.kind for a in onef1b.actions[r][: min(pp - r - 1, m)]] == \
                ["F"] * min(pp - r - 1, m)


def test_simulated_chunks_take_their_own_costs():
    schedule = build_schedule("interleaved", pp=2, m=2, v=2)
    same = simulate(schedule, forward_time=1.0, backward_time=2.0, message_time=0.5)
    assert simulate(schedule, forward_time=[1.0] * 4, backward_time=(2.0,) * 4,
                    message_time=0.5) == same
    timeline = simulate(schedule, forward_time=[1.0, 2.0, 3.0, 4.0],
                        backward_time=[5.0, 6.0, 7.0, 8.0])
    for t in (t for actions in timeline for t in actions):
        assert t.end - t.start == (1 + t.action.chunk + (4 if t.action.kind == "B" else 0))
    with pytest.raises(ValueError, match="forward_time has 3 costs but the schedule has 4"):
        simulate(schedule, forward_time=[1.0] * 3)


def test_simulator_reports_a_deadlock():
    f, b = (lambda c, i: Action("F", c, i)), (lambda c, i: Action("B", c, i))
    bad = Schedule(name="bad", pp=2, m=2, v=1, actions=(
        (f(0, 0), b(0, 0), f(0, 1), b(0, 1)),
        (f(1, 0), f(1, 1), b(1, 1), b(1, 0))))
    check_schedule(bad)  # complete and locally ordered, yet stuck
    with pytest.raises(ScheduleDeadlock, match="rank 0 at B0.0 waits for B1.0"):
        simulate(bad)
    with pytest.raises(ValueError, match="before its forward"):
        check_schedule(Schedule(name="x", pp=1, m=1, v=1, actions=((b(0, 0), f(0, 0)),)))


def test_every_schedule_posts_messages_nccl_can_complete():
    # per-pair streams in posting order, a send waiting for its receive (rendezvous)
    for schedule in itertools.chain(_all_schedules(), (
            build_schedule("1f1b", pp=8, m=16),
            build_schedule("interleaved", pp=8, m=16, v=4))):
        check_nccl_order(schedule)
        for r in range(schedule.pp):
            groups = message_groups(schedule, r)
            assert len(groups) == len(schedule.actions[r]) + 1
            sends = [m.action for g in groups for m in g if m.send]
            assert sends == [a for a in schedule.actions[r] if destination(schedule, a)]


def _send_then_receive(schedule: Schedule, rank: int) -> list[list[Message]]:
    """The obvious plan: send right after an action, receive right before the next."""
    actions, posts = schedule.actions[rank], []
    for k in range(len(actions) + 1):
        group = []
        if k and (dst := destination(schedule, actions[k - 1])):
            group.append(Message(True, *dst, actions[k - 1]))
        if k < len(actions) and (src := source(schedule, actions[k])):
            made = next(a for a in schedule.actions[src[0]]
                        if destination(schedule, a) == (rank, src[1]))
            group.append(Message(False, *src, made))
        posts.append(group)
    return posts


def test_nccl_check_catches_the_1f1b_hang_and_crossed_messages():
    # 1F1B's steady state: each side sends before it receives, both sends wait
    schedule = build_schedule("1f1b", pp=2, m=4)
    with pytest.raises(ScheduleDeadlock, match="rank 0 at B0.0 waits to send to pp "
                       "rank 1 the output of F0.1"):
        check_posts(schedule, [_send_then_receive(schedule, r) for r in range(2)])
    # the same plan is fine for GPipe (all sends one way, then all the other way)
    gpipe = build_schedule("gpipe", pp=2, m=4)
    check_posts(gpipe, [_send_then_receive(gpipe, r) for r in range(2)])
    # rank 1 receives micro-batches 0 and 1 in the wrong order
    posts = [list(map(list, message_groups(gpipe, r))) for r in range(2)]
    posts[1][0][0], posts[1][0][1] = posts[1][0][1], posts[1][0][0]
    with pytest.raises(ScheduleDeadlock, match="message 0 from pp rank 0 to 1 is tag 0 "
                       "but rank 1 receives tag 1"):
        check_posts(gpipe, posts)


@pytest.mark.parametrize("args, message", [
    (("zigzag", 2, 4, 1, 4), "unknown"),
    (("interleaved", 2, 4, 1, 4), "v >= 2"),
    (("interleaved", 2, 5, 2, 4), "use 4 or 6 micro-batches"),
    (("interleaved", 4, 2, 2, 8), "use 4 micro-batches"),
    (("interleaved", 2, 4, 2, 3), "n_layer=3"),
    (("1f1b", 2, 4, 2, 4), "set v=1"),
    (("gpipe", 4, 4, 1, 2), "n_layer=2"),
    (("gpipe", 2, 0, 1, 4), "micro-batches=0"),
])
def test_validate_schedule_names_the_fix(args, message):
    with pytest.raises(ValueError, match=message):
        validate_schedule(*args)


def test_valid_schedules_pass_validation():
    validate_schedule("gpipe", 4, 1, 1, 4)  # no minimum m for gpipe / 1f1b
    validate_schedule("1f1b", 3, 2, 1, 5)
    validate_schedule("interleaved", 2, 6, 3, 6)


def _cfg(n_layer: int) -> ModelConfig:
    return ModelConfig(**{**TINY_MODEL, "n_layer": n_layer})


def _spec(n_layer: int):
    return gpt_spec(_cfg(n_layer))


def test_explicit_cuts_and_their_errors():
    assert plan_stages(_spec(6), pp=2, v=1, cuts=[2]).bounds == (0, 2, 6)
    assert plan_stages(_spec(6), pp=2, v=2, cuts=[1, 3, 4]).chunks_of(1) == [1, 3]
    with pytest.raises(ValueError, match="only n_layer=2"):
        plan_stages(_spec(2), pp=2, v=2)
    with pytest.raises(ValueError, match="increase strictly"):
        plan_stages(_spec(6), pp=3, cuts=[4, 2])
    with pytest.raises(ValueError, match="increase strictly"):
        plan_stages(_spec(6), pp=2, cuts=[6])
    with pytest.raises(ValueError, match="need 2 cut points"):
        plan_stages(_spec(6), pp=3, cuts=[2])


def _brute_force_max_cost(costs: StageCosts, n: int) -> float:
    layers, best = len(costs.blocks), float("inf")
    for cuts in itertools.combinations(range(1, layers), n - 1):
        bounds = [0, *cuts, layers]
        worst = max(sum(costs.blocks[a:b]) + (costs.embedding if k == 0 else 0)
                    + (costs.head if k == n - 1 else 0)
                    for k, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)))
        best = min(best, worst)
    return best


def test_balanced_cuts_minimise_the_largest_chunk():
    g = torch.Generator().manual_seed(0)
    for _trial in range(30):
        layers = int(torch.randint(2, 9, (1,), generator=g))
        n = int(torch.randint(1, layers + 1, (1,), generator=g))
        costs = StageCosts(embedding=float(torch.rand(1, generator=g)) * 3,
                           blocks=tuple(torch.rand(layers, generator=g).tolist()),
                           head=float(torch.rand(1, generator=g)) * 3)
        cuts = balanced_cuts(costs, n)
        bounds = [0, *cuts, layers]
        got = max(sum(costs.blocks[a:b]) + (costs.embedding if k == 0 else 0)
                  + (costs.head if k == n - 1 else 0)
                  for k, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)))
        assert got == pytest.approx(_brute_force_max_cost(costs, n)), (costs, n, cuts)
    # a heavy head pushes blocks towards the first stage
    heavy = StageCosts(embedding=0.0, blocks=(1.0,) * 8, head=4.0)
    assert balanced_cuts(heavy, 2) == [6]


def test_chunks_compose_to_the_full_model_with_original_names():
    cfg = _cfg(4)
    torch.manual_seed(0)
    model = GPT(cfg)
    spec = gpt_spec(cfg)
    plan = plan_stages(spec, pp=2, v=2)
    chunks = sorted((ch for r in range(2) for ch in build_chunks(model, spec, plan, r)),
                    key=lambda ch: ch.index)
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    x = ids
    for ch in chunks:
        x = ch(x)
    torch.testing.assert_close(x, model(ids), atol=0, rtol=0)
    full = dict(model.named_parameters())
    seen = {}
    for ch in chunks:
        for name, full_name in chunk_param_names(ch).items():
            p = dict(ch.named_parameters())[name]
            if name in ch.tied_copies:  # the last stage's own copy, equal values
                assert p is not full[full_name] and torch.equal(p, full[full_name])
            else:
                assert p is full[full_name] and full_name not in seen
                seen[full_name] = ch.index
    assert set(seen) == set(full)
    assert chunks[-1].tied_copies == ("head.weight",) and chunks[0].tie_peer == 1


def test_activation_meter_counts_saved_tensors_until_backward():
    from disttrain.monitor.saved_activations import SavedActivationMeter

    layer = torch.nn.Linear(8, 8)
    meter = SavedActivationMeter(layer.parameters())
    x = torch.randn(4, 8, requires_grad=True)
    with meter:
        y = torch.nn.functional.gelu(layer(x))  # saves x (linear) and layer(x) (gelu)
        z = torch.nn.functional.gelu(layer(x))  # x again: one storage, counted once
    assert meter.live_bytes == meter.peak_bytes == 3 * 4 * 8 * 4
    y.sum().backward()
    assert meter.live_bytes == 2 * 4 * 8 * 4  # x and z's linear output, held by z
    z.sum().backward()
    assert meter.live_bytes == 0 and meter.peak_bytes == 3 * 4 * 8 * 4


# Multi-process parity: (schedule, v, n_layer, micro-batches, explicit cuts or None)
CASES = {
    2: [("gpipe", 1, 4, 4, None), ("1f1b", 1, 4, 4, [1]), ("1f1b", 1, 2, 3, None),
        ("gpipe", 1, 2, 1, None), ("interleaved", 2, 4, 4, None),
        ("interleaved", 2, 4, 2, None), ("zb1", 1, 4, 2, None), ("zb1", 1, 2, 4, None),
        ("zbv", 2, 4, 2, None), ("zbv", 2, 5, 4, None)],
    4: [("gpipe", 1, 4, 6, None), ("1f1b", 1, 4, 6, None), ("1f1b", 1, 5, 2, None),
        ("interleaved", 2, 8, 4, None), ("zb1", 1, 4, 4, None), ("zb1", 1, 5, 8, None),
        ("zbv", 2, 8, 4, None), ("zbv", 2, 8, 8, None)],
}
STEPS = 3


def _micro_batches(m: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = SyntheticTokens(n=2 * m, mask=True, seed=seed)
    samples = [data[i] for i in range(2 * m)]
    return [(torch.stack([s["input_ids"] for s in samples[2 * i: 2 * i + 2]]),
             torch.stack([s["targets"] for s in samples[2 * i: 2 * i + 2]]))
            for i in range(m)]


def _reference_step(model: GPT, batches: list, scale: float) -> float:
    loss_sum = 0.0
    for inputs, targets in batches:
        loss, _ = token_loss(model(inputs), targets)
        (loss * scale).backward()
        loss_sum += float(loss.detach())
    return loss_sum


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m: f"{what}: {m}")


class _PlainAdamW:
    """Textbook AdamW on a list of parameters. torch.optim's first use imports
    torch._dynamo, which costs ~15 s per process with 4 processes on 2 shared cores;
    the 4-rank test uses this instead (both sides of a comparison use the same one)."""

    def __init__(self, params, lr: float, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=1e-2) -> None:
        self.params, self.lr, self.betas, self.eps, self.wd = list(params), lr, betas, eps, \
            weight_decay
        self.state = [(torch.zeros_like(p), torch.zeros_like(p)) for p in self.params]
        self.t = 0

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        self.t += 1
        (b1, b2), lr = self.betas, self.lr
        for p, (m, v) in zip(self.params, self.state, strict=False):
            p.mul_(1 - lr * self.wd)
            m.lerp_(p.grad, 1 - b1)
            v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
            denom = (v / (1 - b2 ** self.t)).sqrt_().add_(self.eps)
            p.addcdiv_(m, denom, value=-lr / (1 - b1 ** self.t))


def _check_case(comm, name: str, v: int, n_layer: int, m: int, cuts) -> int:
    """Run STEPS AdamW steps through the pipeline and the full model; return this
    rank's peak activation bytes."""
    from disttrain.parallel.pipeline import run_pipeline, sync_tied_grads

    cfg, pp = _cfg(n_layer), comm.size
    torch.manual_seed(0)
    ref, model = GPT(cfg), GPT(cfg)
    model.load_state_dict(ref.state_dict())
    spec = gpt_spec(cfg)
    plan = plan_stages(spec, pp=pp, v=v, cuts=cuts, vshape=name == "zbv")
    chunks = build_chunks(model, spec, plan, comm.rank)
    names = {n: full for ch in chunks for n, full in chunk_param_names(ch).items()}
    params = {n: p for ch in chunks for n, p in ch.named_parameters()}
    schedule = build_schedule(name, pp=pp, m=m, v=v)
    adamw = torch.optim.AdamW if pp == 2 else _PlainAdamW
    opt, ref_opt = adamw(params.values(), lr=1e-2), adamw(ref.parameters(), lr=1e-2)
    full = dict(ref.named_parameters())
    peak = 0
    for step in range(STEPS):
        batches = _micro_batches(m, seed=step)
        count = sum(int((t != -1).sum()) for _, t in batches)
        ref_opt.zero_grad()
        ref_loss = _reference_step(ref, batches, 1 / count)
        opt.zero_grad()
        calls = []

        def grad_sync(chunk: int, last: bool, calls: list = calls):
            calls.append((chunk, last))
            return torch.enable_grad()
        result = run_pipeline(chunks, batches, token_loss, comm, schedule,
                              activation_shape=(2, cfg.seq_len, cfg.d_model),
                              loss_scale=1 / count, grad_sync=grad_sync,
                              measure_activations=True)
        sync_tied_grads(chunks, comm)
        peak = max(peak, result.peak_activation_bytes or 0)
        for ch in chunks:
            mine = [last for c, last in calls if c == ch.index]
            assert mine == [False] * (m - 1) + [True], (name, ch.index, mine)
        if any(ch.is_last for ch in chunks):
            assert result.count == count
            _close(result.loss_sum / count, torch.tensor(ref_loss / count), f"{name} loss")
        else:
            assert result.count == 0 and float(result.loss_sum) == 0.0
        for n, p in params.items():
            _close(p.grad, full[names[n]].grad, f"{name} step {step} grad {n}")
        opt.step()
        ref_opt.step()
    for n, p in params.items():
        _close(p.detach(), full[names[n]].detach(), f"{name} param {n} after {STEPS} steps")
    return peak


def _pipeline_parity(cases: list) -> dict:
    from disttrain.comm import CollectiveLedger, Communicator

    comm = Communicator(None, CollectiveLedger(), name="pp")
    peaks = {}
    for case in cases:
        peaks[case] = _check_case(comm, *case)
    ops = {r.op for r in comm.ledger.records}
    assert {"send", "recv"} <= ops, ops  # p2p goes through the ledger
    return peaks


@pytest.mark.parametrize("pp", [2, 4])
def test_pipeline_matches_the_single_process_model(pp):
    cases = [tuple(c[:4]) + (tuple(c[4]) if c[4] else None,) for c in CASES[pp]]
    peaks = run_distributed(_pipeline_parity, pp, args=(cases,), timeout=150)
    # activation memory: rank 0 holds all m micro-batches under GPipe, pp under 1F1B
    gpipe = [peaks[0][c] for c in cases if c[0] == "gpipe" and c[3] > pp]
    onef1b = [peaks[0][c] for c in cases if c[0] == "1f1b" and c[3] > pp]
    if gpipe and onef1b:
        assert max(onef1b) < min(gpipe), peaks[0]
