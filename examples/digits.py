"""Train a small CNN on scikit-learn's bundled 8x8 handwritten digits with disttrain.

    python examples/digits.py                                  # one process
    disttrain run --nproc 2 examples/digits.py --steps 100     # two data-parallel ranks

The 1,797 images are shuffled with a fixed seed; the last 20% are held out. After
training, rank 0 prints the held-out accuracy and writes it to ``accuracy.json`` in the
run directory (next to the Trainer's ``summary.json``). Needs scikit-learn (no download).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import disttrain

HELD_OUT_FRACTION = 0.2
SPLIT_SEED = 0


class DigitsDataset(Dataset):
    """images: [N, 1, 8, 8] float in [0, 1]; labels: [N] int64 in 0..9."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[i], self.labels[i]


def load_digits_split() -> tuple[DigitsDataset, DigitsDataset]:
    """(train, held-out): a fixed-seed shuffle, then the last 20% held out."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:  # one line from rank 0, not a traceback from every rank
        if int(os.environ.get("RANK", "0")) == 0:
            print("digits.py needs scikit-learn: pip install scikit-learn (from a disttrain "
                  "checkout: pip install -e '.[examples]')", file=sys.stderr)
        raise SystemExit(2) from None

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(SPLIT_SEED))
    images, labels = images[order], labels[order]
    cut = len(labels) - int(len(labels) * HELD_OUT_FRACTION)
    return (DigitsDataset(images[:cut], labels[:cut]),
            DigitsDataset(images[cut:], labels[cut:]))


class DigitsCNN(nn.Module):
    """[B, 1, 8, 8] -> conv 3x3 (16) -> conv 3x3 (32) -> pool to 4x4 -> MLP -> logits [B, 10]."""

    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, hidden)
        self.fc2 = nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


@torch.no_grad()
def accuracy(model: nn.Module, data: DigitsDataset) -> float:
    model.eval()
    predicted = model(data.images).argmax(dim=1)
    return float((predicted == data.labels).float().mean())


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300, help="optimizer steps (default 300)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    p.add_argument("--global-batch", type=int, default=64,
                   help="samples per step over all ranks (default 64)")
    p.add_argument("--run-dir", default=None,
                   help="where summary.json, metrics and accuracy.json go (default runs/<time>)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    train_set, held_out = load_digits_split()
    torch.manual_seed(1234)  # rank 0's initial weights are broadcast to the others anyway
    model = DigitsCNN()
    config = {"train": {"steps": args.steps, "global_batch": args.global_batch,
                        "lr": args.lr, "warmup_steps": min(20, args.steps // 10),
                        "eval_samples": len(held_out), "log_every": 50}}
    trainer = disttrain.Trainer(model, train_set, F.cross_entropy, config,
                                eval_dataset=held_out, run_dir=args.run_dir)
    summary = trainer.fit()
    # fit() may have destroyed the process group it created; every rank holds the
    # trained weights, so rank 0 evaluates locally.
    if int(os.environ.get("RANK", "0")) == 0:
        acc = accuracy(model, held_out)
        print(f"held-out accuracy {acc:.3f}")
        (Path(summary["run_dir"]) / "accuracy.json").write_text(
            json.dumps({"held_out_accuracy": acc, "held_out_samples": len(held_out),
                        "steps": args.steps}) + "\n")


if __name__ == "__main__":
    main()
