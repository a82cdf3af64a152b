"""Activation checkpointing, mixed precision and loss scaling."""

from __future__ import annotations

import pytest
import torch
from support import SyntheticTokens, fit_tiny, tiny_config

from disttrain.checkpoint.state import model_tensors
from disttrain.data import collate_token_batch
from disttrain.models import GPT, token_loss
from disttrain.parallel.activation import apply_activation_checkpointing, canonical_name
from disttrain.testing import run_distributed
from disttrain.train.precision import LossScaler


def _grads(mode: str, k: int = 2) -> tuple[dict, list[str], list[str]]:
    cfg = tiny_config()
    torch.manual_seed(0)
    model = GPT(cfg.model.__class__(**{**cfg.model.__dict__, "n_layer": 3}))
    keys_before = list(model.state_dict())
    apply_activation_checkpointing(model, mode, k)
    batch = collate_token_batch([SyntheticTokens(mask=True)[i] for i in range(6)])
    loss_sum, count = token_loss(model(batch["input_ids"]), batch["targets"])
    (loss_sum / count).backward()
    grads = {canonical_name(n): p.grad for n, p in model.named_parameters()}
    return grads, keys_before, list(model.state_dict())


@pytest.mark.parametrize("mode", ["full", "every_k"])
def test_activation_checkpointing_gives_the_same_gradients(mode):
    reference, keys, _ = _grads("none")
    grads, _, keys_after = _grads(mode)
    assert keys_after == keys  # state-dict names do not change
    assert grads.keys() == reference.keys()
    for name in reference:
        torch.testing.assert_close(grads[name], reference[name], rtol=0, atol=1e-6)


def test_checkpointed_blocks_are_recomputed_not_stored():
    cfg = tiny_config()
    model = GPT(cfg.model)
    assert apply_activation_checkpointing(model, "full") == cfg.model.n_layer
    assert apply_activation_checkpointing(model, "full") == 0  # idempotent
    assert all(n.startswith("model/") and "checkpointed" not in n
               for n in model_tensors(model))


def test_loss_scaler_skips_overflow_and_grows():
    scaler = LossScaler(True, init_scale=8.0, growth_interval=2)
    yes, no = torch.tensor(True), torch.tensor(False)
    scaler.update(overflow=yes, counted=yes)  # an overflow halves the scale
    scaler.count_skipped(True)
    assert float(scaler.scale) == 4.0 and scaler.skipped == 1
    scaler.update(overflow=no, counted=yes)
    assert float(scaler.scale) == 4.0
    scaler.update(overflow=no, counted=yes)  # growth_interval good steps: doubled
    assert float(scaler.scale) == 8.0
    scaler.update(overflow=yes, counted=no)  # a non-finite loss: not the scaler's
    assert float(scaler.scale) == 8.0
    off = LossScaler(False)  # disabled: no scale, never skips
    off.update(overflow=yes, counted=yes)
    off.count_skipped(True)
    assert off.scale is None and off.skipped == 0


def test_bf16_training_and_bf16_gradient_reduction_stay_close_to_fp32(tmp_path):
    fp32 = run_distributed(fit_tiny, 2, args=(5, str(tmp_path / "a")), timeout=120)[0]
    bf16 = run_distributed(fit_tiny, 2, args=(5, str(tmp_path / "b")), timeout=180,
                           kwargs={"precision": "bf16", "grad_reduce_dtype": "bf16"})[0]
    for name in fp32:
        assert torch.isfinite(bf16[name]).all()
        torch.testing.assert_close(bf16[name], fp32[name], rtol=0, atol=2e-2)
    moved = max((bf16[n] - fp32[n]).abs().max().item() for n in fp32)
    assert moved > 0  # bf16 really ran
