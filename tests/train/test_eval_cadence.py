"""Held-out evaluation cadence: ``train.eval_every = 0`` (the default) evaluates about
ten times a run, on logged steps, so the report's held-out curve has points."""

from __future__ import annotations

import json

import pytest
import torch
from support import SyntheticTokens, tiny_config

from disttrain.train.step import eval_interval


@pytest.mark.parametrize("eval_every, steps, log_every, interval", [
    (0, 250, 10, 30), (0, 40, 10, 10), (0, 5, 10, 10), (0, 20, 5, 5), (0, 1000, 1, 100),
    (7, 250, 10, 7), (250, 250, 10, 250)])
def test_eval_interval(eval_every, steps, log_every, interval):
    assert eval_interval(eval_every, steps, log_every) == interval


def _eval_steps(run_dir, **train) -> tuple[list[int], list[int]]:
    """(logged steps, steps with a held-out loss) of a tiny run."""
    from disttrain import Trainer
    from disttrain.data import collate_token_batch
    from disttrain.models import GPT, token_loss

    cfg = tiny_config(**train)
    torch.manual_seed(cfg.train.seed)
    Trainer(GPT(cfg.model), SyntheticTokens(), token_loss, cfg, run_dir=run_dir,
            eval_dataset=SyntheticTokens(16, seed=1), collate_fn=collate_token_batch,
            progress=False).fit()
    records = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in records], [r["step"] for r in records if "eval_loss" in r]


def test_the_default_evaluates_on_logged_steps_about_ten_times(tmp_path):
    logged, evaluated = _eval_steps(tmp_path, steps=30, log_every=5)
    assert logged == list(range(5, 31, 5))  # evaluations add no records
    assert evaluated == logged  # 30 // 10 = 3 steps, rounded up to log_every
