"""Models built on the meta device start from the same weights at every layout.

The command line's models (the built-in GPT, transformers GPT-2 and Llama) are built
under ``torch.device("meta")``; each rank gives storage to its own part and fills it
from the seeded initialiser (a generator per tensor, keyed by the seed and the tensor's
name). The initial state every rank holds when training starts, gathered piece by
piece, must be bitwise equal to the one-process state at dp 2 ZeRO-3, pp 2, tp 2 and
(2, 2, 2) ZeRO-1; Llama's rotary frequencies equal freshly computed ones; GPT-2's head
stays its embedding. No tolerance: the same generator draws the same numbers, and a
rank that drew another stream, cut the wrong slice or left a tensor unfilled differs
in most elements.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from support import SyntheticTokens

from disttrain import Callback
from disttrain.testing import run_distributed

pytestmark = pytest.mark.slow  # spawns worlds or trains: not in the quick check

FAMILIES = ("gpt", "gpt2", "llama")
MODEL = {"vocab_size": 64, "seq_len": 16, "n_layer": 4, "n_head": 4, "d_model": 32}
# name -> (dp, pp, tp), zero
CASES = {2: {"dp2-z3": ((2, 1, 1), 3), "pp2": ((1, 2, 1), 0), "tp2": ((1, 1, 2), 0)},
         8: {"2x2x2-z1": ((2, 2, 2), 1)}}


def _config(family: str, layout: tuple[int, int, int], zero: int):
    from disttrain.config import load_config

    dp, pp, tp = layout
    model = {**MODEL, **({"name": family, "n_kv_head": 2 if family == "llama" else 0}
                         if family != "gpt" else {})}
    return load_config(values={
        "model": model,
        "train": {"steps": 1, "global_batch": 8, "grad_accum": 2, "eval_samples": 8,
                  "log_every": 1, "seed": 7},
        "parallel": {"dp": dp, "pp": pp, "tp": tp, "zero": zero},
        "checkpoint": {"every": 0}, "monitor": {"peak_tflops": 1.0}})


class InitialState(Callback):
    """At the start of training, the full initial model (parameters and persistent
    buffers) gathered from every rank's pieces to rank 0 and written to ``path``."""

    all_ranks = True

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_start(self, trainer) -> None:
        pieces = [(p.name, p.global_shape, p.offsets, p.tensor.detach().cpu().clone())
                  for p in trainer.parallel.state.state_pieces(trainer.optimizer)
                  if p.name.startswith("model/")]
        everyone = trainer.world.all_gather_object(pieces)
        if trainer.rank != 0:
            return
        full: dict[str, torch.Tensor] = {}
        for name, shape, offsets, t in (x for rank in everyone for x in rank):
            out = full.setdefault(name, torch.full(shape, float("nan"), dtype=t.dtype))
            out[tuple(slice(o, o + n) for o, n in zip(offsets, t.shape, strict=False))] = t
        save_file(full, self.path)
        module = trainer.parallel.module
        buffers = {n: b for n, b in module.named_buffers() if n.endswith("inv_freq")}
        torch.save({"inv_freq": {n: b.cpu() for n, b in buffers.items()},
                    "tied": _tied(module)}, self.path + ".extra")

    def on_train_end(self, trainer, summary) -> None:  # every rank's rotary buffers
        torch.save({n: b.cpu() for n, b in trainer.parallel.module.named_buffers()
                    if n.endswith("inv_freq")}, f"{self.path}.rank{trainer.rank}.rotary")


def _tied(module: torch.nn.Module) -> bool | None:
    heads = [m for n, m in module.named_modules() if n.endswith("lm_head")]
    embeds = [m for n, m in module.named_modules() if n.endswith("wte")]
    if not heads or not embeds:
        return None
    return heads[0].weight is embeds[0].weight


def _build(family: str, cfg) -> torch.nn.Module:
    from disttrain.models import GPT
    from disttrain.models.hf import build_hf_model

    with torch.device("meta"):
        return GPT(cfg.model) if family == "gpt" else build_hf_model(cfg.model)


def _run(root: str, cases: dict) -> None:
    from disttrain import Trainer
    from disttrain.data import collate_token_batch
    from disttrain.models import token_loss

    for family in FAMILIES:
        for name, (layout, zero) in cases.items():
            cfg = _config(family, layout, zero)
            path = f"{root}/{family}-{name}.safetensors"
            Trainer(_build(family, cfg), SyntheticTokens(),
                    token_loss if family == "gpt" else None, cfg,
                    collate_fn=collate_token_batch, run_dir=f"{root}/{family}-{name}",
                    progress=False, callbacks=[InitialState(path)]).fit()


@pytest.fixture(scope="module")
def states(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("meta")
    run_distributed(_run, 1, args=(str(root), {"one": ((1, 1, 1), 0)}), timeout=120)
    for world, cases in CASES.items():
        run_distributed(_run, world, args=(str(root), cases), timeout=300)
    return root


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", [c for cases in CASES.values() for c in cases])
def test_initial_weights_do_not_depend_on_the_layout(states, family, case):
    one = load_file(str(states / f"{family}-one.safetensors"))
    other = load_file(str(states / f"{family}-{case}.safetensors"))
    assert sorted(one) == sorted(other)
    for name, t in one.items():
        assert torch.equal(t, other[name]), name
        assert not torch.isnan(t).any(), name


@pytest.mark.parametrize("family", FAMILIES)
def test_the_initial_model_is_the_models_own_initialisation_seeded(states, family):
    """Not garbage and not zeros: matrices N(0, 0.02) (GPT-2's and the GPT's residual
    projections smaller), norms 1, biases 0; distinct tensors draw distinct numbers."""
    one = load_file(str(states / f"{family}-one.safetensors"))
    matrices = {n: t for n, t in one.items() if t.dim() == 2}
    for name, t in matrices.items():
        assert 0.002 < float(t.std()) < 0.03, name
    firsts = {float(t.reshape(-1)[0]) for t in matrices.values()}
    assert len(firsts) == len(matrices)  # no two tensors from one stream
    norms = [t for n, t in one.items() if t.dim() == 1 and ("ln" in n or "norm" in n)
             and n.endswith("weight")]
    assert norms and all(torch.equal(t, torch.ones_like(t)) for t in norms)


def test_rotary_frequencies_are_computed_and_gpt2_stays_tied(states):
    from disttrain.models.hf import build_hf_model

    cfg = _config("llama", (1, 1, 1), 0)
    fresh = build_hf_model(cfg.model).model.rotary_emb.inv_freq
    extra = torch.load(str(states / "llama-one.safetensors.extra"))
    assert extra["inv_freq"] and all(torch.equal(b, fresh) for b in extra["inv_freq"].values())
    assert torch.load(str(states / "gpt2-one.safetensors.extra"))["tied"] is True
    # on every rank of every layout, pipeline stages included
    for world, cases in CASES.items():
        for case in cases:
            for rank in range(world):
                found = torch.load(str(states / f"llama-{case}.safetensors.rank{rank}.rotary"))
                assert found and all(torch.equal(b, fresh) for b in found.values()), case


def test_a_70b_llama_is_built_on_meta_in_little_memory():
    """The command line's model path for a 70B-Llama shape (80 layers, 8192 wide, GQA
    64/8, 128k vocabulary): the model on meta, its spec and its seeded initialiser
    (which keeps a meta copy) allocate under 100 MB beyond the code they import,
    although the fp32 weights are ~280 GB."""
    import tracemalloc

    from disttrain.config import load_config
    from disttrain.models.hf import build_hf_model, hf_spec
    from disttrain.weights import initial_weights

    cfg = load_config(values={"model": {"name": "llama", "n_layer": 80, "d_model": 8192,
                                        "n_head": 64, "n_kv_head": 8, "vocab_size": 128256,
                                        "seq_len": 4096}})

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    with torch.device("meta"):  # the code it runs, imported first: not the model's
        initial_weights(build_hf_model(_config("llama", (1, 1, 1), 0).model), seed=0)
    before = rss()
    tracemalloc.start()
    with torch.device("meta"):
        model = build_hf_model(cfg.model)
    spec = hf_spec(model)
    source = initial_weights(model, seed=0)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    grown = rss() - before
    params = sum(p.numel() for p in model.parameters())
    assert params > 60e9 and spec.tp_plan and source.shape(
        "model/model.layers.79.mlp.down_proj.weight") == (8192, 4 * 8192)
    assert peak < 100e6 and grown < 100e6, (peak, grown)


def _compiled(root: str) -> None:
    """The built-in GPT compiled per block, with activation checkpointing, under ZeRO-3."""
    from disttrain import Trainer
    from disttrain.data import collate_token_batch
    from disttrain.models import token_loss

    cfg = _config("gpt", (2, 1, 1), 3)
    cfg.train.compile = True
    cfg.train.activation_checkpointing = "full"
    path = f"{root}/gpt-compiled.safetensors"
    Trainer(_build("gpt", cfg), SyntheticTokens(), token_loss, cfg,
            collate_fn=collate_token_batch, run_dir=f"{root}/gpt-compiled",
            progress=False, callbacks=[InitialState(path)]).fit()


def test_compiled_blocks_start_from_the_same_weights(states):
    run_distributed(_compiled, 2, args=(str(states),), timeout=600)
    one = load_file(str(states / "gpt-one.safetensors"))
    compiled = load_file(str(states / "gpt-compiled.safetensors"))
    assert sorted(one) == sorted(compiled)
    assert all(torch.equal(t, compiled[n]) for n, t in one.items())
