"""The run summary's memory figures agree with the estimator."""

from __future__ import annotations

import json

from support import SyntheticTokens

from disttrain import Trainer
from disttrain.data import collate_token_batch
from disttrain.models import GPT, token_loss
from disttrain.plan import estimate_gpt
from disttrain.run_checks import resolve
from disttrain.testing import run_distributed


def _config():
    """The default model's shape (at the tiny one, fixed-size overheads dominate)."""
    from disttrain.config import load_config
    return load_config(values={"train": {"steps": 2, "global_batch": 8, "log_every": 1},
                               "checkpoint": {"every": 0}})


def _fit_summary(run_dir: str) -> dict:
    cfg = _config()
    data = SyntheticTokens(n=32, seq_len=cfg.model.seq_len, vocab=cfg.model.vocab_size)
    Trainer(GPT(cfg.model), data, token_loss, cfg, run_dir=run_dir,
            collate_fn=collate_token_batch, progress=False).fit()
    return json.loads((__import__("pathlib").Path(run_dir) / "summary.json").read_text())


def test_summary_memory_matches_the_estimate(tmp_path):
    summary = run_distributed(_fit_summary, 2, args=(str(tmp_path),), timeout=120)[0]
    cfg = _config()
    plan = resolve(cfg, 2)
    est = estimate_gpt(cfg.model, micro_batch=plan.batch.micro_batch, replicas=2, zero=0)
    measured = summary["memory_bytes"]
    for part in ("params", "grads", "optimizer"):
        assert measured[part] == getattr(est, part)
    assert abs(measured["activations"] - est.activations) <= 0.1 * est.activations
    last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["memory_mb"]["optimizer"] * 2**20 == measured["optimizer"]
