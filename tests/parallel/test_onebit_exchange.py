"""1-bit Adam's bucketed momentum exchange against the per-tensor one it replaced.

The reference below is the exchange as it was before buckets (each tensor cut, packed,
averaged and decoded on its own, all tensors of a round in one all-to-all and one
all-gather), kept here verbatim in substance. Packing a bucket's tensors side by side
changes no scale (they stay per tensor and chunk) and no summation: over several rounds
of error feedback the two give the same averages and the same residuals bit for bit,
and move the same bytes. One spawn of 4 ranks runs every case.
"""

from __future__ import annotations

import math

import pytest
import torch

from disttrain.comm.codecs import pack_signs, unpack_signs
from disttrain.comm.collectives import CollectiveLedger, Communicator, wire_bytes
from disttrain.parallel.onebit.exchange import BucketLayout, MomentumExchange
from disttrain.testing import run_distributed

pytestmark = pytest.mark.slow  # spawns a world

# odd sizes: runs with a tail, ranks that serve nothing of a tensor, a single element;
# the second bucket has no padding at all (its blocks are its flat concatenation)
NUMELS = [1, 10, 37, 64, 4096, 129, 1000, 203]
CUTS = [(0, 3), (3, 5), (5, len(NUMELS))]
ROUNDS = 3


# ------------------------------------------------------------------ the reference
def _layout(numel: int, parts: int, stride: int | None) -> tuple[int, int]:
    stride = stride if stride is not None else 8 * math.ceil(numel / (8 * parts))
    return stride, 8 * math.ceil(stride / 8)


def _rows(x: torch.Tensor, parts: int, stride: int, chunk: int) -> torch.Tensor:
    out = torch.zeros(parts, chunk)
    whole = x.numel() // stride
    out[:whole, :stride] = x[:whole * stride].view(whole, stride)
    if whole < parts:
        tail = x[whole * stride:]
        out[whole, :tail.numel()] = tail
    return out


def _real(numel: int, stride: int, j: int) -> int:
    return max(0, min(stride, numel - j * stride))


def _compress(y, real, mask):
    scales = (y.abs() * mask).sum(1) / real.clamp(min=1)
    signs = torch.where(y >= 0, 1.0, -1.0)
    return scales, signs.mul_(scales.unsqueeze(1)).mul_(mask)


def per_tensor_average(comm, xs, worker_errors, server_errors, strides):
    """The exchange before buckets: one round over ``xs`` (flat fp32 tensors)."""
    size, rank = comm.size, comm.rank
    lays = [(x.numel(), *_layout(x.numel(), size, s)) for x, s in zip(xs, strides,
                                                                      strict=True)]
    scales, signs = [], []
    for x, e, (n, stride, chunk) in zip(xs, worker_errors, lays, strict=True):
        y = _rows(x + e, size, stride, chunk)
        real = torch.tensor([_real(n, stride, j) for j in range(size)])
        mask = torch.arange(chunk).unsqueeze(0) < real.unsqueeze(1)
        s, decoded = _compress(y, mask.sum(1), mask)
        e.copy_((y - decoded)[:, :stride].reshape(-1)[:n])
        scales.append(s)
        signs.append(pack_signs(y.reshape(-1)).view(size, chunk // 8))
    send = torch.cat([torch.stack(scales, 1).contiguous().view(torch.uint8), *signs],
                     dim=1).contiguous()
    recv = torch.empty_like(send)
    comm.all_to_all(recv.view(-1), send.view(-1))
    p = len(xs)
    got = recv[:, :4 * p].contiguous().view(torch.float32)
    out_scales, out_signs, offset = [], [], 4 * p
    for i, ((n, stride, chunk), es) in enumerate(zip(lays, server_errors, strict=True)):
        mine = unpack_signs(recv[:, offset:offset + chunk // 8], chunk)
        offset += chunk // 8
        real = _real(n, stride, rank)
        mean = (mine[:, :real] * got[:, i:i + 1]).mean(0)
        a = torch.zeros(chunk)
        a[:real] = mean + es[:real]
        mask = (torch.arange(chunk) < real).unsqueeze(0)
        t, decoded = _compress(a.unsqueeze(0), torch.tensor([real]), mask)
        es[:real] = a[:real] - decoded[0, :real]
        out_scales.append(t)
        out_signs.append(pack_signs(a))
    payload = torch.cat([torch.cat(out_scales).view(torch.uint8), *out_signs])
    gathered = torch.empty(size * payload.numel(), dtype=torch.uint8)
    comm.all_gather_into(gathered, payload)
    rows = gathered.view(size, -1)
    every = rows[:, :4 * p].contiguous().view(torch.float32)
    result, offset = [], 4 * p
    for i, (n, stride, chunk) in enumerate(lays):
        s = unpack_signs(rows[:, offset:offset + chunk // 8], chunk)
        offset += chunk // 8
        result.append((s * every[:, i:i + 1])[:, :stride].reshape(-1)[:n].clone())
    wire = (wire_bytes("all_to_all", send.numel(), size)[0]
            + wire_bytes("all_gather", payload.numel(), size)[0])
    return result, wire


# ------------------------------------------------------------------ 4 ranks
def _strides(zero: bool, size: int) -> list[int | None]:
    """ZeRO-1's runs: each buffer padded to a multiple of the ranks, cut evenly."""
    return [-(-n // size) for n in NUMELS] if zero else [None] * len(NUMELS)


def _compare(zero: bool) -> dict:
    """Rounds of both exchanges over the same inputs (different on every rank); the
    bucketed one cuts the tensors into three buckets. Returns what differed."""
    comm = Communicator(None, CollectiveLedger())
    size, rank = comm.size, comm.rank
    strides = _strides(zero, size)
    gen = torch.Generator().manual_seed(100 + rank)
    ref_w = [torch.zeros(n) for n in NUMELS]
    ref_s = [torch.zeros(_layout(n, size, s)[1]) for n, s in zip(NUMELS, strides,
                                                                 strict=True)]
    ex = MomentumExchange(comm)
    cuts = CUTS
    layouts = [ex.layout(NUMELS[a:b], strides[a:b]) for a, b in cuts]
    carries = [torch.zeros(lay.numel) for lay in layouts]
    servers = [torch.zeros(lay.columns) for lay in layouts]
    report = {"rounds": 0, "unequal": [], "wire": [],
              "unpadded": [lay.unpadded for lay in layouts]}
    for _ in range(ROUNDS):
        xs = [torch.randn(n, generator=gen) * (1 + i) for i, n in enumerate(NUMELS)]
        expected, wire = per_tensor_average(comm, [x.clone() for x in xs], ref_w, ref_s,
                                            strides)
        ex.new_round()
        started = [ex.start(lay, torch.cat(xs[a:b]), carry)
                   for lay, (a, b), carry in zip(layouts, cuts, carries, strict=True)]
        got = []
        for pending, server in zip(started, servers, strict=True):
            got.extend(_split(ex.finish(pending, server), pending.layout))
        report["wire"].append((ex.stats.wire_sent, wire))
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            if not torch.equal(g, e):
                report["unequal"].append(("average", i))
        for lay, (a, b), carry, server in zip(layouts, cuts, carries, servers, strict=True):
            for k, i in enumerate(range(a, b)):
                if not torch.equal(_split(carry, lay)[k], ref_w[i]):
                    report["unequal"].append(("worker residual", i))
                col, chunk = lay.offsets[k], lay.layouts[k].chunk
                if not torch.equal(server[col:col + chunk], ref_s[i]):
                    report["unequal"].append(("server residual", i))
        report["rounds"] += 1
    return report


def _split(flat: torch.Tensor, lay: BucketLayout) -> list[torch.Tensor]:
    return [flat[s:s + lay_i.numel] for s, lay_i in zip(lay.starts, lay.layouts,
                                                        strict=True)]


def _both() -> list[dict]:
    return [_compare(False), _compare(True)]


@pytest.fixture(scope="module")
def reports():
    return run_distributed(_both, 4, timeout=120)


@pytest.mark.parametrize("zero", [0, 1], ids=["even-runs", "zero1-runs"])
def test_bucketed_rounds_equal_the_per_tensor_rounds_bitwise(reports, zero):
    for rank in reports:
        report = rank[zero]
        assert report["rounds"] == ROUNDS and report["unpadded"] == [False, True, False]
        assert report["unequal"] == []


@pytest.mark.parametrize("zero", [0, 1], ids=["even-runs", "zero1-runs"])
def test_bucketed_rounds_send_the_same_wire_bytes(reports, zero):
    for rank in reports:
        for ours, theirs in rank[zero]["wire"]:
            assert ours == theirs > 0


# ------------------------------------------------------------------ one process
@pytest.mark.parametrize("strides", [None, [-(-n // 4) for n in NUMELS]],
                         ids=["even-runs", "zero1-runs"])
def test_blocks_and_flat_are_inverse_and_pad_with_zeros(strides):
    lay = BucketLayout(NUMELS, 4, 1, strides)
    flat = torch.arange(1, lay.numel + 1, dtype=torch.float32)
    blocks = lay.blocks(flat)
    assert blocks.shape == (lay.padded,) and lay.columns % 8 == 0
    assert int((blocks != 0).sum()) == lay.numel  # every element once, the rest zeros
    for i, n in enumerate(NUMELS):  # tensor i's run j is row j of its block
        stride, start = lay.layouts[i].stride, lay.starts[i]
        for j in range(4):
            run = flat[start + min(n, j * stride):start + min(n, (j + 1) * stride)]
            assert torch.equal(lay.block(blocks, i)[j, :run.numel()], run)
    assert torch.equal(lay.flat(blocks), flat)


def test_a_bucket_without_padding_is_its_own_blocks():
    lay = BucketLayout([64, 32 * 7, 4096], 4, 2)
    flat = torch.randn(lay.numel)
    assert lay.unpadded and lay.blocks(flat) is flat and lay.flat(flat) is flat


# ------------------------------------------------------------------ the optimizer
def _optimizer_runs() -> dict:
    """The same compressed steps (gradients different on every rank) through one
    bucket and through buckets of at most 1 KiB (three: each matrix alone, the vectors
    together): the parameters and residuals after."""
    from disttrain.parallel.onebit import OnebitAdam

    comm = Communicator(None, CollectiveLedger())
    out = {}
    for name, bucket_bytes in (("one", 2**30), ("many", 1024)):
        torch.manual_seed(0)
        layer = torch.nn.Sequential(torch.nn.Linear(37, 64), torch.nn.LayerNorm(64),
                                    torch.nn.Linear(64, 10))
        params = list(layer.parameters())
        opt = OnebitAdam([{"params": [p for p in params if p.dim() >= 2],
                           "weight_decay": 0.1},
                          {"params": [p for p in params if p.dim() < 2],
                           "weight_decay": 0.0}], comm, freeze_step=2, lr=1e-2,
                         bucket_bytes=bucket_bytes)
        gen = torch.Generator().manual_seed(comm.rank)
        for _ in range(6):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen)
            opt.step()
        out[name] = {"params": [p.detach().clone() for p in params],
                     "carry": [opt.rank_state(p)["worker_error"].clone() for p in params],
                     "buckets": len(opt._buckets)}
    return out


def test_the_bucket_cuts_do_not_change_the_update():
    for rank in run_distributed(_optimizer_runs, 4, timeout=120):
        assert rank["one"]["buckets"] == 1 and rank["many"]["buckets"] >= 3
        for key in ("params", "carry"):
            for a, b in zip(rank["one"][key], rank["many"][key], strict=True):
                assert torch.equal(a, b)
        moved = rank["one"]["carry"][0].abs().max()
        assert moved > 0  # the compressed steps ran
