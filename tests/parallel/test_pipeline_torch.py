"""disttrain's pipeline against torch.distributed.pipelining: the two systems that
``bench/pp_vs_torch.py`` times train the same model.

Both are built by ``build_pair`` of ``bench/torch_pipeline.py``, the bench's own code: two copies of
the tiny GPT from one seed, one stage cut, an optimizer on each (plain SGD here, not
the bench's AdamW: Adam's update hardly changes when every gradient is scaled by one
factor, SGD's does, so a wrongly scaled loss shows in the next step's loss); every
schedule at pp = 2 runs a few steps on the same micro-batches (targets partly masked,
so the loss is normalised by a count that differs between micro-batches) in one shared
world.

Tolerance, rtol 1e-5 on each step's mean token loss and atol 1e-5 on every weight at
the end: both systems run the same modules on the same micro-batches; what may differ is
the order in which the micro-batches' gradients are summed into ``.grad`` (each
schedule's backward order, the tied embedding/head sum), which changes fp32 sums by
~1e-7 relative per step, and SGD (lr 0.5) keeps weight differences of that order over
4 steps. A real difference (a micro-batch dropped or counted twice, the
loss scaled by the micro-batch count as torch does by default, a tied gradient not
summed) moves the loss by 1e-3 or more after one update.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from support import TINY_MODEL, SyntheticTokens

from disttrain.config.schema import ModelConfig
from disttrain.targets import IGNORE_INDEX
from disttrain.testing import run_distributed

# the bench's own set-up (bench/ is not a package)
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

pytestmark = pytest.mark.slow  # spawns a world

STEPS = 4
MICRO_BATCH = 2
# (schedule, v, micro-batches) at pp = 2 on the 4-block tiny GPT
CASES = [("gpipe", 1, 4), ("1f1b", 1, 4), ("1f1b", 1, 2), ("interleaved", 2, 4)]
CFG = ModelConfig(**{**TINY_MODEL, "n_layer": 4})


def _micro_batches(m: int, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = SyntheticTokens(n=MICRO_BATCH * m, mask=True, seed=step)
    samples = [data[i] for i in range(MICRO_BATCH * m)]
    return [tuple(torch.stack([s[key] for s in samples[i: i + MICRO_BATCH]])
                  for key in ("input_ids", "targets"))
            for i in range(0, len(samples), MICRO_BATCH)]


def _case(comm, name: str, v: int, m: int) -> dict:
    """Each system's mean token loss per step and its weights after the last step."""
    from torch_pipeline import build_pair

    from disttrain.models import GPT, gpt_spec, token_loss
    from disttrain.parallel.pipeline import chunk_param_names

    def make_model() -> GPT:
        torch.manual_seed(0)
        return GPT(CFG)

    trainers = build_pair(make_model, gpt_spec(CFG), comm, schedule=name, m=m, v=v,
                          cuts=None, activation_shape=(MICRO_BATCH, CFG.seq_len,
                                                       CFG.d_model),
                          loss_fn=token_loss,
                          make_optimizer=lambda p: torch.optim.SGD(p, lr=0.5))
    out: dict = {"initial": {n: p.detach() for n, p in make_model().named_parameters()}}
    for trainer in trainers:
        losses = []
        for step in range(STEPS):
            stats = trainer.step(_micro_batches(m, step))
            totals = torch.tensor([stats.loss_sum, float(stats.count)], dtype=torch.float64)
            torch.distributed.all_reduce(totals)  # only the last stage's are non-zero
            losses.append((float(totals[0] / totals[1]), int(totals[1])))
        weights = {chunk_param_names(ch)[n]: p.detach().clone()
                   for ch in trainer.chunks for n, p in ch.named_parameters()}
        out[trainer.name] = {"losses": losses, "weights": weights}
    return out


def _parity_world(cases: list) -> list[dict]:
    from disttrain.comm import CollectiveLedger, Communicator

    comm = Communicator(None, CollectiveLedger(), name="pp")
    return [_case(comm, *case) for case in cases]


def test_torch_pipelining_trains_the_same_model():
    import torch_pipeline  # noqa: F401  (once, before the fork)

    results = run_distributed(_parity_world, 2, args=(CASES,), timeout=180)
    for rank, per_rank in enumerate(results):
        for case, got in zip(CASES, per_rank, strict=True):
            ours, theirs = got["disttrain"], got["torch"]
            counts = [c for _, c in ours["losses"]]
            assert counts == [c for _, c in theirs["losses"]], (case, counts)
            assert counts == [sum(int((t != IGNORE_INDEX).sum())
                                  for _, t in _micro_batches(case[2], s))
                              for s in range(STEPS)], (case, counts)
            torch.testing.assert_close(
                torch.tensor([x for x, _ in ours["losses"]]),
                torch.tensor([x for x, _ in theirs["losses"]]), rtol=1e-5, atol=0,
                msg=lambda msg, case=case: f"{case} losses: {msg}")
            assert ours["weights"].keys() == theirs["weights"].keys()
            for n, w in ours["weights"].items():
                torch.testing.assert_close(w, theirs["weights"][n], rtol=0, atol=1e-5,
                                           msg=lambda msg, n=n, r=rank, c=case:
                                           f"{c} rank {r} weight {n}: {msg}")
            moved = max(float((w - got["initial"][n]).abs().max())
                        for n, w in ours["weights"].items())
            assert moved > 1e-3, (case, moved)  # both trained, not merely stayed equal
