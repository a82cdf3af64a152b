"""``plan --trace``: the Chrome trace of one simulated step, and the per-chunk costs the
estimate records for it."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from disttrain.cli import main
from disttrain.errors import UserError
from disttrain.parallel.pipeline import analytic_bubble, build_schedule
from disttrain.plan import Options, PlannedLayout, estimate, parse_cluster, parse_model
from disttrain.plan.choose import parse_layout
from disttrain.plan.estimate import Estimate
from disttrain.plan.trace import build_trace, traced_micro_batches, write_trace

SMALL = "layers=8,hidden=256,heads=8,seq=128,vocab=1000"
NODE = "gpu=a100-80gb,gpus_per_node=8,nodes=1"


def _synthetic(pp: int, v: int, m: int, f: float, b: float, *, message: float = 0.0,
               dp_exposed: float = 0.5, optimizer: float = 0.25) -> Estimate:
    """An estimate of ``m`` micro-batches (mbs 1, dp 1) whose chunks all cost f and b."""
    return Estimate(layout=PlannedLayout(pp=pp, v=v), stages=[None] * pp, worst_stage=0,
                    step_time_s=1.0, chunk_forward_s=((f,) * v,) * pp,
                    chunk_backward_s=((b,) * v,) * pp, p2p_message_s=message,
                    times={"dp_comm_exposed": dp_exposed, "optimizer": optimizer})


def _actions(trace: dict, rank: int) -> list[dict]:
    return [e for e in trace["traceEvents"]
            if e["ph"] == "X" and e["pid"] == rank and e["cat"] in ("forward", "backward")]


def _span_us(trace: dict) -> float:
    events = [e for e in trace["traceEvents"]
              if e["ph"] == "X" and e["cat"] in ("forward", "backward")]
    return max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)


@pytest.mark.parametrize("name, pp, m, v", [("1f1b", 1, 3, 1), ("1f1b", 3, 5, 1),
                                            ("interleaved", 2, 4, 3)])
def test_every_action_appears_once_per_rank(name, pp, m, v):
    trace = json.loads(json.dumps(build_trace(_synthetic(pp, v, m, 1e-3, 2e-3), m)))
    schedule = build_schedule(name, pp=pp, m=m, v=v)
    named = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e["name"] == "process_name"}
    assert named == {r: f"pp rank {r} (tp 1 x cp 1 x dp 1 replicas alike)" for r in range(pp)}
    for rank, actions in enumerate(schedule.actions):
        got = Counter((e["args"]["kind"][0].upper(), e["args"]["chunk"],
                       e["args"]["micro_batch"]) for e in _actions(trace, rank))
        assert got == Counter((a.kind, a.chunk, a.micro) for a in actions)
        assert set(got.values()) == {1}
        assert {f"{k} c{c} mb{i}" for k, c, i in got} == \
            {e["name"] for e in _actions(trace, rank)}


def test_1f1b_span_is_m_plus_pp_minus_1_stage_times():
    pp, m, f, b = 4, 6, 1e-3, 2e-3
    trace = build_trace(_synthetic(pp, 1, m, f, b), m)
    assert _span_us(trace) == pytest.approx((m + pp - 1) * (f + b) * 1e6, abs=1e-2)
    for rank in range(pp):  # the dp reduction, then the optimizer, after the last backward
        last = max(e["ts"] + e["dur"] for e in _actions(trace, rank))
        dp, opt = (e for e in trace["traceEvents"]
                   if e["ph"] == "X" and e["pid"] == rank and e["tid"] == 1)
        assert (dp["cat"], dp["ts"], dp["dur"]) == ("dp", pytest.approx(last), 0.5e6)
        assert (opt["cat"], opt["ts"], opt["dur"]) == (
            "optimizer", pytest.approx(last + 0.5e6), 0.25e6)
    other = trace["otherData"]
    assert other["simulated_step_time_s"] == pytest.approx((m + pp - 1) * (f + b) + 0.75)
    assert "capped" not in other and other["traced_micro_batches"] == m


def test_interleaved_bubble_is_the_analytic_one():
    pp, v, m, f, b = 4, 2, 8, 1e-3, 2e-3
    trace = build_trace(_synthetic(pp, v, m, f / v, b / v), m)
    span = _span_us(trace)
    assert span == pytest.approx((v * m + pp - 1) * (f + b) / v * 1e6, abs=1e-2)
    for rank in range(pp):
        busy = sum(e["dur"] for e in _actions(trace, rank))
        assert 1 - busy / span == pytest.approx(analytic_bubble("interleaved", pp, m, v),
                                                abs=1e-6)


def test_messages_delay_the_next_stage():
    trace = build_trace(_synthetic(2, 1, 1, 1e-3, 2e-3, message=1e-4), 1)
    first = {(e["pid"], e["name"]): e["ts"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert first[(1, "F c1 mb0")] == pytest.approx(1100.0)
    assert first[(0, "B c0 mb0")] == pytest.approx(1100.0 + 1000 + 2000 + 100)


def test_each_chunk_runs_for_its_own_cost():
    shape, cluster = parse_model("layers=13,hidden=1024,heads=16,seq=1024,vocab=50000"), \
        parse_cluster("gpu=a100-40gb,gpus_per_node=4,nodes=3")
    est = estimate(shape, cluster, parse_layout("pp=3,dp=4,mbs=2", 12), 96)
    assert len(set(est.chunk_forward_s)) == 3  # 4, 5 and 4 layers, the head on the last
    trace = build_trace(est, 96)
    for rank in range(3):
        cost = {"forward": est.chunk_forward_s[rank][0],
                "backward": est.chunk_backward_s[rank][0]}
        for e in _actions(trace, rank):
            assert e["dur"] == pytest.approx(cost[e["cat"]] * 1e6, abs=2e-3)


def test_a_long_step_is_traced_over_its_first_micro_batches():
    assert traced_micro_batches(_synthetic(64, 1, 4096, 1, 2), 4096) == 128
    assert traced_micro_batches(_synthetic(4, 2, 64, 1, 2), 64, max_actions=100) == 4
    assert traced_micro_batches(_synthetic(8, 4, 64, 1, 2), 64, max_actions=100) == 8
    assert traced_micro_batches(_synthetic(4, 1, 6, 1, 2), 6, max_actions=8) == 4
    trace = build_trace(_synthetic(4, 1, 64, 1e-3, 2e-3), 64, max_actions=64)
    assert sum(len(_actions(trace, r)) for r in range(4)) == 64
    assert trace["otherData"]["traced_micro_batches"] == 8
    assert trace["otherData"]["capped"].startswith(
        "traced the first 8 of 64 micro-batches (64 of 512 forwards and backwards)")


# estimate: the recorded parts rebuild the step time, unchanged by recording them

CASES = [  # model, cluster, global batch, layout
    (SMALL, NODE, 16, "tp=2,pp=2,dp=2,mbs=2,v=2"),
    (SMALL, NODE, 16, "tp=2,pp=4,dp=1,v=2,recompute=full,sp=1"),
    ("layers=30,hidden=2048,heads=16,seq=2048,vocab=32000,gated=1,kv_heads=4",
     "gpu=h100-80gb,gpus_per_node=8,nodes=2", 64, "pp=4,dp=4,v=3,zero=1"),
    ("layers=13,hidden=1024,heads=16,seq=1024,vocab=50000",
     "gpu=a100-40gb,gpus_per_node=4,nodes=3", 96,
     "pp=3,dp=4,mbs=2,zero=3,recompute=selective"),
    ("layers=13,hidden=1024,heads=16,seq=1024,vocab=50000",
     "gpu=a100-40gb,gpus_per_node=4,nodes=3", 96, "tp=4,pp=1,dp=3,mbs=4,zero=2"),
]


@pytest.mark.parametrize("model, cluster_spec, batch, layout", CASES,
                         ids=[c[3] for c in CASES])
def test_recorded_parts_rebuild_the_step_time(model, cluster_spec, batch, layout):
    cluster = parse_cluster(cluster_spec)
    lay = parse_layout(layout, cluster.n_devices)
    est = estimate(parse_model(model), cluster, lay, batch, Options())
    # per micro-batch, a stage runs its chunks and sends 2 messages per chunk
    v, pp = lay.option("v"), lay.degree("pp")
    stage = [sum(f) + sum(b) + 2 * v * est.p2p_message_s
             for f, b in zip(est.chunk_forward_s, est.chunk_backward_s, strict=False)]
    assert [len(f) for f in est.chunk_forward_s] == [v] * pp
    m = lay.micro_batches(batch)
    pipeline = m * max(stage) + (pp - 1) * sum(stage) / pp / v
    after = est.reduction_exposed_s + est.step_sync_s + est.optimizer_s
    assert pipeline + after == pytest.approx(est.step_time_s, rel=1e-12)
    assert est.times["pp_p2p"] == pytest.approx(m * 2 * v * est.p2p_message_s)


def test_memory_only_estimates_cannot_be_traced():
    est = estimate(parse_model(SMALL), parse_cluster(NODE), PlannedLayout(pp=2, dp=4), 16,
                   memory_only=True)
    with pytest.raises(ValueError, match="memory_only"):
        build_trace(est, 16)


# the command

def test_plan_writes_the_trace(tmp_path, capsys):
    out = tmp_path / "step.json"
    assert main(["plan", "--model", SMALL, "--cluster", NODE, "--global-batch", "16",
                 "--layout", "tp=2,pp=2,dp=2,mbs=2,v=2", "--trace", str(out)]) == 0
    trace = json.loads(out.read_text())
    assert {e["pid"] for e in trace["traceEvents"]} == {0, 1}
    assert sum(len(_actions(trace, r)) for r in range(2)) == 2 * 2 * 2 * 4
    other = trace["otherData"]
    assert other["layout"] == "tp=2,pp=2,cp=1,dp=2,v=2,mbs=2,zero=0,recompute=none,sp=0"
    lay = parse_layout(CASES[0][3], 8)
    est = estimate(parse_model(SMALL), parse_cluster(NODE), lay, 16, Options())
    assert other["predicted_step_time_s"] == pytest.approx(est.step_time_s, rel=1e-12)
    assert f"wrote {out}" in capsys.readouterr().out


@pytest.mark.parametrize("where", ["missing/step.json", "."])
def test_an_unwritable_path_is_a_user_error(tmp_path, where):
    shape, cluster = parse_model(SMALL), parse_cluster(NODE)
    est = estimate(shape, cluster, PlannedLayout(pp=2, dp=4), 16)
    with pytest.raises(UserError, match="--trace .*cannot write") as err:
        write_trace(tmp_path / where, shape, cluster, est, 16, Options())
    assert "\n" not in str(err.value)
