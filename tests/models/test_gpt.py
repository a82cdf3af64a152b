"""The default GPT: shapes, causality, tied head, parameter and FLOP formulas."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from disttrain.config.schema import ModelConfig
from disttrain.models import GPT, IGNORE_INDEX, flops_per_token, num_params, token_loss

CFG = ModelConfig(vocab_size=64, seq_len=32, n_layer=2, n_head=4, d_model=64)


def test_shapes_and_tied_head():
    model = GPT(CFG)
    logits = model(torch.randint(0, 64, (3, 20)))
    assert logits.shape == (3, 20, 64)
    assert model.head.weight is model.tok_emb.weight


def test_causal_future_tokens_do_not_change_the_past():
    torch.manual_seed(0)
    model = GPT(CFG).eval()
    x = torch.randint(0, 64, (1, 16))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % 64
    torch.testing.assert_close(model(x)[0, :10], model(y)[0, :10])
    assert not torch.allclose(model(x)[0, 10:], model(y)[0, 10:])


@pytest.mark.parametrize("cfg", [CFG, ModelConfig()])
def test_num_params_formula(cfg):
    assert num_params(cfg) == sum(p.numel() for p in GPT(cfg).parameters())


def test_flops_formula_matches_torch_flop_counter():
    model = GPT(CFG)
    x = torch.randint(0, 64, (2, CFG.seq_len))
    counter = FlopCounterMode(display=False)
    # the math kernel spells attention out as matmuls the counter sees
    with counter, sdpa_kernel(SDPBackend.MATH):
        model(x).sum().backward()
    measured = counter.get_total_flops() / x.numel()
    expected = flops_per_token(CFG)
    # the formula leaves out elementwise work; the counter counts matmuls/attention only
    assert abs(measured - expected) / expected < 0.05, (measured, expected)


def test_token_loss_sums_and_counts_unmasked_targets():
    logits = torch.zeros(2, 3, 4)
    targets = torch.tensor([[1, IGNORE_INDEX, 2], [IGNORE_INDEX, IGNORE_INDEX, 3]])
    loss_sum, count = token_loss(logits, targets)
    assert count == 3
    torch.testing.assert_close(loss_sum, torch.tensor(3 * torch.log(torch.tensor(4.0)).item()))
