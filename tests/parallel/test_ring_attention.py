"""Ring attention against full causal attention in one process (torch SDPA).

In process: one block pair's kernels ("fused": torch's CPU flash kernels; "math": plain
PyTorch over slices of rows) against softmax attention written out in float64, with and
without the causal diagonal and grouped-query heads; and the NCCL matching model the
ring's messages are checked with, on a posting order that hangs.

One spawn of 4 ranks then runs every check over cp groups of 4, 2 ({0, 1}, {2, 3}) and 1:
ring attention's output and dq, dk, dv (both kernels, grouped-query heads, a given
scale) against SDPA on the whole sequence; the built-in GPT and a tiny transformers
Llama switched to ring attention, their inputs split, against the one-process model:
the loss summed over tokens and every parameter's gradient summed over cp ranks (the
GPT under bf16 autocast too, at bf16's tolerance); and the messages each rank posted,
replayed under NCCL's matching (per-pair streams in posting order, a send waits for its
receive).

Tolerance (fp32): rtol 1e-5, atol 1e-5. The ring adds the same terms in another order
(blocks merged on their log-sum-exp, gradients summed over blocks and ranks), ~1e-7
relative; a block masked the wrong way, a skipped block that is needed, a dk from the
wrong block or a position off by one chunk moves a value by 1e-2 or more.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from group_checks import assert_check_passed
from support import TINY_MODEL

from disttrain.comm import CollectiveLedger, Communicator
from disttrain.config.schema import ModelConfig
from disttrain.models import GPT, IGNORE_INDEX, token_loss
from disttrain.parallel.context import (
    apply_ring_attention,
    local_positions,
    ring_attention,
    shift_labels,
    split_sequence,
)
from disttrain.parallel.context import kernels as ring_kernels

TOL = {"rtol": 1e-5, "atol": 1e-5}


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, **TOL, msg=lambda m: f"{what}: {m}")


def _attention64(q, k, v, causal: bool, scale: float):
    """Softmax attention in float64 (the independent reference): out, lse."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, dim=1) for t in (k, v))
    s = q.double() @ k.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


# ---- one block pair, in process ---------------------------------------------------------

@pytest.mark.parametrize("kernel", ring_kernels.KERNELS)
@pytest.mark.parametrize("causal, tq, tk", [(True, 12, 12), (False, 6, 12), (False, 12, 6)])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_block_kernels_equal_softmax_attention(kernel, causal, tq, tk, kv_heads, monkeypatch):
    monkeypatch.setattr(ring_kernels, "SCORE_BYTES", 2 * 4 * 4 * tk * 4)  # 4-row slices
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, tq, 8, generator=g)
    k, v = (torch.randn(2, kv_heads, tk, 8, generator=g) for _ in range(2))
    dout = torch.randn(2, 4, tq, 8, generator=g)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = _attention64(*leaves, causal, 0.3)
    ref_grads = torch.autograd.grad(ref, leaves, dout.double())
    out, lse = ring_kernels.block_forward(q, k, v, causal, 0.3, kernel)
    _close(out.float(), ref.float(), "out")
    _close(lse, ref_lse.float(), "lse")
    grads = ring_kernels.block_backward(dout, q, k, v, out.to(q.dtype), lse.contiguous(),
                                        causal, 0.3, kernel)
    for name, got, want in zip("qkv", grads, ref_grads, strict=True):
        _close(got.float(), want.float(), f"d{name}")


def _nccl_hang(programs: list[list[tuple]]) -> str | None:
    """Replay each rank's posted messages the way NCCL runs them; None if all complete,
    else what each stuck rank waits for. ``programs[r]``: ("post", id, "send"|"recv",
    peer) and ("wait", id) in the order rank r issued them. The messages of a pair of
    ranks (both directions) run in posting order on one stream; a send completes with
    the peer's receive at the head of its stream; a wait blocks its rank's host."""
    at = [0] * len(programs)
    queues: list[dict[int, list[tuple]]] = [{} for _ in programs]
    done: list[set] = [set() for _ in programs]
    progress = True
    while progress:
        progress = False
        for r, program in enumerate(programs):
            while at[r] < len(program):
                event = program[at[r]]
                if event[0] == "wait" and event[1] not in done[r]:
                    break
                if event[0] == "post":
                    queues[r].setdefault(event[3], []).append(event)
                at[r] += 1
                progress = True
        for r in range(len(programs)):
            for peer, queue in queues[r].items():
                other = queues[peer].get(r, [])
                if queue and other and {queue[0][2], other[0][2]} == {"send", "recv"}:
                    done[r].add(queue.pop(0)[1])
                    done[peer].add(other.pop(0)[1])
                    progress = True
    stuck = [f"rank {r} at {programs[r][at[r]]}" for r in range(len(programs))
             if at[r] < len(programs[r])]
    return "; ".join(stuck) or None


def test_the_nccl_replay_sees_two_ranks_that_both_send_first_hang():
    both_send = [[("post", 0, "send", 1 - r), ("post", 1, "recv", 1 - r), ("wait", 0),
                  ("wait", 1)] for r in range(2)]
    assert _nccl_hang(both_send) is not None
    both_send[1][:2] = [("post", 1, "recv", 0), ("post", 0, "send", 0)]
    assert _nccl_hang(both_send) is None


# ---- the spawned checks (each runs on every rank of a cp group) -------------------------

def _check_ring(comm: Communicator) -> None:
    """Output and dq, dk, dv of the local parts against SDPA on the whole sequence."""
    seq = 24  # 2 x cp divides it for cp 1, 2, 4 (chunks of 3 at cp 4)
    for kernel in ring_kernels.KERNELS:
        for kv_heads, scale in ((2, None), (4, 0.2)):
            g = torch.Generator().manual_seed(7 + kv_heads)
            q = torch.randn(2, 4, seq, 8, generator=g, requires_grad=True)
            k, v = (torch.randn(2, kv_heads, seq, 8, generator=g, requires_grad=True)
                    for _ in range(2))
            dout = torch.randn(2, 4, seq, 8, generator=g)
            ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                 enable_gqa=kv_heads != 4)
            ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
            mine = [split_sequence(t.detach(), comm.size, comm.rank, dim=2).requires_grad_()
                    for t in (q, k, v)]
            out = ring_attention(*mine, comm, scale=scale, kernel=kernel)
            out.backward(split_sequence(dout, comm.size, comm.rank, dim=2))
            what = f"{kernel}, {kv_heads} kv heads"
            _close(out, split_sequence(ref.detach(), comm.size, comm.rank, dim=2),
                   f"{what}: out")
            for name, t, want in zip("qkv", mine, ref_grads, strict=True):
                _close(t.grad, split_sequence(want, comm.size, comm.rank, dim=2),
                       f"{what}: d{name}")


def _summed_grads(model: torch.nn.Module, comm: Communicator) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        grad = p.grad.clone()
        comm.all_reduce(grad)
        out[name] = grad
    return out


def _check_model_parity(comm: Communicator, full: torch.nn.Module, logits_of, loss_of,
                        targets: torch.Tensor) -> None:
    """The ring-attention copy of ``full`` on this rank's part of the inputs: its loss
    (``loss_of(logits, targets)``, summed over the tokens) summed over cp ranks, and
    every parameter's gradient summed over cp ranks, against ``full`` on the whole
    sequence. ``targets`` [2, 16] are aligned with the logits (shifted already)."""
    ids = torch.randint(1, 64, (2, 16), generator=torch.Generator().manual_seed(5))
    model = copy.deepcopy(full)
    apply_ring_attention(model, comm, seq_len=16)
    ref = loss_of(logits_of(full, ids, None), targets)
    ref.backward()
    part = functools.partial(split_sequence, cp=comm.size, rank=comm.rank)
    positions = local_positions(16, comm.size, comm.rank)
    loss = loss_of(logits_of(model, part(ids), positions), part(targets))
    loss.backward()
    total = loss.detach().clone()
    comm.all_reduce(total)
    grads = _summed_grads(model, comm)
    _close(total, ref.detach(), "summed loss")
    for name, p in full.named_parameters():
        _close(grads[name], p.grad, f"{name}.grad")


def _targets(ignored: int) -> torch.Tensor:
    """[2, 16] random targets, positions 0-2 of row 0 ignored."""
    targets = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(6))
    targets[0, :3] = ignored
    return targets


def _check_gpt(comm: Communicator) -> None:
    """disttrain's default loss (token_loss: summed cross-entropy)."""
    torch.manual_seed(0)
    full = GPT(ModelConfig(**{**TINY_MODEL, "n_head": 4}))
    _check_model_parity(comm, full, lambda m, ids, pos: m(ids, position_ids=pos),
                        lambda logits, t: token_loss(logits, t)[0], _targets(IGNORE_INDEX))


def _check_gpt_bf16(comm: Communicator) -> None:
    """Under bf16 autocast (q, k, v in bf16, the kernels' scores and the merge in
    fp32): the summed loss within 1e-2 relative and every gradient within 2e-2 of the
    one-process model under the same autocast (bf16 keeps 8 bits, 4e-3 relative per
    rounding, and the two round at different places; a wrong block moves the loss by
    more than 1e-1)."""
    torch.manual_seed(0)
    full = GPT(ModelConfig(**{**TINY_MODEL, "n_head": 4}))
    model = copy.deepcopy(full)
    apply_ring_attention(model, comm, seq_len=16)
    ids = torch.randint(1, 64, (2, 16), generator=torch.Generator().manual_seed(5))
    targets = _targets(IGNORE_INDEX)
    part = functools.partial(split_sequence, cp=comm.size, rank=comm.rank)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = token_loss(full(ids), targets)[0]
        loss = token_loss(model(part(ids), position_ids=local_positions(16, comm.size,
                                                                         comm.rank)),
                          part(targets))[0]
    ref.backward()
    loss.backward()
    total = loss.detach().clone()
    comm.all_reduce(total)
    grads = _summed_grads(model, comm)
    torch.testing.assert_close(total, ref.detach(), rtol=1e-2, atol=0)
    for name, p in full.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=2e-2, atol=2e-2,
                                   msg=lambda m, name=name: f"{name}.grad: {m}")


def _check_llama(comm: Communicator) -> None:
    """Labels in the Hugging Face convention, shifted over the whole sequence before
    the split (shift_labels); rotary positions from position_ids."""
    import transformers

    torch.manual_seed(0)
    full = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
        attn_implementation="sdpa"))

    def logits_of(model, ids, positions):
        if positions is None:
            return model(input_ids=ids).logits
        return model(input_ids=ids, position_ids=positions.expand(len(ids), -1)).logits

    def loss_of(logits, targets):
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100,
                               reduction="sum")

    _check_model_parity(comm, full, logits_of, loss_of, shift_labels(_targets(-100)))


def _check_nccl_order(comm: Communicator) -> None:
    """The messages of a forward and backward, replayed under NCCL's matching."""
    recording = _Recording(comm.group, CollectiveLedger(), name="cp")
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 8, 4, generator=g, requires_grad=True) for _ in range(3))
    ring_attention(q, k, v, recording).sum().backward()
    programs = comm.all_gather_object(recording.events)
    hang = _nccl_hang(programs)
    assert hang is None, f"the ring's messages hang under NCCL: {hang}"
    # forward: N-1 key/value passes; backward: N-1 again and N gradient passes (2 posts each)
    posts = sum(e[0] == "post" for e in recording.events)
    assert posts == (6 * comm.size - 4 if comm.size > 1 else 0), posts


class _Recording(Communicator):
    """A Communicator that logs each message it posts and each wait on one."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.events: list[tuple] = []

    def isend(self, tensor, dst, tag=0):
        return self._log(super().isend(tensor, dst, tag), "send", dst)

    def irecv(self, tensor, src, tag=0):
        return self._log(super().irecv(tensor, src, tag), "recv", src)

    def _log(self, work, kind, peer):
        n = len(self.events)
        self.events.append(("post", n, kind, peer))
        wait = work.wait

        def logged_wait():
            self.events.append(("wait", n))
            return wait()

        work.wait = logged_wait
        return work


CHECKS = {"ring": _check_ring, "gpt": _check_gpt, "gpt_bf16": _check_gpt_bf16,
          "llama": _check_llama,
          "nccl_order": _check_nccl_order}
SIZES = (4, 2, 1)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("check", list(CHECKS))
def test_ring_attention_equals_one_process_attention(check, size):
    pytest.importorskip("transformers")
    assert_check_passed(__name__, check, size, SIZES, "cp", timeout=240)
