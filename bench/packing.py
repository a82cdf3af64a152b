"""Tokens of real content per step, packed rows over padded ones, on examples of a skewed
length distribution; and the step time of the two.

    python bench/packing.py [--seq-len 512] [--examples 4000] [--micro-batch 8]

The examples' lengths are log-normal (median ``--median`` tokens, sigma 1), clipped to
1 .. seq_len: most are short, a few fill a row, as instruction data is. Padded, each
example is one row of ``seq_len`` tokens; packed (``data.packing``), the rows are
:class:`~disttrain.data.packing.PackedExamples`' (best fit, longest first). At the
same ``train.global_batch`` (rows per step), the tokens of real content per step are
in the ratio of the rows each needs: ``real_tokens_ratio`` = padded rows / packed rows.

The step: the built-in GPT (``--d-model``, ``--layers``) forward and backward on one
micro-batch of ``--micro-batch`` rows, packed (position ids restarting, the
block-diagonal attention mask of the document ids) and padded (plain causal attention),
alternated ``--reps`` times after a warm-up; the medians' ratio is ``step_time_ratio``
and ``real_tokens_per_s_ratio`` = real_tokens_ratio / step_time_ratio. One JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from disttrain.config.schema import ModelConfig
from disttrain.data.packing import PackedCollate, PackedExamples
from disttrain.models import GPT, gpt_spec
from disttrain.train.batch import causal_lm_loss


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--examples", type=int, default=4000)
    p.add_argument("--median", type=float, default=48.0, help="median example length")
    p.add_argument("--micro-batch", type=int, default=8, help="rows per timed step")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--reps", type=int, default=5, help="timed steps per variant")
    return p.parse_args()


def skewed_examples(n: int, median: float, seq_len: int) -> list[dict[str, torch.Tensor]]:
    """``n`` examples with log-normal lengths (median ``median``, sigma 1) in 1 .. seq_len;
    the first quarter of each (its prompt) not trained."""
    g = torch.Generator().manual_seed(0)
    lengths = (torch.randn(n, generator=g).exp() * median).round().clamp(1, seq_len).long()
    out = []
    for length in lengths.tolist():
        ids = torch.randint(1, 256, (length,), generator=g)
        labels = ids.clone()
        labels[: length // 4] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def padded_batch(examples: list[dict[str, torch.Tensor]], seq_len: int
                 ) -> dict[str, torch.Tensor]:
    """One example per row, right-padded (id 0, labels -100)."""
    ids = torch.zeros(len(examples), seq_len, dtype=torch.long)
    labels = torch.full((len(examples), seq_len), -100, dtype=torch.long)
    for row, ex in enumerate(examples):
        n = len(ex["input_ids"])
        ids[row, :n], labels[row, :n] = ex["input_ids"], ex["labels"]
    return {"input_ids": ids, "labels": labels}


def step_seconds(model: GPT, batch: dict[str, torch.Tensor]) -> float:
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    started = time.perf_counter()
    loss, count = causal_lm_loss(model(**inputs), batch["labels"])
    (loss / count.clamp(min=1)).backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - started


def main() -> None:
    args = parse_args()
    examples = skewed_examples(args.examples, args.median, args.seq_len)
    lengths = sorted(len(e["input_ids"]) for e in examples)
    packed = PackedExamples(examples, args.seq_len, seed=1234)
    rows_packed, rows_padded = len(packed), len(examples)
    print(f"{rows_padded} examples ({packed.tokens} tokens) -> {rows_packed} packed rows",
          file=sys.stderr, flush=True)
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=256, seq_len=args.seq_len, n_layer=args.layers,
                            n_head=4, d_model=args.d_model))
    b = args.micro_batch
    batches = {"packed": PackedCollate(gpt_spec(model.cfg).packed_inputs)(
                   [packed[r] for r in range(b)]),
               "padded": padded_batch(examples[:b], args.seq_len)}
    times: dict[str, list[float]] = {name: [] for name in batches}
    for rep in range(args.reps + 1):  # the first of each is a warm-up
        for name, batch in batches.items():
            seconds = step_seconds(model, batch)
            if rep:
                times[name].append(seconds)
    median = {name: statistics.median(t) for name, t in times.items()}
    tokens_ratio = rows_padded / rows_packed
    time_ratio = median["packed"] / median["padded"]
    print(json.dumps({
        "bench": "packing", "seq_len": args.seq_len, "examples": rows_padded,
        "tokens": packed.tokens,
        "length_median": lengths[len(lengths) // 2], "length_mean":
            round(packed.tokens / rows_padded, 1), "length_max": lengths[-1],
        "rows_packed": rows_packed, "rows_padded": rows_padded,
        "real_tokens_per_row_packed": round(packed.tokens / rows_packed, 1),
        "real_tokens_per_row_padded": round(packed.tokens / rows_padded, 1),
        "fill_packed": round(packed.tokens / (rows_packed * args.seq_len), 4),
        "fill_padded": round(packed.tokens / (rows_padded * args.seq_len), 4),
        "real_tokens_ratio": round(tokens_ratio, 3),
        "micro_batch": b, "step_s_packed": round(median["packed"], 4),
        "step_s_padded": round(median["padded"], 4),
        "step_time_ratio": round(time_ratio, 3),
        "real_tokens_per_s_ratio": round(tokens_ratio / time_ratio, 3),
    }))


if __name__ == "__main__":
    main()
