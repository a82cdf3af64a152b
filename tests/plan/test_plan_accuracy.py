"""The planner's memory model against real runs, rank by rank (the planner's acceptance
criterion), and ``disttrain plan --validate`` on those runs.

The tiny GPT (4 blocks, 4 heads, fp32, Gloo on CPU) trains 3 steps in every layout of
one world size inside one spawned world (a new mesh per run): at 2 ranks dp, ZeRO-1/2/3,
tp and 1F1B pp; at 4 ranks the same at 4 plus tp x pp, dp x tp and a few more that
exercise other parts of the model (the interleaved and GPipe schedules, ZeRO-3 under a
pipeline, sequence parallelism). For every rank the planner's prediction for its
pipeline stage (``Options(precision="fp32", accounting="disttrain")``, a
``PlannedLayout`` mirroring the run's) must match what the run's summary reports:

- model states (parameters + gradients + AdamW state) within 3%, the criterion. The
  count is exact for these layouts (a mismatch means a parameter placed where
  disttrain does not place it: a replicated bias counted as split, a tied head copy
  missed); 3% leaves room only for ZeRO's padding of each flat buffer to a multiple
  of dp, which the planner spreads over the whole model.
- activations within 10%. The planner counts what autograd saves, tensor by tensor,
  and matches these runs to a few bytes; at this size the small tensors (token ids,
  norm statistics, loss masks) are a few percent of the total, so a forgotten one
  shows, while 10% leaves room for what it does not model: under sequence parallelism
  with a micro-batch of one sample, the split of the embedding's output is a view that
  keeps the whole [1, T, d] tensor alive (1 to 3% more at this size; the runs here use
  micro-batches of 2, which the split copies).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from support import TINY_MODEL, SyntheticTokens

from disttrain.cli import main
from disttrain.config import load_config
from disttrain.parallel.pipeline.pricing import in_flight, peak_held_bytes
from disttrain.parallel.pipeline.schedules import FORWARD, build_schedule
from disttrain.plan import PRESETS, Options, PlannedLayout, estimate, gpt_shape
from disttrain.testing import run_distributed

pytestmark = pytest.mark.slow  # spawns worlds or trains: not in the quick check

MODEL = {**TINY_MODEL, "n_layer": 4, "n_head": 4}
STATES_TOLERANCE = 0.03
ACTIVATIONS_TOLERANCE = 0.10
SP = {"sequence_parallel": True}
# name -> parallel section; micro_batch 2 of global batch 8: dp=1 runs 4 micro-batches
LAYOUTS = {
    2: {"dp2": {"dp": 2}, "dp2-zero1": {"dp": 2, "zero": 1},
        "dp2-zero2": {"dp": 2, "zero": 2}, "dp2-zero3": {"dp": 2, "zero": 3},
        "tp2": {"tp": 2}, "pp2": {"pp": 2}},
    4: {"dp4": {"dp": 4}, "dp4-zero1": {"dp": 4, "zero": 1},
        "dp4-zero2": {"dp": 4, "zero": 2}, "dp4-zero3": {"dp": 4, "zero": 3},
        "tp4": {"tp": 4}, "pp4": {"pp": 4}, "tp2-pp2": {"tp": 2, "pp": 2},
        "dp2-tp2": {"dp": 2, "tp": 2},
        "tp2-pp2-interleaved": {"tp": 2, "pp": 2, "pp_schedule": "interleaved"},
        "dp2-pp2-zero3-gpipe": {"dp": 2, "pp": 2, "zero": 3, "pp_schedule": "gpipe"},
        "dp2-tp2-sp": {"dp": 2, "tp": 2, **SP}},
}
WORLD = {name: world for world, layouts in LAYOUTS.items() for name in layouts}


def _config(parallel: dict):
    train = {"steps": 3, "global_batch": 8, "micro_batch": 2, "grad_accum": None,
             "warmup_steps": 1, "log_every": 1}
    return load_config(values={"model": MODEL, "train": train, "parallel": parallel,
                               "checkpoint": {"every": 0}, "monitor": {"peak_tflops": 1.0}})


def _train_layouts(root: str, layouts: dict[str, dict]) -> None:
    """Every layout in this one set of processes, each into its own run directory."""
    from disttrain import Trainer
    from disttrain.data import collate_token_batch
    from disttrain.models import GPT, token_loss

    for name, parallel in layouts.items():
        cfg = _config(parallel)
        torch.manual_seed(0)
        Trainer(GPT(cfg.model), SyntheticTokens(n=32), token_loss, cfg,
                run_dir=f"{root}/{name}", collate_fn=collate_token_batch,
                progress=False).fit()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    for world, layouts in LAYOUTS.items():
        run_distributed(_train_layouts, world, args=(str(root), layouts), timeout=300)
    return root


def _layout(parallel: dict, world: int) -> PlannedLayout:
    tp, pp = parallel.get("tp", 1), parallel.get("pp", 1)
    schedule = parallel.get("pp_schedule", "1f1b")
    return PlannedLayout(tp=tp, pp=pp, dp=world // (tp * pp), mbs=2,
                         zero=parallel.get("zero", 0),
                         v=2 if schedule == "interleaved" else 1, gpipe=schedule == "gpipe",
                         sp=parallel.get("sequence_parallel", False))


def _summary(runs: Path, name: str) -> dict:
    return json.loads((runs / name / "summary.json").read_text())


@pytest.mark.parametrize("name", list(WORLD))
def test_every_rank_matches_the_prediction_for_its_stage(runs, name):
    world, parallel = WORLD[name], LAYOUTS[WORLD[name]][name]
    lay = _layout(parallel, world)
    est = estimate(gpt_shape(_config(parallel).model), PRESETS["a100-80gb"], lay, 8,
                   Options(precision="fp32", accounting="disttrain"), all_stages=True)
    measured = _summary(runs, name)["memory_bytes_per_rank"]
    assert len(measured) == world
    for rank, got in enumerate(measured):
        stage = est.stages[rank // (lay.degree("dp") * lay.degree("tp"))]  # ranks: pp, dp, tp
        states = got["params"] + got["grads"] + got["optimizer"]
        assert stage.model_states == pytest.approx(states, rel=STATES_TOLERANCE), \
            f"{name} rank {rank}: model states"
        # the run's meter counts saved tensors: not the fused loss's chunk (transient)
        assert stage.activations - stage.transient == pytest.approx(
            got["activations"], rel=ACTIVATIONS_TOLERANCE), \
            f"{name} rank {rank}: activations"


def test_summary_reports_every_rank_and_the_device(runs):
    summary = _summary(runs, "tp2-pp2")
    per_rank = summary["memory_bytes_per_rank"]
    assert per_rank[0] == summary["memory_bytes"]
    assert per_rank[0] != per_rank[2]  # the stages hold different layers and ends
    assert summary["device_name"] == "cpu"


@pytest.mark.parametrize("schedule, v", [("1f1b", 1), ("gpipe", 1), ("interleaved", 2),
                                         ("interleaved", 3)])
@pytest.mark.parametrize("pp, m", [(2, 4), (3, 6), (4, 4), (4, 12)])
def test_peak_held_bytes_follows_the_schedule(schedule, v, pp, m):
    """The closed form against walking each rank's actions, with chunks of unequal
    bytes (so the peak is not simply where the most chunks are held)."""
    sched = build_schedule(schedule, pp=pp, m=m, v=v)
    for stage in range(pp):
        sizes = tuple(float(1 + (3 * local + stage) % 5) for local in range(v))
        held, peak, count, most = 0.0, 0.0, 0, 0
        for action in sched.actions[stage]:
            step = 1 if action.kind == FORWARD else -1
            held += step * sizes[action.chunk // pp]
            count += step
            peak, most = max(peak, held), max(most, count)
        assert peak_held_bytes(schedule, pp, m, v, stage, sizes) == peak
        assert in_flight(schedule, pp, m, v, stage) == most


# plan --validate -------------------------------------------------------------------

def _cluster_file(tmp_path: Path) -> str:
    """A made-up machine: --validate needs one for a CPU run (calibrate writes them)."""
    data = {**PRESETS["a100-80gb"].to_json(), "name": "test-cpu", "source": "test",
            "peak_tflops": {"fp32": 0.05}, "gpus_per_node": 4}
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(data))
    return str(path)


def _validate(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["plan", "--validate", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_validate_compares_every_rank_and_the_step_time(runs, tmp_path, capsys):
    code, out, _ = _validate(capsys, str(runs / "tp2-pp2"), "--cluster",
                             _cluster_file(tmp_path), "--json")
    assert code == 0
    report = json.loads(out)
    assert report["layout"] == {"tp": 2, "pp": 2, "cp": 1, "dp": 1, "v": 1, "mbs": 2,
                                "zero": 0, "recompute": "none", "sp": 0,
                                "schedule": "1f1b"}
    assert [r["stage"] for r in report["ranks"]] == [0, 0, 1, 1]
    assert report["model_states_rel_error_max"] <= STATES_TOLERANCE
    assert report["activations_rel_error_max"] <= ACTIVATIONS_TOLERANCE
    t = report["step_time_s"]
    assert t["steps"] == 2 and t["warmup_records_skipped"] == 1  # 3 steps logged
    assert t["predicted"] > 0 and t["measured"] > 0
    assert t["rel_error"] == pytest.approx(t["predicted"] / t["measured"] - 1)
    code, out, _ = _validate(capsys, str(runs / "tp2-pp2"), "--cluster",
                             _cluster_file(tmp_path))
    # head, columns, ranks, time, the note on the fused loss's chunk left out
    assert code == 0 and len(out.splitlines()) == 2 + 4 + 1 + 1
    assert "fused loss" in out.splitlines()[-1]


def test_validate_takes_the_preset_of_a_recorded_gpu(runs, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(runs / "dp2-zero1", run)
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps(
        {**summary, "device_name": "NVIDIA A100-SXM4-80GB"}))
    code, out, _ = _validate(capsys, str(run), "--json")
    assert code == 0 and json.loads(out)["cluster"] == "a100-80gb"


def test_validate_errors_are_one_line(runs, tmp_path, capsys):
    code, _, err = _validate(capsys, str(tmp_path / "missing"))
    assert code == 2 and "not a directory" in err and len(err.splitlines()) == 1
    code, _, err = _validate(capsys, str(runs / "dp2"))  # a CPU run, no --cluster
    assert code == 2 and "calibrate" in err and len(err.splitlines()) == 1
    run = tmp_path / "unfinished"
    shutil.copytree(runs / "dp2", run)
    (run / "summary.json").unlink()
    code, _, err = _validate(capsys, str(run), "--cluster", _cluster_file(tmp_path))
    assert code == 2 and "summary.json" in err and len(err.splitlines()) == 1
