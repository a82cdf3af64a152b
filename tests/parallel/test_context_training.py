"""Context parallelism through the Trainer: every layout follows one plain process.

The built-in GPT (learned positions) and a tiny transformers Llama (rotary positions,
grouped-query attention: 2 key/value heads for 4 query heads, ``labels`` with -100 and
an all-ones ``attention_mask``) train 4 steps at cp 2, cp 4, cp 2 x tp 2 (the GPT also
with sequence parallelism), cp 2 x dp 2 under ZeRO-3 and cp 2 x pp 2 (1F1B), and must
end with the weights of a plain single-process PyTorch loop on the same samples per step
(AdamW, constant LR, clipping, the loss summed over every counted token of the global
batch and divided by their number); the held-out loss at the end must be the plain
model's on the same held-out samples. A checkpoint saved at cp 2 after 2 steps resumes
at cp 1 (dp 2), at cp 4 and at cp 2 x dp 2 under ZeRO-3 on the same trajectory.

Samples hide a different number of their first targets, so the ranks of a cp group
count different numbers of tokens: a loss normalised per rank, or per cp group, would
move the weights. atol 1e-5: the layouts sum the same terms in other orders (the ring
merges attention blocks on their log-sum-exp; micro-batches, shards and ranks add
their parts in other orders): fp32 rounding of ~1e-7 per step, which AdamW's
normalised steps of lr 3e-3 keep well below 1e-5 over 4 steps, while a wrong position,
a missing block of keys, a dk/dv not carried home or a loss normalised per rank moves
weights by 1e-4 or more.
"""

from __future__ import annotations

import pytest
import torch
from support import copy_checkpoint, full_state

from disttrain.data import GlobalOrderSampler
from disttrain.testing import run_distributed

pytestmark = pytest.mark.slow  # spawns worlds or trains: not in the quick check

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, N, STEPS, BATCH, HELD_OUT = 64, 16, 40, 4, 4, 4
TRAIN = {"steps": STEPS, "global_batch": BATCH, "grad_accum": 2, "lr": 3e-3,
         "schedule": "constant", "warmup_steps": 0, "grad_clip": 1.0,
         "weight_decay": 0.1, "log_every": STEPS, "eval_every": STEPS,
         "eval_samples": HELD_OUT}
GPT = {"vocab_size": VOCAB, "seq_len": SEQ, "n_layer": 2, "n_head": 4, "d_model": 32}


def _model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "gpt":
        from disttrain.config.schema import ModelConfig
        from disttrain.models import GPT as Gpt

        return Gpt(ModelConfig(**GPT))
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        bos_token_id=0, eos_token_id=0))


def _rows(family: str, n: int = N, seed: int = 3) -> list[dict[str, torch.Tensor]]:
    """Unpadded samples; sample i ignores its first i mod 7 targets."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        ids = torch.randint(0, VOCAB, (SEQ + 1,), generator=g)
        if family == "gpt":  # disttrain's windows: targets shifted, -1 ignored
            targets = ids[1:].clone()
            targets[: i % 7] = -1
            rows.append({"input_ids": ids[:-1], "targets": targets})
        else:  # Hugging Face rows: labels unshifted, -100 ignored, a mask of ones
            labels = ids[:-1].clone()
            labels[: i % 7 + 1] = -100
            rows.append({"input_ids": ids[:-1], "attention_mask": torch.ones(SEQ).long(),
                         "labels": labels})
    return rows


def _logits_and_targets(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole sequence in one process: logits [B, T - 1 or T, V] and their targets,
    ignored positions -1."""
    if "targets" in batch:
        return model(batch["input_ids"]), batch["targets"]
    logits = model(input_ids=batch["input_ids"],
                   attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"][:, 1:]
    return logits[:, :-1], labels.masked_fill(labels == -100, -1)


def _summed_loss(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    logits, targets = _logits_and_targets(model, batch)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                             ignore_index=-1, reduction="sum")
    return loss, (targets != -1).sum()


def _reference(family: str) -> tuple[dict[str, torch.Tensor], float]:
    """The plain loop: each step the whole global batch in one process, the summed loss
    over its counted tokens / their number, AdamW with decay on matrices only,
    clipping; then the held-out loss on the first HELD_OUT held-out rows."""
    model, rows = _model(family), _rows(family)
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2],
                              "weight_decay": TRAIN["weight_decay"]},
                             {"params": [p for p in params if p.dim() < 2],
                              "weight_decay": 0.0}], lr=TRAIN["lr"], betas=(0.9, 0.95))
    sampler = GlobalOrderSampler(len(rows), 1234)
    stack = _stack
    for step in range(STEPS):
        loss, count = _summed_loss(model, stack([rows[i] for i in sampler.indices(
            step * BATCH, BATCH)]))
        opt.zero_grad()
        (loss / count).backward()
        torch.nn.utils.clip_grad_norm_(params, TRAIN["grad_clip"])
        opt.step()
    with torch.no_grad():
        loss, count = _summed_loss(model, stack(_rows(family, HELD_OUT, seed=4)))
    return {k: v.detach().clone() for k, v in model.named_parameters()}, float(loss / count)


def _stack(rows: list[dict]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def _fit(run_dir: str, family: str, parallel: dict, steps: int = STEPS,
         checkpoint: int = 0) -> tuple[dict[str, torch.Tensor] | None, float, int]:
    """One layout through the Trainer: the full model's weights on global rank 0, the
    final held-out loss, the step it started from."""
    from disttrain import Trainer

    model = {"model": GPT} if family == "gpt" else {}
    trainer = Trainer(_model(family), _rows(family), config={
        **model, "train": {**TRAIN, "steps": steps}, "parallel": parallel,
        "checkpoint": {"every": checkpoint, "async": False},
        "monitor": {"peak_tflops": 1.0}}, eval_dataset=_rows(family, HELD_OUT, seed=4),
        run_dir=run_dir, progress=False)
    summary = trainer.fit()
    full = full_state(trainer.parallel)
    weights = None
    if full is not None:
        names = {n for n, _ in _model(family).named_parameters()}  # buffers left out
        weights = {k: v.clone() for k, v in full.items() if k in names}
    return weights, float(summary["final_eval_loss"]), trainer.start_step


def _fit_cases(root: str, cases: list[tuple[str, str, dict, str | None]]) -> dict:
    """Each case in this one world; a case naming a saved run resumes a copy of its
    checkpoint of step 2."""
    out = {}
    for family, name, parallel, saved in cases:
        run_dir = f"{root}/{family}-{name}"
        if saved is not None:
            copy_checkpoint(f"{root}/{saved}", run_dir, 2)
        out[(family, name)] = _fit(run_dir, family, parallel)
    return out


def _world2(root: str, cases: list[tuple[str, str, dict, str | None]]) -> dict:
    """In a world of 2: each family saved at cp 2 after 2 steps (kept for the world of
    4), then ``cases``."""
    for family in FAMILIES:
        _fit(f"{root}/{family}-saved", family, {"cp": 2}, steps=2, checkpoint=2)
    return _fit_cases(root, cases)


FAMILIES = ("gpt", "llama")
WORLD2 = [(f, name, parallel, saved) for f in FAMILIES for name, parallel, saved in (
    ("cp2", {"cp": 2}, None),
    ("cp1-resumed", {"dp": 2}, f"{f}-saved"))]
WORLD4 = [(f, name, parallel, saved) for f in FAMILIES for name, parallel, saved in (
    ("cp4", {"cp": 4}, None),
    ("cp2-tp2", {"cp": 2, "tp": 2}, None),
    ("cp2-dp2-z3", {"cp": 2, "dp": 2, "zero": 3}, None),
    ("cp2-pp2", {"cp": 2, "pp": 2, "pp_schedule": "1f1b"}, None),
    ("cp2-pp2-zb1", {"cp": 2, "pp": 2, "pp_schedule": "zb1"}, None),
    ("cp4-resumed", {"cp": 4}, f"{f}-saved"),
    ("cp2-dp2-z3-resumed", {"cp": 2, "dp": 2, "zero": 3}, f"{f}-saved"))]
WORLD4.append(("gpt", "cp2-tp2-sp", {"cp": 2, "tp": 2, "sequence_parallel": True}, None))


@pytest.fixture(scope="module")
def references() -> dict[str, tuple[dict[str, torch.Tensor], float]]:
    return {family: _reference(family) for family in FAMILIES}


def _check(got: dict, references: dict, cases: list[tuple]) -> None:
    for family, name, *_ in cases:
        weights, held_out, start = got[(family, name)]
        want, want_held_out = references[family]
        what = f"{family} {name}"
        assert weights is not None and weights.keys() == want.keys(), what
        for k in want:
            torch.testing.assert_close(weights[k], want[k], atol=1e-5, rtol=0,
                                       msg=lambda m, k=k, what=what: f"{what}: {k}: {m}")
        assert held_out == pytest.approx(want_held_out, abs=1e-5), what
        assert start == (2 if "resumed" in name else 0), what


def test_every_cp_layout_and_reshard_follows_a_plain_loop(references, tmp_path):
    """One world of 2 (cp 2; the checkpoints saved at cp 2, resumed at cp 1), one of 4
    (every other layout; those checkpoints resumed at cp 4 and at cp 2 x dp 2 ZeRO-3)."""
    got = run_distributed(_world2, 2, args=(str(tmp_path), WORLD2), timeout=300)[0]
    _check(got, references, WORLD2)
    got = run_distributed(_fit_cases, 4, args=(str(tmp_path), WORLD4), timeout=600)[0]
    _check(got, references, WORLD4)
