"""Loading a pretrained directory at tp x pp, against reading its file sequentially.

    python bench/load_pretrained.py [--layers 12] [--width 1024] [--world 4]

Writes a transformers Llama directory (``--layers`` x ``--width``, vocabulary 32,000:
about 1 GB of fp32 at the defaults; random values, ``config.json`` + one
``model.safetensors``), warms the page cache with it, and measures in the same run:

- ``sequential``: one process reading the whole file start to end from the page cache
  (64 MiB reads into one reused buffer), the file's bytes over that time; and
  ``sequential_fresh``: the same into newly allocated memory of the file's size (the
  first touch of new pages is most of a load's cost on a CPU);
- ``load``: ``--world`` ranks at tp 2 x pp (world / 2) starting a run from it (model
  built on meta, each rank reading only the boxes it holds with ``get_slice`` and
  filling its part): the file's bytes over the slowest rank's fill time
  (``Parallelized.fill``), and each rank's bytes read.

Prints one JSON line with the ratios load / sequential (the target is at least 0.5) and
load / sequential_fresh.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from disttrain.testing import run_distributed


def _write(directory: Path, layers: int, width: int) -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    from disttrain.checkpoint.stream import write_streamed

    config = LlamaConfig(vocab_size=32000, hidden_size=width, intermediate_size=4 * width,
                         num_hidden_layers=layers, num_attention_heads=width // 64,
                         num_key_value_heads=width // 128, max_position_embeddings=256,
                         tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    config.save_pretrained(directory)
    entries = [(n, tuple(p.shape), torch.float32) for n, p in model.named_parameters()]
    generator = torch.Generator().manual_seed(0)
    write_streamed(directory / "model.safetensors", entries,
                   lambda n: torch.randn(dict((e[0], e[1]) for e in entries)[n],
                                         generator=generator) * 0.02,
                   {"format": "pt"})
    return (directory / "model.safetensors").stat().st_size


def _sequential(path: Path) -> float:
    buffer = bytearray(64 << 20)
    view = memoryview(buffer)
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(view):
            pass
    return time.perf_counter() - start


def _sequential_fresh(path: Path) -> float:
    """The same read into newly allocated memory the size of the file (as loading
    must: the weights need memory of their own, and its first touch costs)."""
    start = time.perf_counter()
    out = torch.empty(path.stat().st_size, dtype=torch.uint8)
    view = memoryview(out.numpy())
    with open(path, "rb", buffering=0) as f:
        done = 0
        while done < len(view):
            got = f.readinto(view[done:done + (64 << 20)])
            if not got:
                break
            done += got
    return time.perf_counter() - start


def _load(directory: str, tp: int, pp: int) -> dict:
    from torch.utils.data import Dataset

    from disttrain import Callback, Trainer
    from disttrain.data import collate_token_batch
    from disttrain.parallel.compose import Parallelized
    from disttrain.weights import pretrained_model

    timed: dict[str, float] = {}
    fill = Parallelized.fill

    def timed_fill(self, source, optimizer) -> None:
        start = time.perf_counter()
        fill(self, source, optimizer)
        timed["fill_s"] = time.perf_counter() - start
        timed["read_bytes"] = source.bytes_read

    Parallelized.fill = timed_fill

    class Tokens(Dataset):
        def __len__(self) -> int:
            return 16

        def __getitem__(self, i: int) -> dict:
            t = torch.randint(0, 32000, (17,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": t[:-1], "targets": t[1:]}

    class Stop(Callback):
        all_ranks = True

        def on_train_start(self, trainer) -> None:
            raise KeyboardInterrupt  # measured: no need to train

    config = {"train": {"steps": 1, "global_batch": 4, "grad_accum": 2, "eval_samples": 2},
              "parallel": {"tp": tp, "pp": pp}, "checkpoint": {"every": 0},
              "monitor": {"peak_tflops": 1.0}}
    with tempfile.TemporaryDirectory() as run_dir:
        try:
            Trainer(pretrained_model(directory), Tokens(), None, config,
                    collate_fn=collate_token_batch, run_dir=run_dir, progress=False,
                    pretrained=directory, callbacks=[Stop()]).fit()
        except KeyboardInterrupt:
            pass
    return timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--world", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        directory = Path(root) / "llama"
        size = _write(directory, args.layers, args.width)
        _sequential(directory / "model.safetensors")  # into the page cache
        seq_s = min(_sequential(directory / "model.safetensors") for _ in range(3))
        fresh_s = min(_sequential_fresh(directory / "model.safetensors") for _ in range(3))
        ranks = run_distributed(_load, args.world, args=(str(directory), 2, args.world // 2),
                                timeout=1200)
    load_s = max(r["fill_s"] for r in ranks)
    print(json.dumps({
        "bench": "load_pretrained", "file_gb": round(size / 1e9, 3), "world": args.world,
        "layout": f"tp2 x pp{args.world // 2}",
        "sequential_gb_per_s": round(size / seq_s / 1e9, 3),
        "load_gb_per_s": round(size / load_s / 1e9, 3),
        "load_vs_sequential": round(seq_s / load_s, 3), "target": 0.5,
        "sequential_fresh_gb_per_s": round(size / fresh_s / 1e9, 3),
        "load_vs_sequential_fresh": round(fresh_s / load_s, 3),
        "fill_s_per_rank": [round(r["fill_s"], 3) for r in ranks],
        "read_gb_per_rank": [round(r["read_bytes"] / 1e9, 3) for r in ranks]}))


if __name__ == "__main__":
    main()
