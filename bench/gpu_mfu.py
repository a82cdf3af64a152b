"""Tokens/s and MFU of the built-in GPT at GPT-2-small shape on one GPU, in bf16: through
disttrain's Trainer, beside the same model trained by a plain PyTorch loop.

    python bench/gpu_mfu.py [--micro-batch 16] [--steps 30] [--warmup 10] [--vocab 50304]
                            [--compile] [--fused-loss on|off]

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
``disttrain.models.gpt.flops_per_token``) / the peak. Targets (issue 29): disttrain's
MFU >= 0.45 on an H100 and its tokens/s >= 0.95 of the plain loop's. Prints one JSON line;
with no CUDA device it prints one line on stderr and exits 2.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
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

TARGET_MFU = 0.45
TARGET_RATIO = 0.95  # disttrain's tokens/s over the plain loop's
DEVICE = torch.device("cuda", 0)  # --device cpu: the dry run (scripts/gpu_check.sh)


def _synchronize() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


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


def run_disttrain(cfg: ModelConfig, data: RandomWindows, args: argparse.Namespace
                  ) -> dict[str, float | str]:
    """The Trainer's tokens/s (median over the timed windows after the warmup) and
    the records' own MFU (median)."""
    from disttrain import Trainer

    clock = WindowClock(args.warmup, args.log_every)

    steps = args.warmup + args.steps
    config = load_config(values={
        "model": {k: getattr(cfg, k) for k in ("vocab_size", "seq_len", "n_layer",
                                                 "n_head", "d_model")},
        "train": {"steps": steps, "global_batch": args.micro_batch, "grad_accum": 1,
                  "lr": 6e-4, "warmup_steps": 0, "schedule": "constant",
                  "precision": "bf16", "log_every": args.log_every,
                  "device": DEVICE.type, "compile": args.compile,
                  "fused_loss": args.fused_loss == "on"},
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
    rates = clock.rates(args.micro_batch * cfg.seq_len)
    if not rates:
        raise SystemExit("gpu_mfu: no timed window after the warmup; raise --steps to "
                         "at least --log-every")
    return {"tokens_per_s": statistics.median(rates),
            "record_mfu": statistics.median(r["mfu"] for r in records),
            "peak_source": summary["peak_source"], "peak_tflops": summary["peak_tflops"],
            "device": trainer.runtime.device.type, "backend": trainer.runtime.backend}


def run_plain(cfg: ModelConfig, data: RandomWindows, args: argparse.Namespace) -> float:
    """The plain loop's tokens/s (median over windows of ``--log-every`` steps)."""
    model = _model(cfg).to(DEVICE)
    if args.compile:  # as train.compile does: each block compiled, the rest eager
        for block in model.blocks:
            block.compile()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2],
                              "weight_decay": 0.1},
                             {"params": [p for p in params if p.dim() < 2],
                              "weight_decay": 0.0}], lr=6e-4, betas=(0.9, 0.95), fused=True)
    batch = args.micro_batch

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
    return statistics.median(rates)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--micro-batch", type=int, default=16, help="samples per step (16)")
    p.add_argument("--steps", type=int, default=30, help="timed steps after warmup (30)")
    p.add_argument("--warmup", type=int, default=10, help="untimed first steps (10)")
    p.add_argument("--log-every", type=int, default=10, help="steps per timed window (10)")
    p.add_argument("--vocab", type=int, default=50304, help="vocabulary size (50304)")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per sample (1024)")
    p.add_argument("--n-layer", type=int, default=12, help="blocks (12)")
    p.add_argument("--d-model", type=int, default=768, help="width (768)")
    p.add_argument("--n-head", type=int, default=12, help="attention heads (12)")
    p.add_argument("--compile", action="store_true",
                   help="both sides compile each block (train.compile; block.compile())")
    p.add_argument("--fused-loss", choices=("on", "off"), default="off",
                   help="disttrain's train.fused_loss (off: the plain loop's loss, whole "
                   "logits)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (default); cpu only to dry-run this script at a tiny shape")
    return p.parse_args()


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
    data = RandomWindows((args.warmup + args.steps) * args.micro_batch, cfg.seq_len,
                         cfg.vocab_size)
    ours = run_disttrain(cfg, data, args)
    gc.collect()  # the Trainer's model and optimizer state (it holds reference cycles)
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()
    plain = run_plain(cfg, data, args)
    per_token = flops_per_token(cfg)
    # the plain loop is held to the same peak as the Trainer's records
    peak = ours["peak_tflops"] * 1e12
    plain_mfu = model_flops_utilisation(plain, per_token, peak, 1)
    ours_mfu = model_flops_utilisation(ours["tokens_per_s"], per_token, peak, 1)
    print(json.dumps({
        "bench": "gpu_mfu",
        "gpu": torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else "none (cpu)",
        "torch": torch.__version__, "precision": "bf16", "compile": args.compile,
        "disttrain_fused_loss": args.fused_loss == "on",
        "disttrain_device": ours["device"], "disttrain_backend": ours["backend"],
        "peak_tflops": round(ours["peak_tflops"], 3), "peak_source": ours["peak_source"],
        "model": {"n_layer": cfg.n_layer, "d_model": cfg.d_model, "n_head": cfg.n_head,
                  "seq_len": cfg.seq_len, "vocab_size": cfg.vocab_size,
                  "params": num_params(cfg)},
        "flops_per_token": per_token, "micro_batch": args.micro_batch,
        "tokens_per_step": args.micro_batch * cfg.seq_len, "steps": args.steps,
        "warmup": args.warmup,
        "disttrain_tokens_per_s": round(ours["tokens_per_s"], 1),
        "disttrain_mfu": round(ours_mfu, 4),
        "disttrain_record_mfu": round(ours["record_mfu"], 4),
        "plain_tokens_per_s": round(plain, 1), "plain_mfu": round(plain_mfu, 4),
        "disttrain_vs_plain": round(ours["tokens_per_s"] / plain, 4),
        "target_mfu": TARGET_MFU, "mfu_target_met": ours_mfu >= TARGET_MFU,
        "target_ratio": TARGET_RATIO,
        "ratio_target_met": ours["tokens_per_s"] / plain >= TARGET_RATIO}))


if __name__ == "__main__":
    main()
