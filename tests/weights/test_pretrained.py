"""``model.pretrained`` / ``Trainer(pretrained=DIR)``: a transformers directory written
by ``save_pretrained`` (one file or shards with an index; fp32 or bf16) is the starting
point at every layout, each rank reading only the parts it holds.

- With a learning rate too small to move any weight (1e-30: AdamW's update and decay
  are below half an ulp of every weight), the run's final weights equal the file's,
  bitwise (bf16 files: their exact fp32 values), at dp 2 ZeRO-3, tp 2, pp 2 (1F1B) and
  (2, 2, 2), and with activation checkpointing under the interleaved schedule and
  ZeRO-2; a layout that read the wrong slice, missed a tensor or untied GPT-2's head
  differs in most elements.
- The held-out loss before training equals the one transformers computes with
  ``from_pretrained`` on the same samples (1e-5: the same fp32 model, other kernels'
  summation order).
- At tp 2 each rank reads exactly the bytes of the tensor parts it holds (its shards,
  and the tensors it replicates), less than the file; under ZeRO-3 at dp 2 each rank
  reads about its half (its shard's ranges).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support import SyntheticTokens

from disttrain import Callback
from disttrain.testing import run_distributed

pytestmark = pytest.mark.slow  # spawns worlds or trains: not in the quick check

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 64, 16
# name -> ((dp, pp, tp), ZeRO stage, extra train / parallel settings)
LAYOUTS = {2: {"dp2-z3": ((2, 1, 1), 3, {}), "tp2": ((1, 1, 2), 0, {}),
               "pp2": ((1, 2, 1), 0, {}),
               "pp2-interleaved-ac": ((1, 2, 1), 0, {"pp_schedule": "interleaved",
                                                     "activation_checkpointing": "full"}),
               "dp2-z2-ac": ((2, 1, 1), 2, {"activation_checkpointing": "full"})},
           8: {"2x2x2": ((2, 2, 2), 1, {})}}


def save_tiny(family: str, directory: Path, *, dtype=torch.float32, shards: bool = False,
              vocab: int = VOCAB) -> Path:
    """A tiny random transformers model of ``family`` saved as a pretrained directory."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    if family == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_positions=SEQ, n_embd=32,
                                           n_layer=4, n_head=4, bos_token_id=0,
                                           eos_token_id=0, resid_pdrop=0.0,
                                           embd_pdrop=0.0, attn_pdrop=0.0))
    else:
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
            bos_token_id=0, eos_token_id=0))
    with torch.no_grad():  # weights far from their init, so a fresh init cannot pass
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.to(dtype).save_pretrained(directory, max_shard_size="20KB" if shards else "5GB")
    return directory


def _config(layout, zero, extra=None, lr=1e-30):
    dp, pp, tp = layout
    extra = dict(extra or {})
    train_extra = {k: extra.pop(k) for k in ("activation_checkpointing",) if k in extra}
    return {"train": {"steps": 2, "global_batch": 8, "grad_accum": 2, "lr": lr,
                      "warmup_steps": 0, "eval_samples": 8, "log_every": 1, "seed": 3,
                      **train_extra},
            "parallel": {"dp": dp, "pp": pp, "tp": tp, "zero": zero,
                         **({"pp_schedule": "1f1b"} if pp > 1 else {}), **extra},
            "checkpoint": {"every": 2, "async": False}, "monitor": {"peak_tflops": 1.0}}


class BytesRead(Callback):
    """Each rank's bytes read from the files, and the bytes of the parts it holds."""

    all_ranks = True

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_start(self, trainer) -> None:
        placement, seen, held = trainer.parallel.placement, set(), 0
        itemsize = 4
        for p in trainer.parallel.module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                held += p.numel() * itemsize
        Path(f"{self.path}.rank{trainer.rank}").write_text(json.dumps(
            {"read": trainer.weights.bytes_read, "held": held,
             "tp": placement.shards}))


def _fit(root: str, cases: dict, dirs: dict) -> None:
    from disttrain import Trainer
    from disttrain.data import collate_token_batch
    from disttrain.weights import pretrained_model

    for key, directory in dirs.items():
        for name, (layout, zero, extra) in cases.items():
            run = f"{root}/{key}-{name}"
            Trainer(pretrained_model(directory), SyntheticTokens(), None,
                    _config(layout, zero, extra), eval_dataset=SyntheticTokens(n=8, seed=5),
                    collate_fn=collate_token_batch, run_dir=run, progress=False,
                    pretrained=directory, callbacks=[BytesRead(run)]).fit()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretrained")
    dirs = {"gpt2": save_tiny("gpt2", root / "gpt2"),
            "llama": save_tiny("llama", root / "llama"),
            "gpt2-sharded": save_tiny("gpt2", root / "gpt2-sharded", shards=True),
            "llama-bf16": save_tiny("llama", root / "llama-bf16", dtype=torch.bfloat16,
                                    shards=True)}
    dirs = {k: str(v) for k, v in dirs.items()}
    run_distributed(_fit, 1, args=(str(root), {"one": ((1, 1, 1), 0, {})}, dirs),
                    timeout=120)
    for world, cases in LAYOUTS.items():
        run_distributed(_fit, world, args=(str(root), cases, dirs), timeout=300)
    return root, dirs


def _file_weights(directory: str) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        out.update({k: v.float() for k, v in load_file(str(f)).items()})
    return out


def test_the_shards_and_dtypes_are_as_written(runs):
    _, dirs = runs
    assert len(list(Path(dirs["gpt2-sharded"]).glob("*.safetensors"))) > 2
    assert (Path(dirs["llama-bf16"]) / "model.safetensors.index.json").is_file()
    first = next(iter(load_file(str(next(Path(dirs["llama-bf16"]).glob(
        "*.safetensors")))).values()))
    assert first.dtype == torch.bfloat16


@pytest.mark.parametrize("key", ["gpt2", "llama", "gpt2-sharded", "llama-bf16"])
@pytest.mark.parametrize("case", ["one"] + [c for cs in LAYOUTS.values() for c in cs])
def test_every_layout_starts_from_the_files_weights(runs, key, case):
    root, dirs = runs
    final = load_file(str(root / f"{key}-{case}" / "model.safetensors"))
    files = _file_weights(dirs[key])
    assert sorted(files) == sorted(final), (sorted(files), sorted(final))
    for name, t in files.items():
        assert torch.equal(final[name], t), name


@pytest.mark.parametrize("key", ["gpt2", "llama-bf16"])
def test_the_initial_held_out_loss_is_transformers_own(runs, key):
    from transformers import AutoModelForCausalLM

    from disttrain.data import collate_token_batch

    root, dirs = runs
    model = AutoModelForCausalLM.from_pretrained(dirs[key], dtype=torch.float32)
    batch = collate_token_batch([SyntheticTokens(n=8, seed=5)[i] for i in range(8)])
    with torch.no_grad():
        logits = model(batch["input_ids"]).logits
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1),
                                                 batch["targets"].flatten())
    for case in ("one", "tp2", "pp2"):
        summary = json.loads((root / f"{key}-{case}" / "summary.json").read_text())
        assert summary["initial_eval_loss"] == pytest.approx(float(expected), abs=1e-5)


@pytest.mark.parametrize("key", ["gpt2", "llama"])
def test_each_tp_rank_reads_only_the_parts_it_holds(runs, key):
    root, dirs = runs
    total = sum(f.stat().st_size for f in Path(dirs[key]).glob("*.safetensors"))
    for rank in (0, 1):
        figures = json.loads((root / f"{key}-tp2.rank{rank}").read_text())
        assert figures["tp"] == 2
        assert figures["read"] == figures["held"], figures  # fp32 files: bytes alike
        assert figures["read"] < 0.75 * total


@pytest.mark.parametrize("key", ["gpt2", "llama"])
def test_each_zero3_rank_reads_about_its_shard(runs, key):
    root, dirs = runs
    total = sum(f.stat().st_size for f in Path(dirs[key]).glob("*.safetensors"))
    reads = [json.loads((root / f"{key}-dp2-z3.rank{rank}").read_text())["read"]
             for rank in (0, 1)]
    assert all(0.3 * total < r < 0.6 * total for r in reads), (reads, total)
    assert 0.95 * total < sum(reads) < 1.05 * total  # together: the file, about once


@pytest.mark.parametrize("case", ["one", "tp2", "2x2x2"])
def test_the_hf_export_gives_the_files_back(runs, case, tmp_path):
    """``disttrain export --format hf`` of a run (its step-2 checkpoint): the file's own
    names and values, and a directory transformers loads."""
    from transformers import AutoModelForCausalLM

    from disttrain.checkpoint.export import export_hf

    root, dirs = runs
    for key in ("gpt2", "llama-bf16"):
        out, weights = export_hf(root / f"{key}-{case}", tmp_path / key, warn=pytest.fail)
        assert weights.step == 2 and weights.source.startswith("checkpoint")
        exported, files = _file_weights(str(out)), _file_weights(dirs[key])
        assert sorted(exported) == sorted(files)
        assert all(torch.equal(exported[n], t) for n, t in files.items())
        AutoModelForCausalLM.from_pretrained(out)
