"""Hugging Face transformers models in their own conventions: dict batches with
``labels`` (unshifted, -100 ignored) and ``attention_mask``, no ``loss_fn``, the output's
``logits``. Tiny GPT-2 and Llama built from configs (random init, nothing downloaded).

Each disttrain run (one rank; dp=2 with data parallelism and ZeRO-1/2/3) must follow a
plain single-process PyTorch loop on the same samples per step (AdamW, constant LR,
clipping) over 8 steps, atol 1e-4: the layouts sum the same per-token terms in other
orders (~1e-7 per step in fp32, far below 1e-4 after AdamW's lr-sized steps), while a
dropped attention mask (the left-padded samples attend to padding), a loss counting
padding, or per-rank normalisation moves weights by more than 1e-3.
"""

from __future__ import annotations

import pytest
import torch
from hf_support import padded_rows, plain_loop

from disttrain.testing import run_distributed
from disttrain.train.batch import causal_lm_loss, collate_samples

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, N, STEPS, BATCH = 64, 12, 48, 8, 8
TRAIN = {"steps": STEPS, "global_batch": BATCH, "lr": 3e-3, "schedule": "constant",
         "warmup_steps": 0, "grad_clip": 1.0, "weight_decay": 0.1, "log_every": 4,
         "eval_samples": 8}


def _model(family: str) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if family == "gpt2":
        cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                         bos_token_id=0, eos_token_id=0)
        return GPT2LMHeadModel(cfg)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0)
    return LlamaForCausalLM(cfg)


def _rows() -> list[dict[str, list[int]]]:
    return padded_rows(N, SEQ, VOCAB)


def _reference(family: str) -> dict[str, torch.Tensor]:
    """The plain single-process loop (:func:`hf_support.plain_loop`) on the same rows."""
    model = plain_loop(_model(family), _rows(), TRAIN, steps=STEPS, batch=BATCH)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _fit_all(root: str, cases: list[tuple[str, int]]) -> dict:
    from disttrain import Trainer

    out = {}
    for family, zero in cases:
        model = _model(family)
        summary = Trainer(model, _rows(), config={
            "train": TRAIN, "parallel": {"zero": zero}, "checkpoint": {"every": 0},
            "monitor": {"peak_tflops": 1.0}}, run_dir=f"{root}/{family}-z{zero}",
            progress=False).fit()
        out[(family, zero)] = ({k: v.detach().clone() for k, v in model.state_dict().items()},
                               summary)
    return out


FAMILIES = ("gpt2", "llama")


@pytest.fixture(scope="module")
def references() -> dict[str, dict[str, torch.Tensor]]:
    return {family: _reference(family) for family in FAMILIES}


def _close(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-4, rtol=0,
                                   msg=lambda m, k=k: f"{what}: {k}: {m}")


def test_one_rank_follows_a_plain_loop(references, tmp_path):
    cases = [(f, 0) for f in FAMILIES]
    got = run_distributed(_fit_all, 1, args=(str(tmp_path), cases), timeout=180)[0]
    for family, zero in cases:
        _close(got[(family, zero)][0], references[family], f"{family} one rank")


def test_dp2_and_every_zero_stage_follow_a_plain_loop(references, tmp_path):
    cases = [(f, z) for f in FAMILIES for z in (0, 1, 2, 3)]
    got = run_distributed(_fit_all, 2, args=(str(tmp_path), cases), timeout=300)
    for family, zero in cases:
        _close(got[0][(family, zero)][0], references[family], f"{family} dp=2 zero={zero}")
        _close(got[1][(family, zero)][0], got[0][(family, zero)][0], "ranks agree")
    # throughput counts tokens: more tokens per second than samples
    summary = got[0][("llama", 0)][1]
    assert summary["tokens_per_s"] > 5 * summary["samples_seen"] / summary["train_time_s"]


def _fit_hf_dataset(root: str, family: str) -> dict:
    """The same rows as a plain list of dicts, as a ``datasets.Dataset`` (read as
    tensors by the default collation), and as one read as Python lists (``collate_fn``
    given); each trained and held out on one rank: final weights, losses."""
    import json

    from datasets import Dataset

    from disttrain import Trainer

    rows = _rows()
    table = Dataset.from_dict({k: [r[k] for r in rows] for k in rows[0]})
    out = {}
    for kind, data, collate in (("list", rows, None), ("dataset", table, None),
                                ("dataset-lists", table, collate_samples)):
        model = _model(family)
        summary = Trainer(model, data, config={
            "train": {**TRAIN, "log_every": 1}, "checkpoint": {"every": 0},
            "monitor": {"peak_tflops": 1.0}}, eval_dataset=data, collate_fn=collate,
            run_dir=f"{root}/{kind}", progress=False).fit()
        losses = [json.loads(line)["loss"]
                  for line in open(f"{root}/{kind}/metrics.jsonl", encoding="utf-8")]
        out[kind] = ({k: v.detach().clone() for k, v in model.state_dict().items()},
                     losses, summary["final_eval_loss"])
    return out


def test_a_hf_datasets_dataset_trains_as_the_same_rows_in_a_list(references, tmp_path):
    """Its micro-batches are the same rows in the same order (one batched read of the
    table per micro-batch): every loss and weight bitwise equal, and the plain loop
    followed."""
    pytest.importorskip("datasets", reason="the datasets library is not installed")
    got = run_distributed(_fit_hf_dataset, 1, args=(str(tmp_path), "llama"),
                          timeout=240)[0]
    want_state, want_losses, want_eval = got["list"]
    assert len(want_losses) == STEPS
    for kind in ("dataset", "dataset-lists"):
        state, losses, eval_loss = got[kind]
        assert losses == want_losses and eval_loss == want_eval, kind
        for k in want_state:
            assert torch.equal(state[k], want_state[k]), f"{kind}: {k}"
    _close(want_state, references["llama"], "llama from a list")


def test_the_loss_counts_label_tokens_only():
    """Shifted inside, -100 skipped: the count is the labels after the first position
    that are not -100, and the loss is their cross-entropy."""
    logits = torch.randn(2, 5, 7)
    labels = torch.tensor([[-100, -100, 3, 4, 5], [1, 2, 3, -100, 6]])
    loss, count = causal_lm_loss({"logits": logits}, labels)
    assert int(count) == 3 + 3
    want = sum(torch.nn.functional.cross_entropy(logits[b, t - 1], labels[b, t],
                                                 reduction="sum")
               for b in range(2) for t in range(1, 5) if labels[b, t] != -100)
    torch.testing.assert_close(loss, want)
    loss_tuple, _ = causal_lm_loss((logits,), labels)
    torch.testing.assert_close(loss_tuple, loss)


def test_a_mapping_batch_without_labels_or_targets_is_refused():
    from disttrain.train.batch import split_batch

    with pytest.raises(ValueError, match="labels"):
        split_batch({"input_ids": torch.zeros(2, 3)})


def _fit_and_logits(root: str) -> dict:
    """Train each family on one rank with a checkpoint at the end; its final logits."""
    from disttrain import Trainer

    ids = torch.tensor(_rows()[0]["input_ids"]).unsqueeze(0)
    out = {}
    for family in FAMILIES:
        model = _model(family)
        Trainer(model, _rows(), config={
            "train": {**TRAIN, "steps": 3}, "checkpoint": {"every": 3, "async": False},
            "monitor": {"peak_tflops": 1.0}}, run_dir=f"{root}/{family}",
            progress=False).fit()
        with torch.no_grad():
            out[family] = model.eval()(input_ids=ids).logits
    return out


def test_export_hf_loads_with_from_pretrained_and_gives_the_same_logits(tmp_path):
    """config.json + safetensors under the model's own names; GPT-2's tied head is
    stored once and tied again by from_pretrained."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from disttrain.cli import main

    got = run_distributed(_fit_and_logits, 1, args=(str(tmp_path),), timeout=180)[0]
    ids = torch.tensor(_rows()[0]["input_ids"]).unsqueeze(0)
    for family in FAMILIES:
        out = tmp_path / f"{family}-hf"
        assert main(["export", str(tmp_path / family), "--format", "hf",
                     "--out", str(out)]) == 0
        loaded = AutoModelForCausalLM.from_pretrained(str(out)).eval()
        with torch.no_grad():
            torch.testing.assert_close(loaded(input_ids=ids).logits, got[family],
                                       atol=0, rtol=0)
        with safe_open(str(out / "model.safetensors"), framework="pt") as f:
            keys = set(f.keys())
        if family == "gpt2":
            assert "lm_head.weight" not in keys and "transformer.wte.weight" in keys


def test_export_hf_of_a_run_without_a_model_config_is_refused(tmp_path, capsys):
    from disttrain.cli import main

    assert main(["export", str(tmp_path), "--format", "hf", "--out",
                 str(tmp_path / "out")]) == 2
    assert "--format hf" in capsys.readouterr().err
