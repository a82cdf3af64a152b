"""A steady-state step reads nothing on the host (issue 38): with the plain pass (data
parallelism), ZeRO-3, a pipeline and tensor parallelism, no tensor is read on the host
from the second step on, so on a GPU the host queues step after step without waiting for
the device (the GPU set checks the same with ``torch.cuda.set_sync_debug_mode``)."""

from __future__ import annotations

import pytest
import torch
from host_reads import HostReads, watch_steps
from support import fit_tiny

from disttrain.testing import run_distributed

pytestmark = pytest.mark.slow

LAYOUTS = {
    "dp2": {},
    "dp2-zero3": {"zero": 3},
    "pp2-1f1b": {"pp": 2, "pp_schedule": "1f1b", "grad_accum": 2},
    "tp2": {"tp": 2},
}


def _reads_per_layout(run_dir: str) -> dict[str, list[str]]:
    # the suite checks NCCL's message order with a header each receiver reads back;
    # a real NCCL run has no such header
    import os
    os.environ["DISTTRAIN_NCCL_RULES"] = "0"
    reads = {}
    for name, keys in LAYOUTS.items():
        recorder = HostReads()
        with watch_steps(recorder):
            fit_tiny(4, f"{run_dir}/{name}", **keys)
        reads[name] = sorted(set(recorder.reads))
    return reads


def test_steady_state_steps_read_nothing_on_the_host(tmp_path):
    for rank, reads in enumerate(run_distributed(_reads_per_layout, 2,
                                                 args=(str(tmp_path),), timeout=240)):
        assert reads == dict.fromkeys(LAYOUTS, []), f"rank {rank}: {reads}"


def test_the_recorder_sees_a_read_in_a_step():
    """What the test above relies on: a read inside a step is caught and placed."""
    recorder = HostReads()
    with recorder:
        recorder.recording = True
        total = torch.ones(3).sum()
        if total > 0:  # bool(): the host waits for the value
            float(total)
        with recorder.paused():
            total.item()
    assert [r.split(" at ")[0] for r in recorder.reads] == ["__bool__", "__float__"]
