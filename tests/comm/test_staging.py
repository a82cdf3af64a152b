"""Host staging (the shared-GPU test mode's carrier) on the CPU, under its debug switch.

With ``host_staging`` (``DISTTRAIN_HOST_STAGING=1``) a Gloo group's CPU tensors travel
through separate host buffers, the receiving ones poisoned first, exactly the path CUDA
tensors take in the shared-GPU mode. On one spawned world of three ranks, every staged
op (reduce-scatter, all-gather into a tensor or a list, all-to-all, point-to-point under
NCCL's rules, receive-from-any), blocking and async, gives what the unstaged op gives
and what plain tensor arithmetic says it must; an async op's result reaches the caller's
tensor in ``wait()`` and not before (the peers join late, so the op cannot have
completed at issue); several ops in flight each land in their own tensor, whatever order
they are waited in; messages received out of posting order are still caught; the ledger
records the same ops and bytes. Then a dp 2 ZeRO-2 and a pp 2 1F1B training run end on
the same weights bit for bit with staging forced on and off.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from support import SyntheticTokens, tiny_config

from disttrain.comm.collectives import CollectiveLedger, Communicator, MessageOrderError
from disttrain.comm.staging import HOST_STAGING_ENV, host_staging_forced
from disttrain.testing import run_distributed

SIZE = 3
BLOCK = 5  # elements per rank's block
LATE_S = 0.3  # how long the other ranks hold back before joining an async op
SENTINEL = 7.0  # what an output holds before its op's result is copied in


def _block(rank: int, dtype: torch.dtype = torch.float32, n: int = BLOCK) -> torch.Tensor:
    """Rank ``rank``'s distinct values: rank r, element i -> 10 r + i / 4 (exact in
    bf16 for these sizes)."""
    return (10 * rank + torch.arange(n) / 4).to(dtype)


def _full(rank: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[SIZE * BLOCK]: what a rank hands reduce-scatter and all-to-all: small integers,
    whose sums over the ranks every dtype here holds exactly."""
    return (16 * rank + torch.arange(SIZE * BLOCK) % 16).to(dtype)


def _expected(op: str, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """The op's result on ``rank``, by plain tensor arithmetic."""
    if op == "reduce_scatter":
        return sum(_full(q, torch.float64) for q in range(SIZE)).to(dtype).chunk(SIZE)[rank]
    if op == "all_gather_into":
        return torch.cat([_block(q, dtype) for q in range(SIZE)])
    if op == "all_to_all":
        return torch.cat([_full(q, dtype).chunk(SIZE)[rank] for q in range(SIZE)])
    raise ValueError(op)


def _issue(comm: Communicator, op: str, dtype: torch.dtype, async_op: bool):
    """``op`` on this rank's inputs into a SENTINEL-filled output: (output, work)."""
    if op == "reduce_scatter":
        out, inp = torch.full((BLOCK,), SENTINEL, dtype=dtype), _full(comm.rank, dtype)
        return out, comm.reduce_scatter(out, inp, async_op=async_op)
    if op == "all_gather_into":
        out, inp = torch.full((SIZE * BLOCK,), SENTINEL, dtype=dtype), _block(comm.rank, dtype)
        return out, comm.all_gather_into(out, inp, async_op=async_op)
    out, inp = torch.full((SIZE * BLOCK,), SENTINEL, dtype=dtype), _full(comm.rank, dtype)
    return out, comm.all_to_all(out, inp, async_op=async_op)


COLLECTIVES = [("reduce_scatter", torch.float32), ("reduce_scatter", torch.bfloat16),
               ("all_gather_into", torch.float32), ("all_gather_into", torch.int64),
               ("all_to_all", torch.float32), ("all_to_all", torch.uint8)]


def _blocking(comm: Communicator) -> dict[str, torch.Tensor]:
    out = {f"{op}/{dtype}": _issue(comm, op, dtype, False)[0] for op, dtype in COLLECTIVES}
    # in place: this rank's block of the output is the input
    full = torch.full((SIZE * BLOCK,), SENTINEL)
    mine = full[comm.rank * BLOCK:(comm.rank + 1) * BLOCK]
    mine.copy_(_block(comm.rank))
    comm.all_gather_into(full, mine)
    out["all_gather_into/in_place"] = full
    out["all_gather"] = torch.stack(comm.all_gather(_block(comm.rank)))
    return out


def _late_async(comm: Communicator) -> dict[str, object]:
    """Every collective async, all in flight at once, waited in reverse order; rank 0
    issues at once, the others LATE_S later, so rank 0's ops cannot complete at issue:
    its outputs must still hold SENTINEL until wait()."""
    if comm.rank != 0:
        time.sleep(LATE_S)
    issued = [(f"{op}/{dtype}", *_issue(comm, op, dtype, True)) for op, dtype in COLLECTIVES]
    untouched = all(bool((out == SENTINEL).all()) for _, out, _ in issued)
    for _, _, work in reversed(issued):
        work.wait()
    return {"untouched_before_wait": untouched,
            "results": {name: out for name, out, _ in issued}}


def _messages(comm: Communicator) -> dict[str, object]:
    """Around the ring: three messages of different sizes and tags to the next rank,
    received from the previous one in posting order and waited in reverse; the
    receiver holds back, so the receives cannot have completed when posted."""
    nxt, prev = (comm.rank + 1) % SIZE, (comm.rank - 1) % SIZE
    sends = [comm.isend(_block(comm.rank, n=n), nxt, tag=n) for n in (1, 4, 9)]
    if comm.rank == 0:
        time.sleep(LATE_S)
    bufs = [torch.full((n,), SENTINEL) for n in (1, 4, 9)]
    recvs = [comm.irecv(b, prev, tag=n) for b, n in zip(bufs, (1, 4, 9), strict=True)]
    untouched = all(bool((b == SENTINEL).all()) for b in bufs)
    for w in reversed(recvs):
        w.wait()
    for w in sends:
        w.wait()
    return {"untouched_before_wait": untouched, "received": bufs}


def _misordered(comm: Communicator) -> str:
    """Rank 0 sends tags 7 then 8 to rank 1, which receives 8 first: caught. (On a
    group of its own: the receives left behind never cross later messages.)"""
    if comm.rank == 0:
        for w in [comm.isend(torch.full((3,), 1.0), 1, tag=7),
                  comm.isend(torch.full((3,), 2.0), 1, tag=8)]:
            w.wait()
        return "sent"
    if comm.rank != 1:
        return "idle"
    a, b = torch.empty(3), torch.empty(3)
    later, earlier = comm.irecv(b, 0, tag=8), comm.irecv(a, 0, tag=7)
    try:
        later.wait()
        earlier.wait()
    except MessageOrderError as exc:
        return str(exc)
    return "not caught"


def _receive_from_any(comm: Communicator) -> tuple[int, torch.Tensor] | None:
    """Rank 2 sends to rank 0, which receives from any rank (no NCCL rules here)."""
    if comm.rank == 2:
        comm.isend(_block(2), 0, tag=3).wait()
    if comm.rank != 0:
        return None
    buf = torch.full((BLOCK,), SENTINEL)
    return comm.recv_any(buf, tag=3), buf


def _ledger_rows(ledger: CollectiveLedger) -> list[tuple]:
    return [(r.op, r.shape, r.dtype) for r in ledger.records]


def _both_ways() -> dict[str, object]:
    """Every case with staging off, then on (a fresh communicator and ledger each)."""
    out: dict[str, object] = {}
    for staged in (False, True):
        ledger = CollectiveLedger()
        comm = Communicator(None, ledger, host_staging=staged)
        rules = Communicator(None, CollectiveLedger(), host_staging=staged, nccl_rules=True)
        free = Communicator(None, CollectiveLedger(), host_staging=staged, nccl_rules=False)
        out[f"{staged}/staged"] = (comm.staged, rules.staged, free.staged)
        out[f"{staged}/blocking"] = _blocking(comm)
        out[f"{staged}/async"] = _late_async(comm)
        out[f"{staged}/messages"] = _messages(rules)
        out[f"{staged}/any"] = _receive_from_any(free)
        comm.barrier()
        out[f"{staged}/misordered"] = _misordered(Communicator(
            dist.new_group(backend="gloo"), CollectiveLedger(), host_staging=staged,
            nccl_rules=True))
        out[f"{staged}/ledger"] = (_ledger_rows(ledger), ledger.payload_bytes,
                                   ledger.wire_sent_bytes, ledger.wire_recv_bytes)
    return out


@pytest.fixture(scope="module")
def world() -> list[dict[str, object]]:
    return run_distributed(_both_ways, SIZE, timeout=120)


def test_staging_is_on_only_where_asked(world):
    for rank in world:
        assert rank["False/staged"] == (False, False, False)
        assert rank["True/staged"] == (True, True, True)


@pytest.mark.parametrize("staged", [False, True])
def test_blocking_ops_give_the_arithmetic_result(world, staged):
    for r, rank in enumerate(world):
        got = rank[f"{staged}/blocking"]
        for op, dtype in COLLECTIVES:
            assert torch.equal(got[f"{op}/{dtype}"], _expected(op, r, dtype)), (op, dtype)
        gathered = _expected("all_gather_into", r, torch.float32)
        assert torch.equal(got["all_gather_into/in_place"], gathered)
        assert torch.equal(got["all_gather"].reshape(-1), gathered)


def test_staged_ops_equal_the_unstaged_ones_bit_for_bit(world):
    for rank in world:
        for kind in ("blocking", "async"):
            plain, staged = rank[f"False/{kind}"], rank[f"True/{kind}"]
            if kind == "async":
                plain, staged = plain["results"], staged["results"]
            assert plain.keys() == staged.keys()
            for name in plain:
                assert torch.equal(plain[name], staged[name]), (kind, name)


def test_async_results_arrive_in_wait_each_in_its_own_tensor(world):
    """Rank 0's outputs untouched until wait() (its peers joined LATE_S later), then
    each op's own result, though all were in flight together and waited in reverse."""
    assert world[0]["True/async"]["untouched_before_wait"]
    for r, rank in enumerate(world):
        got = rank["True/async"]["results"]
        for op, dtype in COLLECTIVES:
            assert torch.equal(got[f"{op}/{dtype}"], _expected(op, r, dtype)), (op, dtype)


def test_messages_arrive_in_posting_order_in_wait(world):
    assert world[1]["True/messages"]["untouched_before_wait"]  # rank 0 sent late
    for r, rank in enumerate(world):
        prev = (r - 1) % SIZE
        for staged in (False, True):
            got = rank[f"{staged}/messages"]["received"]
            assert [t.tolist() for t in got] == [
                _block(prev, n=n).tolist() for n in (1, 4, 9)], (r, staged)


def test_misordered_receives_are_still_caught(world):
    said = world[1]["True/misordered"]
    assert "tag 8" in said and "tag 7" in said and "posting order" in said, said


def test_receive_from_any_names_the_sender(world):
    for staged in (False, True):
        sender, buf = world[0][f"{staged}/any"]
        assert sender == 2 and torch.equal(buf, _block(2)), staged


def test_the_ledger_counts_the_same_ops_and_bytes(world):
    for rank in world:
        assert rank["True/ledger"] == rank["False/ledger"]
        rows, payload, _, _ = rank["True/ledger"]
        assert payload > 0 and ("reduce_scatter", (SIZE * BLOCK,), "bfloat16") in rows


# ------------------------------------------------------------------ a training run

def _fit(run_dir: str, keys: dict) -> tuple[bool, bool]:
    """A short masked-token run through the Trainer; whether this rank's switch was on
    and the run's world communicator staged."""
    from disttrain import Trainer
    from disttrain.data import collate_token_batch
    from disttrain.models import GPT, token_loss

    cfg = tiny_config(**keys, steps=6)
    torch.manual_seed(cfg.train.seed)
    trainer = Trainer(GPT(cfg.model), SyntheticTokens(mask=True), token_loss, cfg,
                      run_dir=run_dir, collate_fn=collate_token_batch, progress=False)
    trainer.fit()
    return host_staging_forced(), trainer.world.staged


@pytest.mark.parametrize("name,keys", [
    ("dp2-zero2", {"dp": 2, "zero": 2, "grad_accum": 2}),
    ("pp2-1f1b", {"pp": 2, "grad_accum": 4, "pp_schedule": "1f1b"}),
])
def test_training_ends_on_the_same_weights_with_staging_on_and_off(name, keys, tmp_path):
    weights = {}
    for staged in (False, True):
        run_dir = tmp_path / f"{name}-{staged}"
        env = {HOST_STAGING_ENV: "1" if staged else "0"}
        ranks = run_distributed(_fit, 2, args=(str(run_dir), keys), timeout=180, env=env)
        assert all(r == (staged, staged) for r in ranks), ranks
        weights[staged] = load_file(str(Path(run_dir) / "model.safetensors"))
    assert weights[True].keys() == weights[False].keys()
    for tensor_name, plain in weights[False].items():
        assert torch.equal(weights[True][tensor_name], plain), tensor_name
