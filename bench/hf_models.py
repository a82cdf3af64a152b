"""Hugging Face models under disttrain's data parallelism against torch DDP, same run.

    python bench/hf_models.py [--reps 5] [--steps 10] [--hidden 256] [--layers 4]

Two Gloo ranks hold identically initialised copies of a small ``LlamaForCausalLM`` and
``GPT2LMHeadModel`` (built from configs, random weights). disttrain's side is its own
step path on an HF batch: the mapping batch as keyword arguments, the causal-LM loss
over the counted label tokens (no loss_fn), the bucketed overlapped all-reduce
(``apply_data_parallel``), AdamW. torch's side is DDP at its best settings here
(``gradient_as_bucket_view``, the same bucket size) with HF's own mean loss (``labels=``).
Repetitions alternate so drifting load hits both alike; a step's time is the slower
rank's. Prints one JSON line: median step times, the ratio per family, and
``hf_dp_vs_ddp`` (the worse of the two ratios).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
from collections.abc import Callable

import torch
import torch.distributed as dist
from dp_vs_ddp import WARMUP_STEPS, _time_steps  # the same timing as the GPT bench
from torch.nn.parallel import DistributedDataParallel

from disttrain.comm import CollectiveLedger, Communicator
from disttrain.parallel.ddp import apply_data_parallel
from disttrain.testing import run_distributed
from disttrain.train.batch import loss_sum_and_terms, split_batch

Step = Callable[[dict], None]


def _model(family: str, hidden: int, layers: int, vocab: int, seq: int) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if family == "gpt2":
        return GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=hidden,
                                          n_layer=layers, n_head=4, bos_token_id=0,
                                          eos_token_id=0))
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden,
                                        intermediate_size=4 * hidden,
                                        num_hidden_layers=layers, num_attention_heads=4,
                                        num_key_value_heads=2, max_position_embeddings=seq,
                                        bos_token_id=0, eos_token_id=0))


def _batches(vocab: int, seq: int, micro_batch: int, n: int = 4) -> list[tuple[dict]]:
    """``n`` HF batches per rank, each a 1-tuple (the timing loop unpacks it)."""
    g = torch.Generator().manual_seed(1000 + dist.get_rank())
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (micro_batch, seq), generator=g)
        out.append(({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                     "labels": ids.clone()},))
    return out


def _disttrain_step(model: torch.nn.Module, bucket_mb: float, global_count: int) -> Step:
    dp = apply_data_parallel(model, Communicator(None, CollectiveLedger()),
                             bucket_mb=bucket_mb)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)

    def step(raw: dict) -> None:
        batch = split_batch(raw)
        dp.zero_grad()
        loss_sum, _, _ = loss_sum_and_terms(None, batch.run(model), batch)
        loss_sum.backward()
        dp.finish_gradient_sync(1.0 / global_count)
        opt.step()
    return step


def _ddp_step(model: torch.nn.Module, bucket_mb: float) -> Step:
    ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_mb,
                                  gradient_as_bucket_view=True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)

    def step(raw: dict) -> None:
        opt.zero_grad()
        ddp(**raw).loss.backward()
        opt.step()
    return step


def _bench(args: argparse.Namespace) -> dict:
    out = {}
    for family in ("llama", "gpt2"):
        ours_model = _model(family, args.hidden, args.layers, args.vocab, args.seq_len)
        ddp_model = copy.deepcopy(ours_model)
        count = args.micro_batch * (args.seq_len - 1) * dist.get_world_size()
        runners = {"disttrain": _disttrain_step(ours_model, args.bucket_mb, count),
                   "ddp": _ddp_step(ddp_model, args.bucket_mb)}
        batches = _batches(args.vocab, args.seq_len, args.micro_batch)
        for step in runners.values():
            _time_steps(step, batches, WARMUP_STEPS)
        times: dict[str, list[float]] = {name: [] for name in runners}
        for _ in range(args.reps):
            for name, step in runners.items():
                times[name] += _time_steps(step, batches, args.steps)
        out[family] = {**times, "params": sum(p.numel() for p in ours_model.parameters())}
    return out


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=5, help="alternating repetitions (default 5)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per repetition")
    p.add_argument("--bucket-mb", type=float, default=4.0, help="bucket size, MiB, both")
    p.add_argument("--hidden", type=int, default=256, help="model width (default 256)")
    p.add_argument("--layers", type=int, default=4, help="blocks (default 4)")
    p.add_argument("--vocab", type=int, default=1024, help="vocabulary (default 1024)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sample")
    p.add_argument("--micro-batch", type=int, default=8, help="samples per rank per step")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    result = run_distributed(_bench, 2, timeout=1800, args=(args,))[0]
    line = {"bench": "hf_models", "world_size": 2, "backend": "gloo",
            "bucket_mb": args.bucket_mb, "steps": args.steps, "reps": args.reps,
            "machine": f"{os.cpu_count()} cpu cores"}
    ratios = []
    for family, r in result.items():
        ours, ddp = statistics.median(r["disttrain"]), statistics.median(r["ddp"])
        ratios.append(ours / ddp)
        line |= {f"{family}_disttrain_step_s": round(ours, 5),
                 f"{family}_ddp_step_s": round(ddp, 5),
                 f"{family}_ratio": round(ours / ddp, 4), f"{family}_params": r["params"]}
    line["hf_dp_vs_ddp"] = round(max(ratios), 4)
    print(json.dumps(line))


if __name__ == "__main__":
    main()
