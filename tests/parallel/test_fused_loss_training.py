"""Training with the fused linear + cross-entropy follows training on the full logits.

The built-in GPT (tied head; the command line's ``loss_fn=token_loss``) and a tiny
transformers Llama (untied ``lm_head``; dict batches with ``labels``, no ``loss_fn``,
so the loss shifts inside) train 4 steps with ``train.fused_loss`` on and off, on one
rank, at tp 2 (vocabulary-parallel head) and at pp 2 (the head on the last stage); a
transformers GPT-2 (``lm_head`` tied to ``wte``, its copy on the last stage) at pp 2.
Each pair must end on the same weights. After ``fit()`` the model holds its own head
again and gives logits. A ``loss_fn`` of the user's turns the fused loss off and gets
the logits.

atol 1e-5: on and off compute the same terms (the fused loss in chunks, its weight
gradient summed in fp32), so their weights differ by float rounding (~1e-7 per step);
AdamW's steps of lr 3e-3 keep that far below 1e-5 over 4 steps, while a wrong gradient
(a lost shard's rows, an unshifted label, the tied copy left out) moves weights by
about the learning rate.
"""

from __future__ import annotations

import pytest
import torch
from hf_support import padded_rows
from support import TINY_MODEL, SyntheticTokens, full_state, tiny_config

from disttrain.testing import run_distributed

pytestmark = pytest.mark.slow  # spawns worlds and trains: not in the quick check

transformers = pytest.importorskip("transformers")

STEPS, VOCAB, SEQ = 4, 64, 12
ATOL = 1e-5
LAYOUTS = {"tp2": {"tp": 2}, "pp2": {"pp": 2, "pp_schedule": "1f1b"}}


def _hf_model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
            eos_token_id=0))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        bos_token_id=0, eos_token_id=0))


def _fit(root: str, family: str, fused: bool, parallel: dict, loss_fn=None) -> dict:
    """Train one run; returns rank 0's full weights (None elsewhere), the banner's loss
    line, and what the model is after fit: whether a stand-in head is left in it and,
    where a forward needs no collective (tp = 1), the logits' last dim."""
    from disttrain import Trainer
    from disttrain.data import collate_token_batch
    from disttrain.models import GPT, token_loss
    from disttrain.parallel.fused_loss import HiddenStatesHead

    name = f"{root}/{family}-{'-'.join(f'{k}{v}' for k, v in parallel.items())}-{fused}"
    cfg = tiny_config(steps=STEPS, fused_loss=fused, grad_accum=2, schedule="constant",
                      warmup_steps=0, eval_samples=4, **parallel)
    if family == "gpt":
        torch.manual_seed(cfg.train.seed)
        model = GPT(cfg.model)
        trainer = Trainer(model, SyntheticTokens(mask=True), loss_fn or token_loss, cfg,
                          run_dir=name, collate_fn=collate_token_batch, progress=False,
                          eval_dataset=SyntheticTokens(n=8, seed=1))
    else:
        model = _hf_model(family)
        trainer = Trainer(model, padded_rows(32, SEQ, VOCAB), None, cfg, run_dir=name,
                          progress=False)
    trainer.fit()
    full = full_state(trainer.parallel)
    names = {n for n, _ in model.named_parameters()}
    logits_dim = None
    if parallel.get("tp", 1) == 1:
        with torch.no_grad():
            ids = torch.arange(SEQ).unsqueeze(0) % VOCAB
            out = model(ids) if family == "gpt" else model(input_ids=ids).logits
        logits_dim = out.shape[-1]
    return {"weights": None if full is None else {k: v for k, v in full.items()
                                                   if k in names},
            "loss_line": trainer.parallel.loss_line,
            "stand_in_left": any(isinstance(m, HiddenStatesHead) for m in model.modules()),
            "logits_dim": logits_dim}


def _fit_cases(root: str, cases: list[tuple[str, str, dict]]) -> dict:
    return {(family, name, fused): _fit(root, family, fused, parallel)
            for family, name, parallel in cases for fused in (True, False)}


def _check_pairs(results: dict, cases: list[tuple[str, str, dict]]) -> None:
    for family, name, _ in cases:
        on, off = results[(family, name, True)], results[(family, name, False)]
        what = f"{family} {name}"
        assert on["loss_line"].startswith("loss: fused"), (what, on["loss_line"])
        assert "train.fused_loss=false" in off["loss_line"], (what, off["loss_line"])
        assert on["weights"].keys() == off["weights"].keys(), what
        for k in on["weights"]:
            torch.testing.assert_close(on["weights"][k], off["weights"][k], atol=ATOL, rtol=0,
                                       msg=lambda m, k=k, w=what: f"{w}: {k}: {m}")
        assert not on["stand_in_left"], f"{what}: the stand-in head is left after fit"
        if on["logits_dim"] is not None:
            assert on["logits_dim"] == VOCAB, what


ONE = [("gpt", "world1", {}), ("llama", "world1", {})]
TWO = [(family, name, LAYOUTS[name]) for family in ("gpt", "llama")
       for name in ("tp2", "pp2")] + [("gpt2", "pp2", LAYOUTS["pp2"])]


def test_one_rank_fused_equals_full_logits_and_the_model_gives_logits_after(tmp_path):
    got = run_distributed(_fit_cases, 1, args=(str(tmp_path), ONE), timeout=240)[0]
    _check_pairs(got, ONE)


def test_tp2_and_pp2_fused_equal_full_logits(tmp_path):
    got = run_distributed(_fit_cases, 2, args=(str(tmp_path), TWO), timeout=420)[0]
    _check_pairs(got, TWO)


def _shape_checking_loss(logits: torch.Tensor, targets: torch.Tensor):
    assert logits.shape[-1] == TINY_MODEL["vocab_size"], tuple(logits.shape)
    keep = targets != -1
    return (torch.nn.functional.cross_entropy(logits[keep], targets[keep],
                                              reduction="sum"), keep.sum())


def _fit_own_loss(root: str) -> dict:
    return _fit(root, "gpt", True, {}, loss_fn=_shape_checking_loss)


def test_a_loss_fn_of_the_users_gets_the_logits_and_turns_it_off(tmp_path):
    got = run_distributed(_fit_own_loss, 1, args=(str(tmp_path),), timeout=120)[0]
    assert got["loss_line"].startswith("loss: on the full logits"), got["loss_line"]
    assert "loss_fn" in got["loss_line"]
