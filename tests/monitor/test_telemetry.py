"""Metrics from every rank, stragglers, dynamic load balancing, and the timeline."""

from __future__ import annotations

import json

import pytest
import torch
from support import fit_tiny, tiny_config

from disttrain.faults import SLOW_ENV
from disttrain.parallel.balance import split_by_rate, split_evenly
from disttrain.testing import run_distributed


def _records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_records_carry_per_rank_figures_time_split_and_mfu(tmp_path):
    run_distributed(fit_tiny, 2, args=(4, str(tmp_path)), kwargs={"log_every": 2},
                    timeout=120)
    last = _records(tmp_path)[-1]
    assert [r["rank"] for r in last["ranks"]] == [0, 1]
    for key in ("time_compute_s", "time_comm_s", "time_data_s", "time_optim_s"):
        assert last[key] >= 0
    assert last["time_compute_s"] > 0 and last["mem_peak_mb"] > 0
    assert 0 < last["mfu"] <= 1.5  # peak is measured on a loaded machine: a loose bound
    assert last["peak_source"] == "measured:cpu"  # no GPU table applies on a CPU
    assert last["tokens_per_s"] > 0 and last["stragglers"] == []


def test_a_slowed_rank_is_named_a_straggler(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv(SLOW_ENV, "1:6")
    run_distributed(fit_tiny, 2, args=(8, str(tmp_path)), timeout=120,
                    kwargs={"log_every": 1})
    records = _records(tmp_path)
    # Flagged after 3 slow intervals in a row (the default window). A busy CI machine can
    # stall rank 0 for one interval and reset the streak, so the test asks for rank 1 to
    # be flagged in most intervals once the window has filled, not in a chosen one.
    flagged = [1 in r["stragglers"] for r in records[2:]]
    assert sum(flagged) > len(flagged) / 2, [r["stragglers"] for r in records]
    assert all(0 not in r["stragglers"] for r in records)
    assert "straggler: rank 1 is" in capfd.readouterr().err


def test_split_by_rate_is_proportional_exact_and_keeps_everyone():
    assert split_by_rate(32, [2.0, 1.0]) == [21, 11]
    assert sum(split_by_rate(97, [5.0, 1.0, 3.0, 0.01])) == 97
    assert min(split_by_rate(8, [100.0, 0.001])) == 1
    assert split_evenly(10, 4) == [3, 3, 2, 2]


def test_dynamic_balance_keeps_the_static_trajectory(tmp_path, monkeypatch):
    static = run_distributed(fit_tiny, 2, args=(10, str(tmp_path / "static")),
                             kwargs={"log_every": 1}, timeout=120)[0]
    monkeypatch.setenv(SLOW_ENV, "1:3")  # rank 1 three times slower: clear under load
    dynamic = run_distributed(fit_tiny, 2, args=(10, str(tmp_path / "dynamic")),
                              kwargs={"log_every": 1, "balance": "dynamic"},
                              timeout=120)[0]
    shares = [r["shares"] for r in _records(tmp_path / "dynamic")]
    assert shares[0] == [4, 4]
    assert any(s[0] > s[1] for s in shares[-3:])  # the fast rank got more samples
    for name in static:
        torch.testing.assert_close(dynamic[name], static[name], rtol=0, atol=1e-5)


def test_trace_holds_spans_from_every_rank(tmp_path):
    run_distributed(fit_tiny, 2, args=(3, str(tmp_path)), kwargs={"trace": True},
                    timeout=120)
    trace = json.loads((tmp_path / "trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    for pid in (0, 1):
        names = {e["name"] for e in spans if e["pid"] == pid}
        assert {"forward", "backward", "optimizer", "step"} <= names
        assert any(n.startswith("all_reduce bucket") for n in names)
    assert all(e["dur"] >= 0 and isinstance(e["ts"], float) for e in spans)
    assert not list(tmp_path.glob("trace-rank*.json"))  # merged


@pytest.mark.parametrize("balance", ["static", "dynamic"])
def test_throughput_counts_the_wait_for_a_slow_rank(tmp_path, monkeypatch, balance):
    """With rank 1 twice as slow, rank 0 waits for it at each step boundary, outside its
    own step: the summary's tokens/s is over the steps' wall time, so it stays within
    10% of the tokens trained over the loop's wall time (two evaluations of 2 samples
    are all the loop adds). Over rank 0's own step time it read about 2x too high."""
    monkeypatch.setenv(SLOW_ENV, "1:2")
    run_distributed(fit_tiny, 2, args=(24, str(tmp_path)), timeout=180,
                    kwargs={"balance": balance, "eval_samples": 2, "log_every": 4})
    summary = json.loads((tmp_path / "summary.json").read_text())
    seq_len = tiny_config().model.seq_len
    by_the_clock = summary["samples_seen"] * seq_len / summary["wall_time_s"]
    assert abs(summary["tokens_per_s"] / by_the_clock - 1) <= 0.10, summary
    records = _records(tmp_path)
    assert summary["busy_time_s"] < summary["train_time_s"] <= summary["wall_time_s"]
    assert all(r["tokens_per_s"] == pytest.approx(
        4 * summary["global_batch"] * seq_len / (4 * r["step_time_s"]), rel=1e-6)
        for r in records)
