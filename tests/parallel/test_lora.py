"""Frozen parameters and LoRA under every layout, each run held to the one-process run.

Four models train for a few steps on one process and at dp 2 under ZeRO 0-3, tp 2,
pp 2 and (2, 2, 2): the tiny GPT with part of it frozen (the embeddings and the first two
blocks whole, so a pipeline's first stage has nothing to train, and single tensors
further on), the tiny GPT with LoRA adapters, and LoRA on pretrained tiny Llama and
GPT-2 directories (GPT-2's fused ``Conv1D`` projections: transposed weights). All runs of
a world size share one spawn. Each run must end with the one-process run's final
weights (the frozen ones bit for bit: nothing may update them), hold no optimizer state
or gradient for a frozen parameter, and under ZeRO-3 hold only its shard of them.

A LoRA checkpoint holds the adapters and their optimizer state only; saved at dp 2
ZeRO-3 it resumes at tp 2 on the one-process trajectory, and refuses a different base.

atol 1e-4 (lr 1e-2): the layouts sum the same terms in other orders, so fp32 rounding
differs by ~1e-6 per step; AdamW's normalised steps keep that below 1e-4 over 6 steps,
while a wrong gradient (a partial sum not summed over tp, a shard reduced twice, a
frozen tensor stepped) moves weights by 1e-3 or more.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support import TINY_MODEL, SyntheticTokens

from disttrain.monitor.callbacks import Callback
from disttrain.testing import run_distributed

pytestmark = pytest.mark.slow  # spawns worlds and trains: not in the quick check

STEPS = 6
GPT_MODEL = {**TINY_MODEL, "n_layer": 4, "n_head": 4}
LORA = {"lora_rank": 4, "lora_alpha": 8.0}
# the frozen model: the front whole (tok_emb freezes its tied head too), then single tensors
FROZEN = ("tok_emb.", "pos_emb.", "blocks.0.", "blocks.1.", "blocks.2.attn.qkv.weight",
          "blocks.3.mlp.down.bias")
KINDS = ("frozen", "lora", "llama", "gpt2")
LAYOUTS = {"dp2-z0": ((2, 1, 1), 0), "dp2-z1": ((2, 1, 1), 1), "dp2-z2": ((2, 1, 1), 2),
           "dp2-z3": ((2, 1, 1), 3), "tp2": ((1, 1, 2), 0), "pp2": ((1, 2, 1), 0)}
CASES = {2: [(k, n) for k in ("frozen", "lora") for n in LAYOUTS]
         + [("llama", "tp2"), ("llama", "pp2"), ("llama", "dp2-z3"), ("gpt2", "tp2")],
         8: [("frozen", "2x2x2-z0"), ("lora", "2x2x2-z3")]}
LAYOUTS |= {"2x2x2-z0": ((2, 2, 2), 0), "2x2x2-z3": ((2, 2, 2), 3), "one": ((1, 1, 1), 0)}


def _values(kind: str, name: str, root: str, checkpoint: dict | None = None,
            steps: int = STEPS) -> dict:
    (dp, pp, tp), zero = LAYOUTS[name]
    model = {} if kind in ("llama", "gpt2") else dict(GPT_MODEL)
    if kind != "frozen":
        model |= LORA
    if kind in ("llama", "gpt2"):
        model["pretrained"] = f"{root}/{kind}-base"
    keep = {"every": STEPS, "async": False} if kind in ("llama", "gpt2") else {"every": 0}
    return {"model": model,
            "train": {"steps": steps, "global_batch": 8, "grad_accum": 4, "lr": 1e-2,
                      "warmup_steps": 0, "schedule": "constant", "eval_samples": 8,
                      "log_every": STEPS, "seed": 7},
            "parallel": {"dp": dp, "pp": pp, "tp": tp, "zero": zero,
                         **({"pp_schedule": "1f1b"} if pp > 1 else {})},
            "checkpoint": checkpoint or keep, "monitor": {"peak_tflops": 1.0}}


class Holdings(Callback):
    """What this rank holds after the first step: its model-state bytes, the elements of
    the optimizer's groups and of its state, and of the trainable parameters."""

    all_ranks = True

    def __init__(self, path: str) -> None:
        self.path = path

    def on_step_end(self, trainer, record) -> None:
        if record.step != 1:
            return
        opt = trainer.optimizer
        groups = [p for g in opt.param_groups for p in g["params"]]
        state = sum(v.numel() for s in opt.state.values() for v in s.values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0)
        module = trainer.parallel.module
        trainable = sum(p.numel() for p in {id(p): p for p in module.parameters()
                                            if p.requires_grad}.values())
        frozen_ids = {id(p) for p in module.parameters() if not p.requires_grad}
        Path(f"{self.path}.rank{trainer.rank}").write_text(json.dumps({
            "memory": trainer.run.memory(), "group_elements": sum(p.numel() for p in groups),
            "state_elements": state, "trainable_held": trainable,
            "frozen_in_groups": any(id(p) in frozen_ids for p in groups),
            "all_train": all(p.requires_grad for p in groups)}))


def _model(kind: str, root: str):
    from disttrain.models import GPT
    from disttrain.weights import pretrained_model

    if kind in ("llama", "gpt2"):
        return pretrained_model(f"{root}/{kind}-base")
    from disttrain.config import load_config

    cfg = load_config(values={"model": GPT_MODEL})
    torch.manual_seed(11)
    model = GPT(cfg.model)
    if kind == "frozen":
        for n, p in model.named_parameters():
            if n.startswith(FROZEN):
                p.requires_grad_(False)
    return model


def _fit(root: str, kind: str, name: str, run: str, checkpoint: dict | None = None,
         steps: int = STEPS) -> None:
    from disttrain import Trainer
    from disttrain.config import load_config
    from disttrain.data import collate_token_batch
    from disttrain.models import token_loss

    hf = kind in ("llama", "gpt2")
    Trainer(_model(kind, root), SyntheticTokens(mask=True),
            None if hf else token_loss,
            load_config(values=_values(kind, name, root, checkpoint, steps)),
            collate_fn=collate_token_batch, run_dir=run, progress=False,
            pretrained=f"{root}/{kind}-base" if hf else None,
            callbacks=[Holdings(run)]).fit()


def _run_cases(root: str, cases: list[tuple[str, str]]) -> None:
    for kind, name in cases:
        _fit(root, kind, name, f"{root}/{kind}-{name}")


def _save_and_resume(root: str) -> None:
    """LoRA saved at dp 2 ZeRO-3 after 3 steps, then resumed at tp 2 to step 6."""
    from support import copy_checkpoint

    saved, resumed = f"{root}/lora-saved", f"{root}/lora-resumed"
    _fit(root, "lora", "dp2-z3", saved, checkpoint={"every": 3, "async": False}, steps=3)
    copy_checkpoint(saved, resumed, 3)
    _fit(root, "lora", "tp2", resumed, checkpoint={"every": 3, "async": False})


def _save_tiny(family: str, directory: Path) -> None:
    """A tiny random transformers model of ``family`` saved as a pretrained directory."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    if family == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32,
                                           n_layer=4, n_head=4, bos_token_id=0,
                                           eos_token_id=0, resid_pdrop=0.0,
                                           embd_pdrop=0.0, attn_pdrop=0.0))
    else:
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
            bos_token_id=0, eos_token_id=0))
    model.save_pretrained(directory)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("lora")
    for family in ("llama", "gpt2"):
        _save_tiny(family, root / f"{family}-base")
    run_distributed(_run_cases, 1, args=(str(root), [(k, "one") for k in KINDS]),
                    timeout=240)
    run_distributed(_run_cases, 2, args=(str(root), CASES[2]), timeout=400)
    run_distributed(_save_and_resume, 2, args=(str(root),), timeout=240)
    run_distributed(_run_cases, 8, args=(str(root), CASES[8]), timeout=400)
    return root


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "model.safetensors"))


def _frozen_names(kind: str, root: Path) -> set[str]:
    from disttrain.config import load_config
    from disttrain.lora import add_lora, lora_settings
    from disttrain.param_names import canonical_name
    from disttrain.spec import spec_for

    model = _model(kind, str(root))
    if kind != "frozen":
        cfg = load_config(values=_values(kind, "one", str(root)))
        add_lora(model, lora_settings(cfg.model), spec_for(model), seed=7)
    return {canonical_name(n) for n, p in model.named_parameters() if not p.requires_grad}


@pytest.mark.parametrize("kind, name", CASES[2] + CASES[8])
def test_each_layout_follows_the_one_process_run(runs, kind, name):
    ref, got = _weights(runs / f"{kind}-one"), _weights(runs / f"{kind}-{name}")
    assert sorted(got) == sorted(ref)
    frozen = _frozen_names(kind, runs)
    assert frozen and len(frozen) < len(ref)
    for key in ref:  # the frozen ones exactly: no layout may touch them
        atol = 0.0 if key in frozen else 1e-4
        torch.testing.assert_close(got[key], ref[key], atol=atol, rtol=0,
                                   msg=lambda m, key=key: f"{kind} {name}: {key}: {m}")


def test_the_reference_runs_train_only_what_is_not_frozen(runs):
    """The one-process runs themselves: frozen tensors keep their initial values, and
    every trainable one moved (LoRA's B from zero)."""
    for kind in KINDS:
        final = _weights(runs / f"{kind}-one")
        frozen = _frozen_names(kind, runs)
        initial = (load_file(str(runs / f"{kind}-base" / "model.safetensors"))
                   if kind in ("llama", "gpt2") else _model(kind, str(runs)).state_dict())
        for name in frozen:
            torch.testing.assert_close(final[name], initial[name].float(), atol=0, rtol=0)
        moved = [n for n in final if n not in frozen]
        assert moved and all(final[n].abs().sum() > 0 for n in moved if "lora_B" in n)


def _holdings(run: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(run.parent.glob(run.name + ".rank*"))]


@pytest.mark.parametrize("kind, name", CASES[2] + CASES[8])
def test_no_rank_holds_optimizer_state_or_gradients_of_frozen_parameters(runs, kind, name):
    """AdamW keeps two tensors per trainable element it steps; the groups and the
    gradient buffers hold trainable parameters (or ZeRO shards of them, a little padded)
    only, never a frozen one, which would add thousands of elements."""
    for rank in _holdings(runs / f"{kind}-{name}"):
        assert rank["all_train"] and not rank["frozen_in_groups"]
        assert rank["state_elements"] == 2 * rank["group_elements"]
        assert rank["group_elements"] <= rank["trainable_held"] + 64
        assert rank["memory"]["grads"] <= 4 * (rank["trainable_held"] + 64)


@pytest.mark.parametrize("kind, name", [("frozen", "dp2-z3"), ("lora", "dp2-z3"),
                                        ("llama", "dp2-z3"), ("lora", "2x2x2-z3")])
def test_zero3_shards_the_frozen_parameters_too(runs, kind, name):
    """Between steps a ZeRO-3 rank holds its shard of every parameter, frozen ones
    included: about half the model's bytes at dp 2 (ZeRO-0 holds all of it)."""
    whole = sum(t.numel() * 4 for t in _weights(runs / f"{kind}-one").values())
    for rank in _holdings(runs / f"{kind}-{name}"):
        assert rank["memory"]["params"] <= 0.6 * whole
    if name == "dp2-z3" and kind != "llama":
        for rank in _holdings(runs / f"{kind}-dp2-z0"):
            assert rank["memory"]["params"] >= 0.95 * whole


def test_a_lora_checkpoint_holds_the_adapters_and_resumes_in_another_layout(runs):
    from disttrain.checkpoint.manager import find_checkpoint, open_checkpoint

    found = find_checkpoint(runs / "lora-saved", warn=pytest.fail)
    names = open_checkpoint(found).reader.names("model/") + \
        open_checkpoint(found).reader.names("optim/")
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    resumed, ref = _weights(runs / "lora-resumed"), _weights(runs / "lora-one")
    for key in ref:
        torch.testing.assert_close(resumed[key], ref[key], atol=1e-4, rtol=0)


def _resume_other_base(root: str) -> str:
    """Resume the saved LoRA run with a base of another seed: the refusal's line."""
    from disttrain import Trainer
    from disttrain.config import load_config
    from disttrain.data import collate_token_batch
    from disttrain.errors import UserError
    from disttrain.models import GPT, token_loss

    run = f"{root}/lora-other-base"
    if not Path(run).exists():
        shutil.copytree(f"{root}/lora-saved", run)
    torch.manual_seed(12)
    model = GPT(load_config(values={"model": GPT_MODEL}).model)
    values = _values("lora", "one", root, {"every": 3, "async": False})
    try:
        Trainer(model, SyntheticTokens(mask=True), token_loss, load_config(values=values),
                collate_fn=collate_token_batch, run_dir=run, progress=False).fit()
    except UserError as e:
        return str(e)
    return ""


def test_a_resume_refuses_a_different_frozen_base(runs):
    [line] = run_distributed(_resume_other_base, 1, args=(str(runs),), timeout=120)
    assert "another frozen base" in line and "checkpoint.allow_changes" in line
    assert "\n" not in line


def _adapters(run: Path) -> dict[str, torch.Tensor]:
    from disttrain.checkpoint.manager import find_checkpoint, open_checkpoint

    reader = open_checkpoint(find_checkpoint(run, warn=pytest.fail)).reader
    return {n[len("model/"):]: reader.tensor(n) for n in reader.names("model/")}


def _base_plus_adapters(kind: str, root: Path, ids: torch.Tensor) -> torch.Tensor:
    """The plain PyTorch reference: the base model from its directory, each adapted
    layer's output plus (alpha / r) x A^T B^T from the checkpoint's tensors (hooks)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(root / f"{kind}-base", dtype=torch.float32)
    adapters = _adapters(root / f"{kind}-one")
    scale = LORA["lora_alpha"] / LORA["lora_rank"]
    paths = {n.rsplit(".", 2)[0] for n in adapters}
    assert paths and all(".lora_A." in n or ".lora_B." in n for n in adapters)
    for path in paths:
        a, b = adapters[f"{path}.lora_A.weight"], adapters[f"{path}.lora_B.weight"]
        model.get_submodule(path).register_forward_hook(
            lambda _m, args, out, a=a, b=b: out + scale * (args[0] @ a.t() @ b.t()))
    with torch.no_grad():
        return model(input_ids=ids).logits


IDS = torch.arange(24).reshape(2, 12) % 64


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_the_merged_export_computes_the_base_plus_its_adapters(runs, kind, tmp_path):
    from transformers import AutoModelForCausalLM

    from disttrain.lora.export import export_adapters

    out, weights = export_adapters(runs / f"{kind}-one", tmp_path / "merged", merge=True,
                                   warn=pytest.fail)
    assert weights.step == STEPS and weights.source.startswith("checkpoint")
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        got = merged(input_ids=IDS).logits
    torch.testing.assert_close(got, _base_plus_adapters(kind, runs, IDS), atol=1e-5,
                               rtol=1e-5)  # one merged matmul vs two: fp32 rounding


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_peft_loads_the_exported_adapters_onto_the_base(runs, kind, tmp_path):
    peft = pytest.importorskip("peft", reason="peft is an optional dependency (the "
                               "'peft' extra): the exported files are checked with it")
    from transformers import AutoModelForCausalLM

    from disttrain.lora.export import export_adapters

    out, _ = export_adapters(runs / f"{kind}-one", tmp_path / "peft", merge=False,
                             warn=pytest.fail)
    base = AutoModelForCausalLM.from_pretrained(runs / f"{kind}-base", dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, out)
    with torch.no_grad():
        got = model(input_ids=IDS).logits
    torch.testing.assert_close(got, _base_plus_adapters(kind, runs, IDS), atol=1e-6,
                               rtol=1e-6)


def test_exports_of_a_lora_run_refuse_what_cannot_hold_it(runs, tmp_path):
    """A plain hf export would miss the base; --merge goes with hf only; a merge on a
    base that changed since the run is refused and leaves nothing."""
    import dataclasses

    from safetensors.torch import save_file

    from disttrain.checkpoint.export import newest_weights
    from disttrain.cli import main
    from disttrain.errors import EXIT_USAGE, UserError
    from disttrain.lora.export import export_merged, lora_run

    run = runs / "llama-one"
    for args in (["--format", "hf"], ["--format", "peft", "--merge"]):
        assert main(["export", str(run), "--out", str(tmp_path / "x"), *args]) == EXIT_USAGE
    moved = tmp_path / "llama-base"
    shutil.copytree(runs / "llama-base", moved)
    tensors = load_file(str(moved / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1e-3
    save_file(tensors, str(moved / "model.safetensors"), metadata={"format": "pt"})
    lora = lora_run(run, newest_weights(run, warn=pytest.fail))
    config = {**lora.config, "model": {**lora.config["model"], "pretrained": str(moved)}}
    with pytest.raises(UserError, match="model.norm.weight differ"):
        export_merged(dataclasses.replace(lora, config=config), run, tmp_path / "merged")
    assert not (tmp_path / "merged" / "model.safetensors").exists()


def test_a_lora_run_without_checkpoints_exports_its_final_weights(runs, tmp_path, capsys):
    """The run's final model.safetensors holds the base as trained and the adapters:
    with no checkpoint the peft files carry the same adapters the checkpoint's do, the
    merged model is the checkpoint's merge (its base from model.pretrained), and a
    plain hf export is still refused (from_pretrained would drop the adapters)."""
    from disttrain.cli import main
    from disttrain.errors import EXIT_USAGE

    run = tmp_path / "llama-final"
    shutil.copytree(runs / "llama-one", run, ignore=shutil.ignore_patterns("checkpoints"))
    assert not (run / "checkpoints").exists()
    for fmt, where in (["peft"], "peft"), (["hf", "--merge"], "merged"):
        for source, out in ((runs / "llama-one", tmp_path / f"ckpt-{where}"),
                            (run, tmp_path / f"final-{where}")):
            assert main(["export", str(source), "--format", *fmt, "--out", str(out)]) == 0
        said = capsys.readouterr().out
        assert "from checkpoint" in said and "from the final weights" in said
        name = "adapter_model.safetensors" if where == "peft" else "model.safetensors"
        got = load_file(str(tmp_path / f"final-{where}" / name))
        want = load_file(str(tmp_path / f"ckpt-{where}" / name))
        assert got.keys() == want.keys()
        for key in want:  # the same tensors; the merge's W + (alpha/r) B A in fp32
            torch.testing.assert_close(got[key], want[key], atol=1e-6, rtol=0, msg=key)
    assert main(["export", str(run), "--format", "hf", "--out", str(tmp_path / "x")]) \
        == EXIT_USAGE
    assert "--format peft" in capsys.readouterr().err
