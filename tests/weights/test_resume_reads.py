"""Resuming reads only this rank's part of a checkpoint: at tp 2 each rank reads the
pieces of the matrices it holds (and their optimizer state) and the replicated tensors,
about half of what was saved, and the resumed run continues the one-process trajectory
(the resume tests of tests/parallel/test_hybrid.py hold the weights equal)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from support import SyntheticTokens

from disttrain import Callback
from disttrain.testing import run_distributed

MODEL = {"vocab_size": 64, "seq_len": 16, "n_layer": 2, "n_head": 4, "d_model": 64}


class Reads(Callback):
    all_ranks = True

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_start(self, trainer) -> None:
        Path(f"{self.path}.rank{trainer.rank}").write_text(json.dumps(
            {"read": trainer.checkpoints.bytes_read, "start": trainer.start_step}))


def _fit(run_dir: str, steps: int) -> None:
    from disttrain import Trainer
    from disttrain.config import load_config
    from disttrain.data import collate_token_batch
    from disttrain.models import GPT, token_loss

    cfg = load_config(values={
        "model": MODEL, "train": {"steps": steps, "global_batch": 8, "eval_samples": 8,
                                  "log_every": 1},
        "parallel": {"tp": 2}, "checkpoint": {"every": 2, "async": False},
        "monitor": {"peak_tflops": 1.0}})
    with torch.device("meta"):
        model = GPT(cfg.model)
    Trainer(model, SyntheticTokens(), token_loss, cfg, collate_fn=collate_token_batch,
            run_dir=run_dir, progress=False, callbacks=[Reads(run_dir)]).fit()


def test_a_tp_rank_resumes_from_its_own_pieces(tmp_path):
    run_dir = str(tmp_path / "run")
    run_distributed(_fit, 2, args=(run_dir, 2), timeout=120)
    saved = sum(f.stat().st_size for f in (tmp_path / "run" / "checkpoints").rglob(
        "*.safetensors"))
    run_distributed(_fit, 2, args=(run_dir, 3), timeout=120)
    for rank in (0, 1):
        figures = json.loads(Path(f"{run_dir}.rank{rank}").read_text())
        assert figures["start"] == 2
        # matrices (and their Adam moments) are half per rank; norms, biases, the
        # position embedding are whole: well under the whole, well over nothing
        assert 0.35 * saved < figures["read"] < 0.65 * saved, (figures, saved)
