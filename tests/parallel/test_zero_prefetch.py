"""ZeRO-3's working set: blocks gathered at once (forward, backward, evaluation) held to
1 + ``prefetch``, unsharded gradients freed once reduce-scattered, and the trajectory
the same at every prefetch depth as plain PyTorch's."""

from __future__ import annotations

import copy

import pytest
import torch
from support import tiny_config

from disttrain.errors import ConfigError
from disttrain.testing import run_distributed

pytestmark = pytest.mark.slow  # spawns a world

PREFETCH = (0, 1, 2)
N_LAYER, STEPS, LR = 4, 2, 1e-2


def _batches(vocab: int, seq_len: int) -> list[torch.Tensor]:
    """Per step: the global batch [4, seq_len + 1] (rank r takes rows 2r, 2r + 1)."""
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (4, seq_len + 1), generator=g) for _ in range(STEPS)]


def _reference(model: torch.nn.Module, batches: list[torch.Tensor]) -> dict:
    """Plain PyTorch on one process: the mean loss over the whole global batch."""
    from disttrain.models import token_loss

    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    for tokens in batches:
        opt.zero_grad()
        loss, count = token_loss(model(tokens[:, :-1]), tokens[:, 1:])
        (loss / count).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


class Census:
    """Block units with parameters materialised (storage not freed), and block units with
    an unsharded gradient alive (filling, or travelling in a reduce-scatter), read at every
    block hook and every gradient, per phase (the largest seen); and the parameters
    whose gradient, as autograd accumulated it, was a tensor of its own rather than a
    view of its flat's gradient buffer."""

    def __init__(self) -> None:
        self.zero = None
        self.most: dict[str, int] = {}
        self.grads = 0
        self.own_grads: set[str] = set()

    def watch_grads(self, model) -> None:
        """Before ZeRO is applied: these hooks run before ZeRO's own, which may reduce
        the gradient (and release ``.grad``) at once."""
        for name, p in model.named_parameters():
            p.register_post_accumulate_grad_hook(lambda p, name=name: self.check(name, p))

    def check(self, name: str, p: torch.nn.Parameter) -> None:
        flat, _ = self.zero._slot[id(p)]
        buffer = flat.grad_flat
        if buffer is None or p.grad is None or (p.grad.untyped_storage().data_ptr()
                                                != buffer.untyped_storage().data_ptr()):
            self.own_grads.add(name)

    def look(self, phase: str) -> None:
        z = self.zero
        units = {f.unit for f in z.flats + z.frozen_flats
                 if not f.root and f.full.untyped_storage().nbytes() > 0}
        self.most[phase] = max(self.most.get(phase, 0), len(units))
        # blocks only: a root unit's gradient (the tied embedding and head's) fills
        # for the whole backward, its head's part being the first
        alive = ({f.unit for f in z.flats if f.grad_flat is not None and not f.root}
                 | {f.unit for f, *_ in z.reducer.in_flight if not f.root})
        self.grads = max(self.grads, len(alive))

    def watch(self, blocks) -> None:
        def phase() -> str:
            return "forward" if torch.is_grad_enabled() else "eval"
        for block in blocks:  # registered after ZeRO's own: they see its gathers, frees
            block.register_forward_pre_hook(lambda m, a: self.look(phase()))
            block.register_forward_hook(lambda m, a, o: self.look(phase()))
            block.register_full_backward_pre_hook(lambda m, g: self.look("backward"))
            block.register_full_backward_hook(lambda m, gi, go: self.look("backward"))
            for p in block.parameters():
                p.register_post_accumulate_grad_hook(lambda p: self.look("backward"))


def _runs() -> list[dict]:
    """Each prefetch depth: two ZeRO-3 steps and an evaluation, its census, and its
    largest parameter difference from the plain run (on rank 0's view); then the same
    with the accelerator forms of the collectives (one all-gather, a reduce-scatter:
    what NCCL runs) instead of the CPU's in-place ones, at ZeRO-3 and ZeRO-2."""
    from disttrain.parallel.zero import hooks

    out = [_run(3, prefetch) for prefetch in PREFETCH]
    hooks.CPU_FORMS = False
    try:
        out += [_run(stage, 1) for stage in (3, 2)]
    finally:
        hooks.CPU_FORMS = True
    return out


def _run(stage: int, prefetch: int) -> dict:
    from dataclasses import replace

    from disttrain.comm import CollectiveLedger, Communicator
    from disttrain.models import GPT, token_loss
    from disttrain.parallel.zero import apply_zero

    cfg = replace(tiny_config().model, n_layer=N_LAYER)
    batches = _batches(cfg.vocab_size, cfg.seq_len)
    torch.manual_seed(0)
    model = GPT(cfg)
    want = _reference(copy.deepcopy(model), batches)
    names = {id(p): n for n, p in model.named_parameters()}
    comm = Communicator(None, CollectiveLedger())
    census = Census()
    census.watch_grads(model)
    census.zero = zero = apply_zero(model, comm, stage, names, prefetch=prefetch)
    if stage == 3:
        census.watch(model.blocks)
    opt = torch.optim.AdamW(zero.param_groups(0.0), lr=LR)
    for tokens in batches:
        mine = tokens[2 * comm.rank:2 * comm.rank + 2]
        zero.zero_grad()
        loss, _ = token_loss(model(mine[:, :-1]), mine[:, 1:])
        loss.backward()
        zero.finish_gradient_sync(1.0 / tokens[:, 1:].numel())
        opt.step()
        zero.after_optimizer_step()
    with torch.no_grad():
        model(batches[0][:, :-1])
    zero.finalize()  # every rank gathers the trained parameters whole
    diff = max(float((p.detach() - want[n]).abs().max())
               for n, p in model.named_parameters())
    return {"most": census.most, "grads": census.grads, "diff": diff,
            "own_grads": sorted(census.own_grads), "checked": len(names)}


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_distributed(_runs, 2, timeout=180)[0]


@pytest.mark.parametrize("prefetch", PREFETCH)
def test_blocks_gathered_at_once_are_one_plus_prefetch(runs, prefetch):
    most = runs[PREFETCH.index(prefetch)]["most"]
    # forward and evaluation reach the bound (the prefetch happens), never pass it
    assert most["forward"] == 1 + prefetch, most
    assert most["eval"] == 1 + prefetch, most
    assert 1 <= most["backward"] <= 1 + prefetch, most


@pytest.mark.parametrize("prefetch", PREFETCH)
def test_unsharded_gradients_are_freed_once_reduced(runs, prefetch):
    # one block's gradient at a time, filling or travelling: on a CPU group a block's
    # backward waits for the reduction before it (elsewhere it may still travel: 2)
    assert runs[PREFETCH.index(prefetch)]["grads"] == 1


@pytest.mark.parametrize("prefetch", PREFETCH)
def test_gradients_accumulate_in_the_flat_buffer(runs, prefetch):
    # every parameter's gradient, blocks' and root's (the tied embedding and head,
    # positions, final norm), lands in its flat's buffer: no tensor of its own beside it
    run = runs[PREFETCH.index(prefetch)]
    assert run["checked"] > 4 * N_LAYER and run["own_grads"] == []


@pytest.mark.parametrize("prefetch", PREFETCH)
def test_every_prefetch_follows_plain_pytorch(runs, prefetch):
    # fp32 AdamW after two steps; the difference is summation order (reduce-scatter of
    # two ranks' partial gradients against one backward over the whole batch), ~1e-7
    # relative, amplified by Adam's division in the first steps: 1e-5 absolute allows it
    assert runs[PREFETCH.index(prefetch)]["diff"] < 1e-5


@pytest.mark.parametrize("stage", [3, 2])
def test_the_accelerator_collectives_follow_plain_pytorch(runs, stage):
    # NCCL's forms (all-gather, reduce-scatter, a reduction overlapping the next
    # block's backward) run on the CPU too: the same trajectory (same tolerance)
    assert runs[len(PREFETCH) + (3, 2).index(stage)]["diff"] < 1e-5


def test_zero_prefetch_outside_zero_3_is_refused_in_one_line():
    from disttrain.run_checks import resolve

    with pytest.raises(ConfigError) as err:
        resolve(tiny_config(zero=2, zero_prefetch=2), 2)
    assert err.value.field == "parallel.zero_prefetch" and err.value.value == 2
    assert "\n" not in str(err.value) and "set parallel.zero=3" in err.value.fix
