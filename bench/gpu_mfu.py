"""Tokens/s and MFU of the built-in GPT at GPT-2-small shape on one GPU, in bf16: through
disttrain's Trainer, beside the same model trained by a plain PyTorch loop.

    python bench/gpu_mfu.py [--micro-batch 16 [32 ...]] [--fused-loss off [on]]
                            [--steps 15] [--warmup 5] [--log-every 5] [--repeats 2]
                            [--vocab 50304] [--compile]

The model is ``disttrain.models.GPT`` with 12 layers, d_model 768, 12 heads, seq_len
1024 and a vocabulary of 50,304 (GPT-2's 50,257 rounded up to a multiple of 128, as
nanoGPT does; not the default corpus's 256 bytes, whose tiny head would make it another
model), tied head, no dropout: 124M parameters. The data are random token windows, the
same for both (content does not change the work). Both sides run bf16 autocast, AdamW
(fused; disttrain builds it fused on a GPU), weight decay 0.1 on matrices, clipping at
1.0, one micro-batch of ``--micro-batch`` x 1024 tokens per step, eager unless
``--compile`` (then both compile each block, as ``train.compile`` does):

- disttrain: ``Trainer`` on one rank (the runtime picks cuda and NCCL), checkpoints and
  TensorBoard off, a metrics record every ``--log-every`` steps, ``train.fused_loss``
  as ``--fused-loss`` says (default off: the same loss as the plain loop's, the
  logits whole; on: the fused linear + cross-entropy); its tokens/s is the
  median over windows of ``--log-every`` steps after ``--warmup``, each timed by the
  wall clock from one ``torch.cuda.synchronize()`` to the next in a callback at the
  window's last step (as the plain loop is timed, everything between the steps
  included); the peak is the one the Trainer resolved (``peak_source``: the GPU's
  published dense bf16 peak when disttrain's table knows the GPU, else a matmul
  measured at start), and the records' own MFU is reported beside
  (``disttrain_record_mfu``);
- plain: the same model, identically initialised, in a loop of ``model(x)``,
  ``F.cross_entropy`` (mean), backward, ``clip_grad_norm_``, ``AdamW(fused=True).step()``;
  tokens/s is the median over windows of ``--log-every`` steps after the warmup, each
  timed from one ``torch.cuda.synchronize()`` to the next.

MFU = tokens/s x the model's training FLOPs per token (6 x the matmul parameters, the
head included, plus the attention scores and weighted sums, as
``disttrain.models.gpt.flops_per_token``) / the peak. Memory: each side's
``torch.cuda.max_memory_allocated`` over its whole run (model, optimizer state, steps),
the peak statistics reset before it.

One process measures every ``--micro-batch`` x ``--fused-loss`` pair and prints one JSON
line per pair. Runs alternate, ``--repeats`` times per micro-batch: the plain loop, then
disttrain in each fused-loss mode, then the plain loop again, ..., so that a drift of
the card (clocks, temperature) falls on both sides of every pair; each side's tokens/s is
the median over its runs, the pair's ratio the ratio of those medians, and every
repetition's own ratio is printed beside (``disttrain_vs_plain_runs``). Targets (issue 38), in the
line's ``targets``: with the plain loop's loss (fused off), disttrain's tokens/s >= 1.00
of the plain loop's, eager and compiled; with the fused loss, >= 1.10 of it, its GPU
memory peak <= 0.80 of the plain loop's, and (compiled) MFU >= 0.40. With no CUDA device
it prints one line on stderr and exits 2.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from disttrain import Callback
from disttrain.config import load_config
from disttrain.config.schema import ModelConfig
from disttrain.data import collate_token_batch
from disttrain.models import GPT, num_params, token_loss
from disttrain.models.gpt import flops_per_token
from disttrain.monitor.peaks import model_flops_utilisation

# issue 38's targets: disttrain's tokens/s over the plain loop's, with the same loss and
# with the fused one; the fused run's memory peak over the plain loop's; compiled MFU
TARGET_SAME_LOSS = 1.00
TARGET_FUSED = 1.10
TARGET_FUSED_MEMORY = 0.80
TARGET_COMPILED_MFU = 0.40
DEVICE = torch.device("cuda", 0)  # --device cpu: the dry run (scripts/gpu_check.sh)


def _synchronize() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def _reset_peak() -> None:
    """Free what the previous side left, then start a new peak."""
    gc.collect()  # the Trainer's model and optimizer state (it holds reference cycles)
    if DEVICE.type == "cuda":
        torch.cuda.init()  # the allocator's statistics exist only once CUDA has started
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(DEVICE)


def _peak_mib() -> float | None:
    return torch.cuda.max_memory_allocated(DEVICE) / 2**20 if DEVICE.type == "cuda" else None


class RandomWindows(Dataset):
    """``n`` random token windows, generated once: {"input_ids", "targets"} of [T]."""

    def __init__(self, n: int, seq_len: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, vocab, (n, seq_len + 1), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i, :-1], "targets": self.tokens[i, 1:]}


def _model(cfg: ModelConfig) -> GPT:
    torch.manual_seed(0)
    return GPT(cfg)


class WindowClock(Callback):
    """A callback: the wall time of each window of ``every`` steps after ``warmup``,
    the device synchronised at each window's edges."""

    def __init__(self, warmup: int, every: int) -> None:
        self.warmup, self.every = warmup, every
        self.edges: list[tuple[int, float]] = []

    def on_step_end(self, trainer, record) -> None:  # noqa: ANN001
        if record.step >= self.warmup and (record.step - self.warmup) % self.every == 0:
            _synchronize()
            self.edges.append((record.step, time.perf_counter()))

    def rates(self, tokens_per_step: int) -> list[float]:
        return [(s1 - s0) * tokens_per_step / (t1 - t0)
                for (s0, t0), (s1, t1) in zip(self.edges, self.edges[1:], strict=False)]


def run_disttrain(cfg: ModelConfig, data: RandomWindows, args: argparse.Namespace,
                  micro_batch: int, fused: bool) -> dict[str, float | str]:
    """The Trainer's tokens/s (median over the timed windows after the warmup), the
    records' own MFU (median) and the run's GPU memory peak."""
    from disttrain import Trainer

    clock = WindowClock(args.warmup, args.log_every)

    steps = args.warmup + args.steps
    config = load_config(values={
        "model": {k: getattr(cfg, k) for k in ("vocab_size", "seq_len", "n_layer",
                                                 "n_head", "d_model")},
        "train": {"steps": steps, "global_batch": micro_batch, "grad_accum": 1,
                  "lr": 6e-4, "warmup_steps": 0, "schedule": "constant",
                  "precision": "bf16", "log_every": args.log_every,
                  "device": DEVICE.type, "compile": args.compile,
                  "fused_loss": fused},
        "checkpoint": {"every": 0}, "monitor": {"tensorboard": False}})
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(_model(cfg), data, token_loss, config, run_dir=run_dir,
                          collate_fn=collate_token_batch, progress=False,
                          callbacks=[clock])
        summary = trainer.fit()
        lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    records = [r for r in map(json.loads, lines) if r["step"] > args.warmup]
    if not records:
        raise SystemExit("gpu_mfu: no metrics record after the warmup; raise --steps "
                         "above --log-every")
    rates = clock.rates(micro_batch * cfg.seq_len)
    if not rates:
        raise SystemExit("gpu_mfu: no timed window after the warmup; raise --steps to "
                         "at least --log-every")
    return {"tokens_per_s": statistics.median(rates),
            "record_mfu": statistics.median(r["mfu"] for r in records),
            "peak_source": summary["peak_source"], "peak_tflops": summary["peak_tflops"],
            "device": trainer.runtime.device.type, "backend": trainer.runtime.backend,
            "memory_peak_mib": _peak_mib()}


def run_plain(cfg: ModelConfig, data: RandomWindows, args: argparse.Namespace,
              micro_batch: int) -> tuple[float, float | None]:
    """The plain loop's tokens/s (median over windows of ``--log-every`` steps) and its
    GPU memory peak (MiB)."""
    model = _model(cfg).to(DEVICE)
    if args.compile:  # as train.compile does: each block compiled, the rest eager
        for block in model.blocks:
            block.compile()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2],
                              "weight_decay": 0.1},
                             {"params": [p for p in params if p.dim() < 2],
                              "weight_decay": 0.0}], lr=6e-4, betas=(0.9, 0.95), fused=True)
    batch = micro_batch

    def step(i: int) -> None:
        rows = data.tokens[[(i * batch + j) % len(data) for j in range(batch)]]
        x, y = rows[:, :-1].to(DEVICE), rows[:, 1:].to(DEVICE)
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    for i in range(args.warmup):
        step(i)
    rates = []
    for start in range(args.warmup, args.warmup + args.steps, args.log_every):
        n = min(args.log_every, args.warmup + args.steps - start)
        _synchronize()
        t0 = time.perf_counter()
        for i in range(start, start + n):
            step(i)
        _synchronize()
        rates.append(n * batch * cfg.seq_len / (time.perf_counter() - t0))
    return statistics.median(rates), _peak_mib()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--micro-batch", type=int, nargs="+", default=[16],
                   help="samples per step, one or more (16)")
    p.add_argument("--steps", type=int, default=15,
                   help="timed steps after warmup, per run (15)")
    p.add_argument("--warmup", type=int, default=5, help="untimed first steps, per run (5)")
    p.add_argument("--log-every", type=int, default=5, help="steps per timed window (5)")
    p.add_argument("--repeats", type=int, default=2,
                   help="runs of each side, alternated plain, disttrain, plain, ... (2)")
    p.add_argument("--vocab", type=int, default=50304, help="vocabulary size (50304)")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per sample (1024)")
    p.add_argument("--n-layer", type=int, default=12, help="blocks (12)")
    p.add_argument("--d-model", type=int, default=768, help="width (768)")
    p.add_argument("--n-head", type=int, default=12, help="attention heads (12)")
    p.add_argument("--compile", action="store_true",
                   help="both sides compile each block (train.compile; block.compile())")
    p.add_argument("--fused-loss", choices=("on", "off"), nargs="+", default=["off"],
                   help="disttrain's train.fused_loss, one or both (off: the plain loop's "
                   "loss, whole logits)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (default); cpu only to dry-run this script at a tiny shape")
    args = p.parse_args()
    if args.repeats < 1:
        p.error(f"--repeats {args.repeats}: needs at least 1 run of each side; use 2")
    return args


def main() -> None:
    global DEVICE
    args = parse_args()
    if args.device == "cpu":
        DEVICE = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("gpu_mfu: no CUDA device: this benchmark needs one GPU", file=sys.stderr)
        sys.exit(2)
    cfg = ModelConfig(vocab_size=args.vocab, seq_len=args.seq_len, n_layer=args.n_layer,
                      n_head=args.n_head, d_model=args.d_model, dropout=0.0)
    for micro_batch in args.micro_batch:
        data = RandomWindows((args.warmup + args.steps) * micro_batch, cfg.seq_len,
                             cfg.vocab_size)
        plain: list[tuple[float, float | None]] = []
        ours: dict[bool, list[dict]] = {fused == "on": [] for fused in args.fused_loss}
        # plain, disttrain (each fused mode), plain, disttrain, ...: every pair alternates
        for _ in range(args.repeats):
            _reset_peak()
            plain.append(run_plain(cfg, data, args, micro_batch))
            for fused, runs in ours.items():
                _reset_peak()
                runs.append(run_disttrain(cfg, data, args, micro_batch, fused))
        for fused, runs in ours.items():
            print(json.dumps(_line(cfg, args, micro_batch, fused, runs, plain)), flush=True)


def _medians(runs: list[dict], plain: list[tuple[float, float | None]]
             ) -> tuple[dict, float, float | None]:
    """disttrain's runs as one (median tokens/s and record MFU, largest memory peak),
    the plain loop's median tokens/s and its largest memory peak."""
    ours = runs[0] | {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
                      "record_mfu": statistics.median(r["record_mfu"] for r in runs),
                      "memory_peak_mib": _largest(r["memory_peak_mib"] for r in runs)}
    return (ours, statistics.median(rate for rate, _ in plain),
            _largest(peak for _, peak in plain))


def _largest(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def _line(cfg: ModelConfig, args: argparse.Namespace, micro_batch: int, fused: bool,
          runs: list[dict], plain_runs: list[tuple[float, float | None]]) -> dict:
    """One pair's JSON line: both sides' figures (medians over the repetitions), their
    ratio (of the medians; each repetition's beside), the targets and whether each was
    met."""
    ours, plain, plain_peak = _medians(runs, plain_runs)
    per_token = flops_per_token(cfg)
    peak = ours["peak_tflops"] * 1e12  # the plain loop is held to the Trainer's peak
    plain_mfu = model_flops_utilisation(plain, per_token, peak, 1)
    ours_mfu = model_flops_utilisation(ours["tokens_per_s"], per_token, peak, 1)
    ratio = ours["tokens_per_s"] / plain
    memory = (ours["memory_peak_mib"] / plain_peak
              if ours["memory_peak_mib"] and plain_peak else None)
    targets: dict[str, dict] = {"vs_plain": {
        "want": TARGET_FUSED if fused else TARGET_SAME_LOSS, "got": round(ratio, 4),
        "met": ratio >= (TARGET_FUSED if fused else TARGET_SAME_LOSS)}}
    if fused:
        targets["memory_vs_plain"] = {
            "want": TARGET_FUSED_MEMORY, "got": None if memory is None else round(memory, 4),
            "met": memory is not None and memory <= TARGET_FUSED_MEMORY}
        if args.compile:
            targets["mfu"] = {"want": TARGET_COMPILED_MFU, "got": round(ours_mfu, 4),
                              "met": ours_mfu >= TARGET_COMPILED_MFU}
    return {
        "bench": "gpu_mfu",
        "gpu": torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else "none (cpu)",
        "torch": torch.__version__, "precision": "bf16", "compile": args.compile,
        "disttrain_fused_loss": fused,
        "disttrain_device": ours["device"], "disttrain_backend": ours["backend"],
        "peak_tflops": round(ours["peak_tflops"], 3), "peak_source": ours["peak_source"],
        "model": {"n_layer": cfg.n_layer, "d_model": cfg.d_model, "n_head": cfg.n_head,
                  "seq_len": cfg.seq_len, "vocab_size": cfg.vocab_size,
                  "params": num_params(cfg)},
        "flops_per_token": per_token, "micro_batch": micro_batch,
        "tokens_per_step": micro_batch * cfg.seq_len, "steps": args.steps,
        "warmup": args.warmup,
        "disttrain_tokens_per_s": round(ours["tokens_per_s"], 1),
        "disttrain_mfu": round(ours_mfu, 4),
        "disttrain_record_mfu": round(ours["record_mfu"], 4),
        "disttrain_memory_peak_mib": ours["memory_peak_mib"],
        "plain_tokens_per_s": round(plain, 1), "plain_mfu": round(plain_mfu, 4),
        "plain_memory_peak_mib": plain_peak,
        "disttrain_vs_plain": round(ratio, 4), "repeats": len(runs),
        "disttrain_tokens_per_s_runs": [round(r["tokens_per_s"], 1) for r in runs],
        "plain_tokens_per_s_runs": [round(rate, 1) for rate, _ in plain_runs],
        "disttrain_vs_plain_runs": [round(r["tokens_per_s"] / rate, 4)
                                    for r, (rate, _) in zip(runs, plain_runs, strict=True)],
        "memory_vs_plain": None if memory is None else round(memory, 4),
        "targets": targets, "targets_met": all(t["met"] for t in targets.values())}


if __name__ == "__main__":
    main()
