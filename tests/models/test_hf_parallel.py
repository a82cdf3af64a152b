"""Tensor, pipeline and hybrid parallelism on Hugging Face transformers models, found by
their module structure: tiny 4-block GPT-2 (fused, transposed ``c_attn`` cut per head,
tied head), Llama (q/k/v/o and gate/up/down, grouped-query attention with 2 key/value
heads for 4 query heads, untied head) and Qwen3 (Llama's projections plus per-head
RMSNorms inside attention, whose gradients are partial sums over tp: at tp 2, (2, 1, 2)
ZeRO-2 and (1, 2, 2)), random init, nothing downloaded.

Every layout trains on dict batches with ``labels`` (-100 on left padding) and an
``attention_mask``, no ``loss_fn``, and must follow a plain single-process PyTorch loop
on the same samples per step (AdamW, constant LR, clipping) over 8 steps, atol 1e-4:
the layouts sum the same terms in other orders (~1e-7 per step in fp32), while a head
split across the wrong rows of ``c_attn``, a lost attention mask or rotary position on a
later stage, a tied weight out of sync, or a key/value head paired with the wrong query
heads moves weights by more than 1e-3.
"""

from __future__ import annotations

import pytest
import torch
from hf_support import padded_rows, plain_loop
from support import full_state

from disttrain.testing import run_distributed

pytestmark = pytest.mark.slow  # spawns worlds or trains: not in the quick check

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, N, STEPS, BATCH, LAYERS = 64, 12, 48, 8, 8, 4
TRAIN = {"steps": STEPS, "global_batch": BATCH, "lr": 3e-3, "schedule": "constant",
         "warmup_steps": 0, "grad_clip": 1.0, "weight_decay": 0.1, "log_every": 4,
         "eval_samples": 8, "grad_accum": 2}
FAMILIES = ("gpt2", "llama")


def _model(family: str) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if family == "qwen3":  # Llama-like, plus per-head RMSNorms q_norm / k_norm
        from transformers import Qwen3Config, Qwen3ForCausalLM

        return Qwen3ForCausalLM(Qwen3Config(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
            num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
            head_dim=8, max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0))
    if family == "gpt2":
        return GPT2LMHeadModel(GPT2Config(
            vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=LAYERS, n_head=4,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
            eos_token_id=0))
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        bos_token_id=0, eos_token_id=0))


def _rows() -> list[dict[str, list[int]]]:
    return padded_rows(N, SEQ, VOCAB)


def _reference(family: str, steps: int = STEPS) -> dict[str, torch.Tensor]:
    """The plain single-process loop (:func:`hf_support.plain_loop`) on the same rows."""
    model = plain_loop(_model(family), _rows(), TRAIN, steps=steps, batch=BATCH)
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _fit(root: str, family: str, name: str, parallel: dict, train: dict | None = None,
         ) -> tuple[dict[str, torch.Tensor] | None, int]:
    """Train one layout: the full model's weights (gathered) on global rank 0, and the
    step it started from."""
    from disttrain import Trainer

    trainer = Trainer(_model(family), _rows(), config={
        "train": {**TRAIN, **(train or {})}, "parallel": parallel,
        "checkpoint": {"every": 4, "async": False}, "monitor": {"peak_tflops": 1.0}},
        run_dir=f"{root}/{family}-{name}", progress=False)
    trainer.fit()
    full = full_state(trainer.parallel)
    if full is None:
        return None, trainer.start_step
    names = {n for n, _ in _model(family).named_parameters()}  # buffers left out
    return {k: v.clone() for k, v in full.items() if k in names}, trainer.start_step


def _fit_cases(root: str, cases: list[tuple[str, str, dict, dict]]) -> dict:
    """Each case in turn; a case whose train settings name ``resume_from`` first trains
    4 steps under that layout, then resumes its checkpoint under its own."""
    out = {}
    for family, name, parallel, train in cases:
        train = dict(train)
        first = train.pop("resume_from", None)
        if first is not None:
            _fit(root, family, name, first, {"steps": 4})
        out[(family, name)] = _fit(root, family, name, parallel, train)
    return out


@pytest.fixture(scope="module")
def references() -> dict[str, dict[str, torch.Tensor]]:
    return {family: _reference(family) for family in (*FAMILIES, "qwen3")}


def _close(got: dict, want: dict, what: str) -> None:
    assert got is not None, what
    assert got.keys() == want.keys(), what
    for k in got:
        torch.testing.assert_close(got[k], want[k], atol=1e-4, rtol=0,
                                   msg=lambda m, k=k: f"{what}: {k}: {m}")


def _check(got: dict, references: dict, cases: list) -> None:
    for family, name, _, train in cases:
        weights, start = got[(family, name)]
        _close(weights, references[family], f"{family} {name}")
        assert start == (4 if "resume_from" in train else 0), (family, name, start)


WORLD2 = [("qwen3", "tp2", {"tp": 2}, {})] + [(f, name, par, {}) for f in FAMILIES
                                              for name, par in (
    ("tp2", {"tp": 2}),
    ("pp2-gpipe", {"pp": 2, "pp_schedule": "gpipe"}),
    ("pp2-1f1b", {"pp": 2, "pp_schedule": "1f1b"}),
    ("pp2-interleaved", {"pp": 2, "pp_schedule": "interleaved", "pp_virtual": 2}))]
WORLD4 = [("qwen3", "dp2-tp2-z2", {"dp": 2, "tp": 2, "zero": 2}, {}),
          ("qwen3", "pp2-tp2", {"pp": 2, "tp": 2, "pp_schedule": "1f1b"}, {})] + [
    (f, name, par, tr) for f in FAMILIES for name, par, tr in (
    ("dp2-pp2-z3", {"dp": 2, "pp": 2, "zero": 3}, {}),
    ("dp2-tp2-z2", {"dp": 2, "tp": 2, "zero": 2}, {}),
    ("pp2-tp2-ckpt", {"pp": 2, "tp": 2, "pp_schedule": "1f1b"},
     {"activation_checkpointing": "full"}),
    # saved at step 4 under (dp 1, pp 2, tp 2), resumed under (dp 2, pp 1, tp 2) ZeRO-3
    ("resharded", {"dp": 2, "tp": 2, "zero": 3},
     {"resume_from": {"pp": 2, "tp": 2, "pp_schedule": "gpipe"}}))]
WORLD8 = [(f, "dp2-pp2-tp2-z1", {"dp": 2, "pp": 2, "tp": 2, "zero": 1}, {})
          for f in FAMILIES]


def test_tp2_and_every_pipeline_schedule_follow_a_plain_loop(references, tmp_path):
    got = run_distributed(_fit_cases, 2, args=(str(tmp_path), WORLD2), timeout=420)[0]
    _check(got, references, WORLD2)


def test_hybrid_layouts_with_zero_and_checkpointing_follow_a_plain_loop(references,
                                                                        tmp_path):
    got = run_distributed(_fit_cases, 4, args=(str(tmp_path), WORLD4), timeout=420)[0]
    _check(got, references, WORLD4)


def test_dp_pp_tp_together_follow_a_plain_loop(references, tmp_path):
    got = run_distributed(_fit_cases, 8, args=(str(tmp_path), WORLD8), timeout=420)[0]
    _check(got, references, WORLD8)
