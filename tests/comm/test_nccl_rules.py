"""The Communicator's device discipline and NCCL's rules, enforced on Gloo.

Every op refuses a tensor off the group's device (a meta tensor here) or a
non-contiguous one, naming the op and the caller's line. Under NCCL's rules (on for the
whole suite, see conftest.py) a receive-from-any on a data group is refused, and two
messages between the same ranks received in the other order than they were sent are
caught even though their tags differ: NCCL would hand the first-posted message to the
first-posted receive. A control (Gloo) group still takes receive-from-any.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from disttrain.comm.collectives import (
    CollectiveLedger,
    Communicator,
    MessageOrderError,
    nccl_rules_default,
)
from disttrain.monitor.watchdog import default_store
from disttrain.testing import run_distributed

OPS = ["all_reduce", "broadcast", "reduce_scatter", "all_gather_into", "all_gather",
       "isend", "irecv", "recv_any"]


def _refusals() -> dict[str, str]:
    comm = Communicator(None, CollectiveLedger())
    meta = torch.empty(4, device="meta")
    strided = torch.zeros(4, 4).t()
    calls = {
        "all_reduce": lambda t: comm.all_reduce(t),
        "broadcast": lambda t: comm.broadcast(t),
        "reduce_scatter": lambda t: comm.reduce_scatter(t[:2], t),
        "all_gather_into": lambda t: comm.all_gather_into(t, t[:2]),
        "all_gather": lambda t: comm.all_gather(t),
        "isend": lambda t: comm.isend(t, 1 - comm.rank),
        "irecv": lambda t: comm.irecv(t, 1 - comm.rank),
        "recv_any": lambda t: comm.recv_any(t),
    }
    out = {}
    for op, call in calls.items():
        for what, tensor in (("device", meta), ("layout", strided)):
            try:
                call(tensor)
            except ValueError as exc:
                out[f"{op}/{what}"] = str(exc)
            else:
                out[f"{op}/{what}"] = "accepted"
    return out


def test_tensors_off_the_group_device_or_not_contiguous_are_refused():
    got = run_distributed(_refusals, 2, timeout=60)[0]
    for op in OPS:
        device, layout = got[f"{op}/device"], got[f"{op}/layout"]
        assert "meta" in device and "test_nccl_rules.py:" in device, (op, device)
        assert "contiguous" in layout and "test_nccl_rules.py:" in layout, (op, layout)


def _misordered() -> str:
    comm = Communicator(None, CollectiveLedger())
    first, second = torch.full((3,), 1.0), torch.full((3,), 2.0)
    if comm.rank == 0:
        works = [comm.isend(first, 1, tag=7), comm.isend(second, 1, tag=8)]
        for w in works:
            w.wait()
        store = default_store()
        store.set("misordered/sent", "1")
        # Rank 0 hosts the store: it stays until rank 1 has read the key, or rank 1's
        # wait meets a closed socket ("connection reset by peer").
        store.wait(["misordered/read"])
        return "sent"
    a, b = torch.empty(3), torch.empty(3)
    # receives posted in the other order: tags alone would sort them out on Gloo
    later, earlier = comm.irecv(b, 0, tag=8), comm.irecv(a, 0, tag=7)
    try:
        later.wait()
        earlier.wait()
        said = "not caught"
    except MessageOrderError as exc:
        said = str(exc)
    store = default_store()
    store.wait(["misordered/sent"])  # rank 0's sends done: leaving resets none
    store.set("misordered/read", "1")
    return said


def test_messages_received_out_of_posting_order_are_caught():
    assert nccl_rules_default(), "the suite runs under NCCL's rules (conftest.py)"
    got = run_distributed(_misordered, 2, timeout=60)[1]
    assert "tag 8" in got and "tag 7" in got and "posting order" in got, got


def _in_order() -> list[float]:
    comm = Communicator(None, CollectiveLedger())
    if comm.rank == 0:
        for w in [comm.isend(torch.full((3,), 1.0), 1, tag=7),
                  comm.isend(torch.full((2,), 2.0), 1, tag=8)]:
            w.wait()
        return []
    a, b = torch.empty(3), torch.empty(2)
    works = [comm.irecv(a, 0, tag=7), comm.irecv(b, 0, tag=8)]
    for w in works:
        w.wait()
    return a.tolist() + b.tolist()


def test_messages_received_in_posting_order_arrive():
    assert run_distributed(_in_order, 2, timeout=60)[1] == [1.0, 1.0, 1.0, 2.0, 2.0]


def _receive_from_any() -> dict[str, object]:
    ledger = CollectiveLedger()
    data = Communicator(None, ledger)
    control = Communicator(dist.new_group(backend="gloo"), ledger, "control", control=True)
    out: dict[str, object] = {}
    if data.rank == 1:
        try:
            data.recv_any(torch.empty(2))
        except ValueError as exc:
            out["data"] = str(exc)
        buf = torch.empty(2)
        out["control_from"] = control.recv_any(buf)
        out["control_got"] = buf.tolist()
    else:
        control.isend(torch.tensor([5.0, 6.0]), 1).wait()
    return out


def test_receive_from_any_only_on_a_control_group():
    got = run_distributed(_receive_from_any, 2, timeout=60)[1]
    assert "recv_any" in got["data"] and "control group" in got["data"]
    assert got["control_from"] == 0 and got["control_got"] == [5.0, 6.0]
