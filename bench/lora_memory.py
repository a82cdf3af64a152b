"""LoRA against full fine-tuning: per-rank optimizer-state bytes and peak memory.

    python bench/lora_memory.py [--d-model 2048] [--n-layer 2] [--rank 16]
                                [--layout 1,1,2] [--zero 0] [--steps 3]

The same GPT (built on the meta device and filled by the seeded initialiser, as the
command line builds it) trains for ``--steps`` steps through the Trainer at the same
layout twice, in one set of Gloo ranks: every weight trained (AdamW), then LoRA rank
``--rank`` on the attention and MLP projections (``model.lora_rank``, the rest frozen).
Per rank: the optimizer's state bytes and the model-state bytes after the first step
(``GradSync.model_state_bytes``: parameters, gradients, optimizer), and the CPU
allocator's peak above the start over the whole ``fit()`` (bench/cpu_memory.py: model,
optimizer, activations; the same definition as the other CPU benches). Prints one JSON
line; ``optimizer_ratio`` is the largest rank's LoRA optimizer bytes over its full
fine-tuning ones (target: < 0.02).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_memory import peak_bytes  # noqa: E402 (the bench folder's own module)

from disttrain import Callback  # noqa: E402
from disttrain.testing import run_distributed  # noqa: E402

TARGET_OPTIMIZER_RATIO = 0.02


class RandomTokens(Dataset):
    """Random token windows: {"input_ids", "targets"} of ``seq_len`` each."""

    def __init__(self, n: int, seq_len: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, vocab, (n, seq_len + 1), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i, :-1], "targets": self.tokens[i, 1:]}


class FirstStep(Callback):
    """Keeps this rank's model-state bytes after the first step."""

    all_ranks = True

    def __init__(self) -> None:
        self.memory: dict[str, int] = {}

    def on_step_end(self, trainer: Any, record: Any) -> None:
        if not self.memory:
            self.memory = dict(trainer.run.memory())


def _fit(args: dict[str, Any], lora_rank: int, run_dir: str) -> dict[str, Any]:
    from disttrain import Trainer
    from disttrain.config import load_config
    from disttrain.data import collate_token_batch
    from disttrain.models import GPT, token_loss

    dp, pp, tp = args["layout"]
    model = {"vocab_size": 256, "seq_len": args["seq_len"], "n_layer": args["n_layer"],
             "n_head": args["n_head"], "d_model": args["d_model"], "lora_rank": lora_rank}
    config = load_config(values={
        "model": model,
        "train": {"steps": args["steps"], "global_batch": 4 * dp, "grad_accum": 2,
                  "warmup_steps": 0, "eval_every": args["steps"], "eval_samples": 4 * dp,
                  "log_every": args["steps"]},
        "parallel": {"dp": dp, "pp": pp, "tp": tp, "zero": args["zero"]},
        "checkpoint": {"every": 0}, "monitor": {"peak_tflops": 1.0}})
    with torch.device("meta"):
        gpt = GPT(config.model)
    first = FirstStep()
    trainer = Trainer(gpt, RandomTokens(64, args["seq_len"], 256), token_loss, config,
                      collate_fn=collate_token_batch, run_dir=run_dir, progress=False,
                      callbacks=[first])
    peak, _ = peak_bytes(trainer.fit)
    trainable = sum(p.numel() for p in gpt.parameters() if p.requires_grad)
    return {"optimizer_bytes": first.memory["optimizer"], "model_state": first.memory,
            "peak_bytes": peak, "trainable": trainable}


def _both(args: dict[str, Any], root: str) -> dict[str, Any]:
    return {"full": _fit(args, 0, f"{root}/full"),
            "lora": _fit(args, args["rank"], f"{root}/lora")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--layout", default="1,1,2", help="dp,pp,tp")
    p.add_argument("--zero", type=int, default=0)
    p.add_argument("--steps", type=int, default=3)
    ns = p.parse_args()
    layout = tuple(int(x) for x in ns.layout.split(","))
    args = {"d_model": ns.d_model, "n_layer": ns.n_layer, "n_head": ns.n_head,
            "seq_len": ns.seq_len, "rank": ns.rank, "layout": layout, "zero": ns.zero,
            "steps": ns.steps}
    world = layout[0] * layout[1] * layout[2]
    with tempfile.TemporaryDirectory() as root:
        ranks = run_distributed(_both, world, args=(args, root), timeout=1800)
    full = [r["full"] for r in ranks]
    lora = [r["lora"] for r in ranks]
    pairs = list(zip(full, lora, strict=True))
    ratio = max(b["optimizer_bytes"] / a["optimizer_bytes"] for a, b in pairs)
    peak = max(b["peak_bytes"] / a["peak_bytes"] for a, b in pairs)
    print(json.dumps({
        "bench": "lora_memory", "model": {k: args[k] for k in
                                          ("d_model", "n_layer", "n_head", "seq_len")},
        "layout": {"dp": layout[0], "pp": layout[1], "tp": layout[2], "zero": ns.zero},
        "lora_rank": ns.rank, "trainable_rank0": {"full": full[0]["trainable"],
                                            "lora": lora[0]["trainable"]},
        "optimizer_bytes_per_rank": {"full": [r["optimizer_bytes"] for r in full],
                                     "lora": [r["optimizer_bytes"] for r in lora]},
        "peak_bytes_per_rank": {"full": [r["peak_bytes"] for r in full],
                                "lora": [r["peak_bytes"] for r in lora]},
        "model_state_per_rank": {"full": [r["model_state"] for r in full],
                                 "lora": [r["model_state"] for r in lora]},
        "optimizer_ratio": ratio, "peak_ratio": peak,
        "target_optimizer_ratio": TARGET_OPTIMIZER_RATIO,
        "meets_target": ratio < TARGET_OPTIMIZER_RATIO}))


if __name__ == "__main__":
    main()
