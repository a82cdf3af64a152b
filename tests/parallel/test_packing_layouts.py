"""Packed training under dp 2, tp 2 and pp 2 (and dp 2 ZeRO-3 with every block
recomputed in backward) against the same examples unpacked, in plain PyTorch, for the
built-in GPT and a tiny transformers Llama.

One spawned world of 2 ranks trains each (model, layout) with ``data.packing = true``
for one step over all 8 packed rows (26 examples of lengths 1 to 16, prompts masked)
with plain SGD at lr 1 (no momentum, decay or clipping), so each weight moves by
exactly its gradient of the step's mean loss. The reference runs every example alone,
padded to the row length, in one process: the summed cross-entropy of its trained
tokens over all examples, divided by their count, and its gradients.

The step's loss (the run's record) and the held-out loss before it (the same examples
given as held-out data, packed too) must equal the reference's within 1e-6 relative,
and each weight's change the reference gradient within 1e-5 absolute: the layouts and
the masked attention sum the same terms in other orders (~1e-8 here), while a token
that reads another example, a position that does not restart or a label counted across
a boundary moves the gradients by 1e-4 to 1e-2, and a wrong trained-token count scales
every gradient by at least 1 / 126.
"""

from __future__ import annotations

import pytest
import torch
from packing_support import BUILD, MODEL, examples, unpacked_loss
from support import full_state

from disttrain.monitor.callbacks import Callback
from disttrain.testing import run_distributed

pytestmark = pytest.mark.slow  # spawns a world: not in the quick check

pytest.importorskip("transformers")

ROWS = 8
# name -> (parallel, train settings beside TRAIN)
LAYOUTS = {"dp2": ({"dp": 2}, {}), "tp2": ({"tp": 2, "sequence_parallel": True}, {}),
           "pp2": ({"pp": 2, "pp_schedule": "1f1b"}, {}),
           "dp2-z3-ckpt": ({"dp": 2, "zero": 3}, {"activation_checkpointing": "full"})}
CASES = [(family, name) for family in BUILD for name in LAYOUTS]
TRAIN = {"steps": 1, "global_batch": ROWS, "grad_accum": 2, "optimizer": "sgd",
         "momentum": 0.0, "lr": 1.0, "weight_decay": 0.0, "grad_clip": 0.0,
         "warmup_steps": 0, "schedule": "constant", "log_every": 1}


class _Losses(Callback):
    """The step's loss and the held-out loss before it (rank 0)."""

    def __init__(self) -> None:
        self.losses: list[float | None] = []
        self.first_eval: float | None = None

    def on_step_end(self, trainer, record) -> None:
        self.losses.append(record.loss)

    def on_eval(self, trainer, step, eval_loss) -> None:
        if step == 0:
            self.first_eval = eval_loss


def _fit_cases(root: str) -> dict:
    """Each case in turn: (the full model's weights after the step, the step's loss, the
    held-out loss before it, on the same examples packed) on global rank 0, (None, [],
    None) elsewhere."""
    from disttrain import Trainer

    out = {}
    for family, name in CASES:
        parallel, train = dict(LAYOUTS[name][0]), LAYOUTS[name][1]
        if family == "llama":  # sequence parallelism is the built-in GPT's only
            parallel.pop("sequence_parallel", None)
        losses = _Losses()
        trainer = Trainer(BUILD[family](), examples(), eval_dataset=examples(), config={
            "model": MODEL, "data": {"packing": True}, "train": {**TRAIN, **train},
            "parallel": parallel, "checkpoint": {"every": 0},
            "monitor": {"peak_tflops": 1.0}},
            run_dir=f"{root}/{family}-{name}", progress=False, callbacks=[losses])
        trainer.fit()
        full = full_state(trainer.parallel)
        out[(family, name)] = ({k: v.clone() for k, v in full.items()}
                               if full is not None else None, losses.losses,
                               losses.first_eval)
    return out


@pytest.fixture(scope="module")
def fitted(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("packing")
    return run_distributed(_fit_cases, 2, args=(str(root),), timeout=300)[0]


def _reference(family: str) -> tuple[float, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(mean loss, initial weights, gradients) of every example unpacked."""
    model = BUILD[family]()
    start = {k: v.detach().clone() for k, v in model.named_parameters()}
    loss_sum, count = unpacked_loss(model, examples())
    (loss_sum / count).backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    return float(loss_sum.detach()) / count, start, grads


@pytest.mark.parametrize("family, name", CASES)
def test_a_packed_step_equals_the_examples_trained_unpacked(fitted, family, name):
    weights, losses, first_eval = fitted[(family, name)]
    loss, start, grads = _reference(family)
    assert weights is not None and len(losses) == 1
    assert losses[0] == pytest.approx(loss, rel=1e-6)
    assert first_eval == pytest.approx(loss, rel=1e-6)  # held out: the same rows'
    assert set(grads) <= set(weights)
    for k, grad in grads.items():
        torch.testing.assert_close(start[k] - weights[k], grad, atol=1e-5, rtol=0,
                                   msg=lambda m, k=k: f"{family} {name}: {k}: {m}")
