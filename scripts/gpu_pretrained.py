"""GPU check, section ``pretrained``: a pretrained directory loaded under ZeRO-3.

    python scripts/gpu_pretrained.py [--layers 8] [--width 1024] [--device cuda]

Saves a random transformers Llama (``--layers`` x ``--width``, vocabulary 32,000) with
``save_pretrained`` in bf16, then trains 2 steps from it with disttrain on one rank
(world 1, ZeRO-3, model built on meta and filled from the files on the device), and
prints one JSON line: the device memory peak (``torch.cuda.max_memory_allocated``)
against the model's fp32 bytes, the held-out loss before training and the one
transformers computes from the same files on the same samples (equal to ~1e-4 in fp32).
On the CPU (``--device cpu``, the dry run) the memory peak is not measured.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    from torch.utils.data import Dataset
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from disttrain import Trainer
    from disttrain.data import collate_token_batch
    from disttrain.weights import pretrained_model

    class Tokens(Dataset):
        def __len__(self) -> int:
            return 32

        def __getitem__(self, i: int) -> dict:
            t = torch.randint(0, 32000, (129,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": t[:-1], "targets": t[1:]}

    with tempfile.TemporaryDirectory() as root:
        directory = Path(root) / "llama"
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(
            vocab_size=32000, hidden_size=args.width, intermediate_size=4 * args.width,
            num_hidden_layers=args.layers, num_attention_heads=args.width // 64,
            num_key_value_heads=args.width // 128, max_position_embeddings=128,
            tie_word_embeddings=False)).to(torch.bfloat16).save_pretrained(directory)
        model = pretrained_model(str(directory))
        fp32 = 4 * sum(p.numel() for p in model.parameters())
        on_gpu = args.device == "cuda" and torch.cuda.is_available()
        if on_gpu:
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        trainer = Trainer(model, Tokens(), None, {
            "train": {"steps": 2, "global_batch": 4, "eval_samples": 4,
                      "device": args.device, "lr": 1e-30},
            "parallel": {"zero": 3}, "checkpoint": {"every": 0},
            "monitor": {"peak_tflops": 1.0}},
            eval_dataset=Tokens(), collate_fn=collate_token_batch,
            run_dir=f"{root}/run", progress=False, pretrained=str(directory))
        summary = trainer.fit()
        seconds = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated() if on_gpu else None
        reference = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        batch = collate_token_batch([Tokens()[i] for i in range(4)])
        with torch.no_grad():
            logits = reference(batch["input_ids"]).logits
        expected = float(torch.nn.functional.cross_entropy(logits.flatten(0, 1),
                                                           batch["targets"].flatten()))
    print(json.dumps({
        "check": "pretrained", "device": args.device, "model_fp32_gb": round(fp32 / 1e9, 3),
        "gpu_peak_gb": None if peak is None else round(peak / 1e9, 3),
        "gpu_peak_x_model": None if peak is None else round(peak / fp32, 3),
        "initial_eval_loss": summary["initial_eval_loss"], "transformers_loss": expected,
        "loss_difference": abs(summary["initial_eval_loss"] - expected),
        "seconds": round(seconds, 1)}))


if __name__ == "__main__":
    main()
