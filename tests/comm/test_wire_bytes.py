"""Wire bytes: what each rank sends and receives for a collective's algorithm, beside
the payload it hands in (a ring all-reduce sends 2 (N-1)/N of the payload, an
all-gather (N-1) payloads)."""

from __future__ import annotations

import pytest
import torch

from disttrain.comm import CollectiveLedger, Communicator
from disttrain.comm.collectives import wire_bytes
from disttrain.testing import run_distributed


@pytest.mark.parametrize("op, size, root, expected", [
    ("all_reduce", 4, False, (600, 600)),      # 2 x 3/4 x 400
    ("all_reduce", 2, False, (400, 400)),      # 2 x 1/2 x 400
    ("reduce_scatter", 4, False, (300, 300)),  # 3/4 of the [4 x n] input
    ("all_gather", 4, False, (1200, 1200)),    # the 3 other ranks' blocks pass through
    ("broadcast", 4, True, (400, 0)),
    ("broadcast", 4, False, (0, 400)),
    ("send", 2, False, (400, 0)),
    ("recv", 2, False, (0, 400)),
    ("all_reduce", 1, False, (0, 0)),          # one rank: nothing moves
    ("barrier", 4, False, (0, 0)),
])
def test_wire_bytes_per_algorithm(op, size, root, expected):
    assert wire_bytes(op, 400, size, root) == expected


def _ledger_after_collectives() -> tuple[int, int, int]:
    import torch.distributed as dist

    comm = Communicator(None, CollectiveLedger())
    comm.all_reduce(torch.ones(100))                                # 400 B payload
    comm.all_gather_into(torch.empty(400), torch.ones(100))         # 400 B block
    comm.reduce_scatter(torch.empty(100), torch.ones(400))          # 1600 B input
    comm.broadcast(torch.ones(100), src=1)
    led = comm.ledger
    assert dist.get_world_size() == 4
    return led.payload_bytes, led.wire_sent_bytes, led.wire_recv_bytes


def test_the_ledger_counts_every_ranks_wire_bytes():
    results = run_distributed(_ledger_after_collectives, 4, timeout=60)
    payload = 400 + 400 + 1600 + 400
    common = 600 + 1200 + 1200  # all-reduce, all-gather, reduce-scatter
    for rank, (paid, sent, received) in enumerate(results):
        assert paid == payload
        assert sent == common + (400 if rank == 1 else 0)
        assert received == common + (0 if rank == 1 else 400)


def _topk_ratios(n: int) -> dict[str, float]:
    from disttrain.comm.codecs import TopKCodec
    from disttrain.parallel.ddp import DataParallel

    torch.manual_seed(0)
    model = torch.nn.Linear(n, 1, bias=False)
    comm = Communicator(None, CollectiveLedger())
    dp = DataParallel(model, comm, bucket_bytes=1 << 20, codec=TopKCodec(ratio=0.01))
    dp.zero_grad()
    model(torch.randn(2, n)).sum().backward()
    dp.finish_gradient_sync()
    return dp.comm_stats()


def test_an_all_gathering_codec_gains_less_on_the_wire():
    # top-k 1%: 8 bytes per kept element (value + index) against 4 per element, 50x in
    # payload; on the wire an all-gather of 4 ranks' payloads against a ring
    # all-reduce: 3 x payload against 1.5 x the fp32 bytes, 25x
    stats = run_distributed(_topk_ratios, 4, args=(4000,), timeout=60)[0]
    assert stats["compression_ratio"] == pytest.approx(50.0)
    assert stats["wire_compression_ratio"] == pytest.approx(25.0)
    assert stats["grad_sync_wire_bytes"] == 3 * stats["grad_sync_bytes"]
