"""ZeRO stages 1-3 against the single-process oracle."""

from __future__ import annotations

import pytest
from support import fit_tiny
from test_data_parallel import assert_states_close, reference_train

from disttrain.testing import run_distributed

VARIANTS = [{"grad_accum": 1, "grad_clip": 1.0}, {"grad_accum": 2, "grad_clip": 0.0}]


def _zero_runs(stage: int, run_dir: str) -> list[dict]:
    return [fit_tiny(20, f"{run_dir}/{i}", mask=True, zero=stage, **v)
            for i, v in enumerate(VARIANTS)]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_follows_single_process(stage, world_size, tmp_path):
    results = run_distributed(_zero_runs, world_size, args=(stage, str(tmp_path)),
                              timeout=240)
    for variant, state in zip(VARIANTS, results[0]):
        assert_states_close(state, reference_train(20, mask=True, **variant))
    for other in results[1:]:  # every rank ends with the same full parameters
        for mine, theirs in zip(results[0], other):
            assert_states_close(theirs, mine, atol=0)


def _measure(stage: int) -> dict:
    """Model-state bytes on this rank after two ZeRO steps on a bigger tiny GPT."""
    import torch
    import torch.distributed as dist
    from support import SyntheticTokens

    from disttrain.comm import CollectiveLedger, Communicator
    from disttrain.data import collate_token_batch
    from disttrain.models import GPT, num_params, token_loss
    from disttrain.parallel.zero import apply_zero

    from support import tiny_config
    cfg = tiny_config()
    model_cfg = cfg.model.__class__(**{**cfg.model.__dict__, "d_model": 64, "n_layer": 4})
    torch.manual_seed(0)
    model = GPT(model_cfg)
    names = {id(p): n for n, p in model.named_parameters()}
    zero = apply_zero(model, Communicator(None, CollectiveLedger()), stage, names)
    opt = torch.optim.AdamW(zero.param_groups(0.1), lr=1e-3)
    batch = collate_token_batch([SyntheticTokens()[i] for i in range(4)])
    for _ in range(2):
        zero.zero_grad()
        loss, count = token_loss(model(batch["input_ids"]), batch["targets"])
        loss.backward()
        zero.finish_gradient_sync(1 / count)
        zero.clip_grad_norm(1.0)
        opt.step()
        zero.after_optimizer_step()
    return {**zero.model_state_bytes(opt), "psi": num_params(model_cfg),
            "world": dist.get_world_size()}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_model_state_bytes_follow_the_zero_formulas(stage):
    from disttrain.plan import model_state_bytes

    measured = run_distributed(_measure, 4, args=(stage,), timeout=120)[1]
    expected = model_state_bytes(measured["psi"], dp=4, zero=stage)
    for part in ("params", "grads", "optimizer"):
        want = getattr(expected, part)
        assert abs(measured[part] - want) <= 0.1 * want, (part, measured[part], want)
