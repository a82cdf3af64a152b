"""Tensor parallelism against a single-device copy.

One spawn of 4 ranks runs every multi-process check (primitives, layers, the
vocab-parallel loss, the whole GPT with and without sequence parallelism, AdamW steps)
over tp=4 and over tp=2; each check's asserts come after its collectives, so a failing
check does not desync the ranks, and each is reported as its own test. Plan and
divisibility errors are raised before any collective and are checked in-process.
"""

from __future__ import annotations

import copy
import functools
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from group_checks import assert_check_passed
from support import TINY_MODEL
from torch import nn

from disttrain.comm import Communicator
from disttrain.config.schema import ModelConfig
from disttrain.models import GPT, GPT_TP_PLAN, IGNORE_INDEX, gpt_spec, token_loss
from disttrain.parallel import tensor as tpl

MODEL = {**TINY_MODEL, "n_head": 4}  # 4 heads so that tp=4 divides them
TOL = {"atol": 1e-5, "rtol": 1e-5}


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, **TOL, msg=lambda m: f"{what}: {m}")


def _last(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    return t.chunk(size, dim=-1)[rank]


def _seq(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    return t.chunk(size, dim=1)[rank]


def _ops_since(comm: Communicator, seq: int) -> list[str]:
    n = comm.ledger.seq - seq
    return [r.op for r in list(comm.ledger.records)[-n:]] if n else []


# ---- multi-process checks (each runs on every rank) ---------------------------------

def _check_primitives(comm: Communicator) -> None:
    """Each Function's output and input gradient, and the collectives it issues."""
    size, rank = comm.size, comm.rank
    g = torch.Generator().manual_seed(1)
    shape = (2, 8, 4 * size)
    full, w = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    xs = [torch.randn(shape, generator=g) for _ in range(size)]  # rank-specific inputs
    ws = [torch.randn(shape, generator=g) for _ in range(size)]  # rank-specific upstreams
    last, seq = (lambda t: _last(t, rank, size)), (lambda t: _seq(t, rank, size))
    # name: (fn, local input, upstream grad, expected output, expected input grad, ops)
    cases = {
        "copy": (tpl.copy_to_tp_region, full, ws[rank], full, sum(ws), ["all_reduce"]),
        "reduce": (tpl.reduce_from_tp_region, xs[rank], w, sum(xs), w, ["all_reduce"]),
        "gather": (tpl.gather_from_tp_region, last(full), w, full, last(w), ["all_gather"]),
        "scatter": (tpl.scatter_to_tp_region, full, last(w), last(full), w, ["all_gather"]),
        "rs_seq": (tpl.reduce_scatter_to_sequence_region, xs[rank], seq(w), seq(sum(xs)), w,
                   ["reduce_scatter", "all_gather"]),
        "gather_seq": (tpl.gather_from_sequence_region, seq(full), ws[rank], full,
                       seq(sum(ws)), ["all_gather", "reduce_scatter"]),
        "scatter_seq": (tpl.scatter_to_sequence_region, full, seq(w), seq(full), w,
                        ["all_gather"]),
    }
    got = {}
    for name, (fn, inp, up, *_) in cases.items():
        x = inp.clone().requires_grad_()
        start = comm.ledger.seq
        y = fn(x, comm)
        (y * up).sum().backward()
        got[name] = (y.detach(), x.grad, _ops_since(comm, start))
    for name, (*_, want_y, want_g, want_ops) in cases.items():
        y, grad, ops = got[name]
        _close(y, want_y, f"{name} output")
        _close(grad, want_g, f"{name} input grad")
        assert ops == want_ops, (name, ops)


def _layer_pair(size: int, d: int = 8) -> tuple[nn.Linear, nn.Linear]:
    torch.manual_seed(2)
    return nn.Linear(d, 6 * size), nn.Linear(6 * size, d)


def _check_linear_layers(comm: Communicator, sequence_parallel: bool) -> None:
    """x -> ColumnParallel -> gelu -> RowParallel, against the full two layers."""
    size, rank = comm.size, comm.rank
    up, down = _layer_pair(size)
    col = tpl.ColumnParallelLinear(up, comm, sequence_parallel=sequence_parallel)
    row = tpl.RowParallelLinear(down, comm, sequence_parallel=sequence_parallel)
    g = torch.Generator().manual_seed(3)
    x_full = torch.randn(2, 8, 8, generator=g, requires_grad=True)
    w = torch.randn(2, 8, 8, generator=g)
    y_full = down(F.gelu(up(x_full)))
    (y_full * w).sum().backward()

    x = x_full.detach().clone().requires_grad_()
    inp = tpl.scatter_to_sequence_region(x, comm) if sequence_parallel else x
    y = row(F.gelu(col(inp)))
    want_y, up_grad = ((_seq(y_full, rank, size), _seq(w, rank, size)) if sequence_parallel
                       else (y_full, w))
    (y * up_grad).sum().backward()
    bias_grad = row.bias.grad.clone()
    comm.all_reduce(bias_grad)  # under sequence parallelism each rank holds a part

    _close(y.detach(), want_y.detach(), "output")
    _close(x.grad, x_full.grad, "input grad")
    _close(col.weight.grad, up.weight.grad.chunk(size, 0)[rank], "column weight grad")
    _close(col.bias.grad, up.bias.grad.chunk(size, 0)[rank], "column bias grad")
    _close(row.weight.grad, down.weight.grad.chunk(size, 1)[rank], "row weight grad")
    _close(bias_grad if sequence_parallel else row.bias.grad, down.bias.grad,
           "row bias grad")
    assert row.partial_grad_params() == ([row.bias] if sequence_parallel else [])


def _unfused_column(x, weight, bias, comm, *, sequence_parallel, transposed):
    """The pair column_parallel_linear fuses: the region's entry Function, then F.linear."""
    x = (tpl.gather_from_sequence_region if sequence_parallel else tpl.copy_to_tp_region)(
        x, comm)
    return F.linear(x, weight.t() if transposed else weight, bias)


def _check_fused_column_linear(comm: Communicator) -> None:
    """column_parallel_linear (its input gradient's collective overlapping the weight
    gradient) = the unfused pair: output and every gradient, fp32 and under bf16
    autocast, sequence parallelism on and off, a transposed weight, a frozen weight; and
    the collectives it issues."""
    size, rank = comm.size, comm.rank
    g = torch.Generator().manual_seed(8)
    x_full, up = torch.randn(2, 4 * size, 8, generator=g), torch.randn(2, 4 * size, 6, generator=g)
    got = []
    for sp, transposed, frozen, cast in [(False, False, False, False), (True, False, False, False),
                                         (False, True, False, False), (True, True, True, False),
                                         (False, False, False, True), (True, False, False, True)]:
        weight = torch.randn((8, 6) if transposed else (6, 8), generator=g)
        bias = torch.randn(6, generator=g)
        x_in = _seq(x_full, rank, size) if sp else x_full
        out = []
        for fn in (tpl.column_parallel_linear, _unfused_column):
            x = x_in.clone().requires_grad_()
            w, b = weight.clone().requires_grad_(not frozen), bias.clone().requires_grad_()
            start = comm.ledger.seq
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cast):
                y = fn(x, w, b, comm, sequence_parallel=sp, transposed=transposed)
            (y.float() * up).sum().backward()
            out.append((y.detach().float(), x.grad, w.grad, b.grad, _ops_since(comm, start)))
        got.append(((sp, transposed, frozen, cast), out))
    for case, (fused, plain) in got:
        tol = {"atol": 5e-2, "rtol": 2e-2} if case[3] else TOL
        for what, a, e in zip(("output", "input grad", "weight grad", "bias grad"),
                              fused[:4], plain[:4], strict=True):
            if e is None:
                assert a is None, (case, what)
                continue
            assert a.dtype == e.dtype, (case, what, a.dtype, e.dtype)
            torch.testing.assert_close(a, e, **tol, msg=lambda m, c=case, w=what: f"{c} {w}: {m}")
        assert fused[4] == plain[4], (case, fused[4], plain[4])


def _qkv_rows(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rows of this rank's heads in each of the q, k, v thirds of dim 0, stacked."""
    return torch.cat([part.chunk(size, 0)[rank] for part in t.chunk(3, 0)])


def _check_qkv_embedding_head(comm: Communicator) -> None:
    size, rank = comm.size, comm.rank
    d, vocab = 8, 16 * size
    torch.manual_seed(4)
    qkv, emb = nn.Linear(d, 3 * d, bias=False), nn.Embedding(vocab, d)
    head = nn.Linear(d, vocab, bias=False)
    qkv_tp = tpl.ColumnParallelLinear(qkv, comm, parts=3)
    emb_tp = tpl.VocabParallelEmbedding(emb, comm)
    head_tp = tpl.VocabParallelHead(head, comm)
    tied = tpl.VocabParallelHead(head, comm, tied=emb_tp.weight)
    g = torch.Generator().manual_seed(5)
    x_full = torch.randn(2, 8, d, generator=g, requires_grad=True)
    ids = torch.randint(0, vocab, (2, 8), generator=g)
    w_qkv, w_emb = torch.randn(2, 8, 3 * d, generator=g), torch.randn(2, 8, d, generator=g)
    w_head = torch.randn(2, 8, vocab, generator=g)
    y_qkv, y_emb, y_head = qkv(x_full), emb(ids), head(x_full)
    ((y_qkv * w_qkv).sum() + (y_emb * w_emb).sum() + (y_head * w_head).sum()).backward()

    x = x_full.detach().clone().requires_grad_()

    def local(t: torch.Tensor) -> torch.Tensor:  # this rank's q, k, v features
        return _qkv_rows(t.movedim(-1, 0), rank, size).movedim(0, -1)

    o_qkv, o_emb, o_head = qkv_tp(x), emb_tp(ids), head_tp(x)
    ((o_qkv * local(w_qkv)).sum() + (o_emb * w_emb).sum()
     + (o_head * _last(w_head, rank, size)).sum()).backward()

    _close(o_qkv.detach(), local(y_qkv.detach()), "qkv output (own heads' q, k, v)")
    _close(qkv_tp.weight.grad, _qkv_rows(qkv.weight.grad, rank, size), "qkv weight grad")
    _close(o_emb.detach(), y_emb.detach(), "embedding output")
    _close(emb_tp.weight.grad, emb.weight.grad.chunk(size, 0)[rank], "embedding grad")
    _close(o_head.detach(), _last(y_head, rank, size).detach(), "head local logits")
    _close(head_tp.weight.grad, head.weight.grad.chunk(size, 0)[rank], "head weight grad")
    _close(x.grad, x_full.grad, "input grad (qkv + head)")
    assert tied.weight is emb_tp.weight
    shard = d // size
    assert [b.global_offsets for b in qkv_tp.param_boxes()["weight"]] == \
        [(rank * shard, 0), (d + rank * shard, 0), (2 * d + rank * shard, 0)]
    assert [b.local_offsets for b in qkv_tp.param_boxes()["weight"]] == \
        [(0, 0), (shard, 0), (2 * shard, 0)]


def _check_loss(comm: Communicator) -> None:
    """Vocab-parallel loss = token_loss on the full logits, with IGNORE_INDEX targets
    (one row entirely ignored), fp32 and bf16 logits; its collectives stay small."""
    size, rank = comm.size, comm.rank
    g = torch.Generator().manual_seed(6)
    vocab = 16 * size
    full = 3 * torch.randn(3, 5, vocab, generator=g)
    targets = torch.randint(0, vocab, (3, 5), generator=g)
    targets[0, :2] = IGNORE_INDEX
    targets[2] = IGNORE_INDEX
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        ref = full.to(dtype).detach().clone().requires_grad_()
        ref_loss, ref_count = token_loss(ref, targets)
        (0.5 * ref_loss).backward()
        local = _last(full.to(dtype), rank, size).detach().clone().requires_grad_()
        start = comm.ledger.seq
        loss, count = tpl.vocab_parallel_token_loss(local, targets, comm)
        (0.5 * loss).backward()
        records = list(comm.ledger.records)[-(comm.ledger.seq - start):]
        results.append((dtype, ref, ref_loss, ref_count, local, loss, count, records))
    for dtype, ref, ref_loss, ref_count, local, loss, count, records in results:
        assert count == ref_count == 8, (count, ref_count)
        assert isinstance(count, torch.Tensor) and count.dim() == 0  # never read on the host
        assert loss.dtype == torch.float32
        _close(loss.detach(), ref_loss.detach().float(), f"{dtype} loss")
        tol = TOL if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
        torch.testing.assert_close(local.grad, _last(ref.grad, rank, size), **tol)
        assert local.grad.dtype == dtype
        assert not local.grad[2].any()  # ignored targets give no gradient
        assert [r.op for r in records] == ["all_reduce", "all_reduce"], records
        n = targets.numel()
        assert all(torch.Size(r.shape).numel() <= 2 * n for r in records), records


def _gpt_pair(comm: Communicator, sequence_parallel: bool):
    torch.manual_seed(0)
    full = GPT(ModelConfig(**MODEL))
    model = copy.deepcopy(full)
    handle = tpl.apply_tensor_parallel(model, comm, sequence_parallel=sequence_parallel)
    return full, model, handle


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, MODEL["vocab_size"], (2, MODEL["seq_len"]), generator=g)
    targets = torch.randint(0, MODEL["vocab_size"], (2, MODEL["seq_len"]), generator=g)
    targets[1, :5] = IGNORE_INDEX
    return ids, targets


def _check_gpt(comm: Communicator, sequence_parallel: bool) -> None:
    """Logits, loss and every parameter gradient of the TP GPT = the full GPT's."""
    size = comm.size
    full, model, tp = _gpt_pair(comm, sequence_parallel)
    ids, targets = _batch(7)
    ref_logits = full(ids)
    ref_loss, ref_count = token_loss(ref_logits, targets)
    (ref_loss / ref_count).backward()
    local = model(ids)
    loss, count = tp.loss_fn(local, targets)
    (loss / count).backward()
    tp.sync_replicated_grads()
    logits = tpl.gather_from_tp_region(local.detach(), comm)

    full_params = dict(full.named_parameters())
    assert [n for n, _ in model.named_parameters()] == list(full_params)
    assert model.head.weight is model.tok_emb.weight
    assert all(b.attn.n_head == MODEL["n_head"] // size for b in model.blocks)
    assert local.shape[-1] == MODEL["vocab_size"] // size
    _close(logits, ref_logits.detach(), "logits")
    _close(loss.detach(), ref_loss.detach(), "loss")
    assert count == ref_count
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        _close(p.grad, tp.local_from_global(name, full_params[name].grad), f"{name}.grad")
        assert tp.is_sharded(p) == (p.shape != full_params[name].shape), name
    assert len(tp.boxes("blocks.0.attn.qkv.weight")) == 3
    assert tp.boxes("head.weight") == tp.boxes("tok_emb.weight")
    assert tp.boxes("ln_f.weight")[0].shape == (MODEL["d_model"],)


def _check_adamw(comm: Communicator, sequence_parallel: bool) -> None:
    """Three AdamW steps on the TP GPT leave each rank's parameters equal to its shard
    of the full GPT's parameters after the same steps."""
    full, model, tp = _gpt_pair(comm, sequence_parallel)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (full, model)]
    for step in range(3):
        ids, targets = _batch(10 + step)
        for opt in opts:
            opt.zero_grad()
        ref_loss, ref_count = token_loss(full(ids), targets)
        (ref_loss / ref_count).backward()
        loss, count = tp.loss_fn(model(ids), targets)
        (loss / count).backward()
        tp.sync_replicated_grads()
        for opt in opts:
            opt.step()
    full_params = dict(full.named_parameters())
    for name, p in model.named_parameters():
        _close(p.detach(), tp.local_from_global(name, full_params[name].detach()), name)


CHECKS = {
    "primitives": _check_primitives,
    "column_row_linear": functools.partial(_check_linear_layers, sequence_parallel=False),
    "column_row_linear_sp": functools.partial(_check_linear_layers, sequence_parallel=True),
    "fused_column_linear": _check_fused_column_linear,
    "qkv_embedding_head": _check_qkv_embedding_head,
    "vocab_parallel_loss": _check_loss,
    "gpt": functools.partial(_check_gpt, sequence_parallel=False),
    "gpt_sp": functools.partial(_check_gpt, sequence_parallel=True),
    "adamw": functools.partial(_check_adamw, sequence_parallel=False),
    "adamw_sp": functools.partial(_check_adamw, sequence_parallel=True),
}


@pytest.mark.parametrize("tp", (4, 2))
@pytest.mark.parametrize("check", list(CHECKS))
def test_tensor_parallel_matches_single_device(check, tp):
    assert_check_passed(__name__, check, tp, (4, 2), "tp")


# ---- in-process: errors raised before any collective --------------------------------

def _fake_comm(size: int) -> SimpleNamespace:
    return SimpleNamespace(size=size, rank=0)


@pytest.mark.parametrize("change, tp, sp, field", [
    ({"n_head": 2}, 4, False, "model.n_head"),
    ({"vocab_size": 66}, 4, False, "model.vocab_size"),
    ({"vocab_size": 65}, 2, False, "model.vocab_size"),
    # only reachable with a d_model that n_head does not divide
    ({"d_model": 33, "n_head": 8}, 8, False, "model.d_model"),
    ({"seq_len": 18}, 4, True, "model.seq_len"),
])
def test_indivisible_model_is_refused_naming_the_field(change, tp, sp, field):
    model = GPT(ModelConfig(**{**MODEL, **change}))
    with pytest.raises(ValueError, match=field) as info:
        tpl.apply_tensor_parallel(model, _fake_comm(tp), sequence_parallel=sp)
    assert isinstance(info.value, tpl.TensorParallelLayoutError)
    assert f"tp={tp}" in str(info.value) and "parallel.tp" in str(info.value)


def test_seq_len_only_matters_with_sequence_parallelism():
    tpl.check_divisible(gpt_spec(ModelConfig(**{**MODEL, "seq_len": 18})), 4)


@pytest.mark.parametrize("plan, message", [
    ({**GPT_TP_PLAN, "blocks.*.mlp.up": "columnwise"}, "unknown style"),
    ({**GPT_TP_PLAN, "blocks.*.mlp.upp": "colwise"}, "match no module"),
    ({k: v for k, v in GPT_TP_PLAN.items() if k != "head"}, "'head' is not in the plan"),
    ({**GPT_TP_PLAN, "ln_f": "colwise"}, "needs a Linear"),
])
def test_bad_plans_are_refused(plan, message):
    with pytest.raises(ValueError, match=message):
        tpl.apply_tensor_parallel(GPT(ModelConfig(**MODEL)), _fake_comm(2), plan=plan)


def test_sequence_parallel_needs_an_entry_point():
    plan = {k: v for k, v in GPT_TP_PLAN.items() if v != "split_sequence"}
    with pytest.raises(ValueError, match="split_sequence"):
        tpl.apply_tensor_parallel(GPT(ModelConfig(**MODEL)), _fake_comm(2), plan=plan,
                                  sequence_parallel=True)
