"""``train.compile``: torch.compile per block under the strategies that allow it, the
model's own names in state dicts and checkpoints, and the refusals."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support import SyntheticTokens, state_of, tiny_config
from torch import nn

from disttrain.checkpoint import find_checkpoint, open_checkpoint
from disttrain.errors import ConfigError
from disttrain.models import GPT
from disttrain.names import WEIGHTS_FILE
from disttrain.parallel.activation import apply_activation_checkpointing, canonical_name
from disttrain.parallel.compilation import CompiledBlock, compile_blocks
from disttrain.run_checks import resolve
from disttrain.spec import generic_spec
from disttrain.testing import run_distributed

pytestmark = pytest.mark.slow  # spawns worlds or trains: not in the quick check

# layouts of a world of 2: the two (dp=2 plain and ZeRO-1), plus ZeRO-3 with
# activation checkpointing (gathers and frees in hooks around each compiled block) and
# a 2-stage pipeline; compiled code is cached in the process, so the later runs of the
# shared world cost little more than eager ones
LAYOUTS = {"ddp": {}, "zero1": {"zero": 1},
           "zero3+ac": {"zero": 3, "activation_checkpointing": "full"},
           "pp2": {"pp": 2, "grad_accum": 2}}
STEPS = 5


def _fit(run_dir: Path, compiled: bool, keys: dict) -> dict:
    from disttrain import Trainer
    from disttrain.data import collate_token_batch
    from disttrain.models import token_loss

    cfg = tiny_config({"every": STEPS} if compiled else None, **keys, steps=STEPS,
                      compile=compiled)
    torch.manual_seed(cfg.train.seed)
    model = GPT(cfg.model)
    Trainer(model, SyntheticTokens(mask=True), token_loss, cfg, run_dir=run_dir,
            collate_fn=collate_token_batch, progress=False).fit()
    return {"keys": list(model.state_dict()),
            "wrapped": all(any(isinstance(m, CompiledBlock) for m in b.modules())
                           for b in model.blocks)}


def _eager_and_compiled(root: str) -> dict:
    """Every layout trained eager then compiled, in this one world; on rank 0 the final
    weights, the model's state-dict keys, the compiled run's checkpoint names, and
    dynamo's counts."""
    import torch._dynamo.utils

    out = {}
    for name, keys in LAYOUTS.items():
        for compiled in (False, True):
            run_dir = Path(root) / f"{name}-{'compiled' if compiled else 'eager'}"
            got = _fit(run_dir, compiled, keys)
            if torch.distributed.get_rank() == 0:
                got["weights"] = load_file(str(run_dir / WEIGHTS_FILE))
                if compiled:
                    found = find_checkpoint(run_dir, warn=print)
                    got["saved"] = sorted(open_checkpoint(found).index.tensors)
            out[name, compiled] = got
    counters = torch._dynamo.utils.counters
    out["dynamo"] = {"frames": counters["frames"]["ok"],
                     "graph_breaks": sum(counters["graph_break"].values())}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("compile")
    return run_distributed(_eager_and_compiled, 2, args=(str(root),), timeout=600)[0]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_compiled_training_follows_the_eager_run(runs, layout):
    """Five AdamW steps with train.compile=true end within 1e-4 of the eager run's
    weights. Not bitwise: inductor fuses the blocks' kernels and reorders their
    floating-point sums (layer norm, softmax, matmul epilogues), so the gradients differ
    by rounding (the measured gap after 5 steps is about 1.3e-6 on this CPU); 1e-4 leaves
    room for other vector widths, while a wrong gradient (a hook that did not fire, a
    stale ZeRO shard) moves a weight by about lr = 3e-3 in one step."""
    eager, compiled = runs[layout, False], runs[layout, True]
    assert compiled["wrapped"]
    gap = 0.0
    for name, w in eager["weights"].items():
        torch.testing.assert_close(compiled["weights"][name], w, rtol=0, atol=1e-4)
        gap = max(gap, (compiled["weights"][name] - w).abs().max().item())
    assert gap > 0  # compiled kernels really ran
    assert runs["dynamo"]["frames"] >= 1 and runs["dynamo"]["graph_breaks"] == 0


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_compiled_runs_keep_the_models_own_names(runs, layout):
    plain = list(GPT(tiny_config().model).state_dict())
    compiled = runs[layout, True]
    assert compiled["keys"] == plain
    saved = compiled["saved"]
    assert {n[len("model/"):] for n in saved if n.startswith("model/")} == set(plain) - {
        "head.weight"}  # the tied head is stored once, under the embedding's name
    assert not [n for n in saved if "compiled" in n or "_orig_mod" in n]


def test_compiled_block_state_dict_round_trips_with_checkpointing():
    cfg = tiny_config()
    torch.manual_seed(0)
    eager, model = GPT(cfg.model), GPT(cfg.model)
    assert compile_blocks(model.blocks) == cfg.model.n_layer
    assert compile_blocks(model.blocks) == 0  # idempotent
    apply_activation_checkpointing(model, "full")
    assert list(model.state_dict()) == list(eager.state_dict())
    assert {canonical_name(n) for n, _ in model.named_parameters()} == {
        n for n, _ in eager.named_parameters()}
    model.load_state_dict(eager.state_dict())
    for name, t in state_of(model).items():
        assert torch.equal(t, eager.state_dict()[name])


@pytest.mark.parametrize("keys,world", [({"tp": 2}, 2), ({"tp": 2, "pp": 2}, 4),
                                        ({"tp": 2, "zero": 1}, 4)])
def test_tensor_parallelism_refuses_compile_in_one_line(keys, world):
    with pytest.raises(ConfigError) as err:
        resolve(tiny_config(compile=True, **keys), world)
    message = str(err.value)
    assert err.value.field == "train.compile" and err.value.value is True
    assert message.startswith("train.compile=True: ") and "\n" not in message
    assert "tensor-parallel layers run collectives" in message
    assert "set train.compile=false, or parallel.tp=1" in err.value.fix


def test_a_model_without_a_block_list_refuses_compile():
    spec = generic_spec(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    with pytest.raises(ConfigError, match="no block list") as err:
        resolve(tiny_config(compile=True), 1, spec)
    assert err.value.field == "train.compile" and "\n" not in str(err.value)


def test_no_cpu_compiler_refuses_compile():
    from torch._inductor import config as inductor

    # torch's own override (monkeypatch's undo leaves the config without the key)
    with inductor.patch({"cpp.cxx": (None, "no-such-c++-compiler")}), \
            pytest.raises(ConfigError, match="no-such-c\\+\\+-compiler") as err:
        resolve(tiny_config(compile=True, device="cpu"), 1)
    assert err.value.field == "train.compile" and "install g++" in err.value.fix
