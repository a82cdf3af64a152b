"""LoRA in one process: the adapted layer against its formula, which layers are adapted,
the refusals, the seeded values (the same on meta), the tensor-parallel classification
of the factors, and peft's own LoRA on the same tensors (where peft is installed)."""

from __future__ import annotations

import pytest
import torch
from support import TINY_MODEL
from torch import nn

from disttrain.adapters import LoRALinear, lora_modules
from disttrain.config import load_config
from disttrain.errors import ConfigError
from disttrain.lora import LoRASettings, add_lora
from disttrain.models import GPT
from disttrain.models.gpt import GPT_TP_PLAN, gpt_spec
from disttrain.spec import PARTIAL, SHARDED, classify_tp_params


def _gpt(meta: bool = False) -> GPT:
    cfg = load_config(values={"model": TINY_MODEL}).model
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            return GPT(cfg)
    return GPT(cfg)


def _random_adapters(model: nn.Module) -> None:
    """Non-zero A and B everywhere, so the update is not the zero of a fresh start."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for _, m in lora_modules(model):
            for f in (m.lora_A, m.lora_B):
                f.weight.copy_(torch.randn(f.weight.shape, generator=g) * 0.1)


def test_the_adapted_layer_is_its_base_plus_the_scaled_low_rank_update():
    torch.manual_seed(1)
    base = nn.Linear(8, 6)
    layer = LoRALinear(base, rank=2, alpha=4.0, dropout=0.0)
    layer.reset_adapters()
    x = torch.randn(3, 5, 8)
    torch.testing.assert_close(layer(x), base(x))  # B starts at zero
    _random_adapters(nn.ModuleDict({"l": layer}))
    a, b = layer.lora_A.weight, layer.lora_B.weight
    want = x @ base.weight.t() + base.bias + 2.0 * (x @ a.t() @ b.t())
    torch.testing.assert_close(layer(x), want)
    torch.testing.assert_close(base.weight + layer.delta(), (b @ a) * 2.0 + base.weight)


def test_a_transposed_base_as_gpt2_stores_it():
    pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(2)
    base = Conv1D(6, 8)  # weight [in=8, out=6], y = x @ W + b
    layer = LoRALinear(base, rank=2, alpha=2.0, dropout=0.0, transposed=True)
    _random_adapters(nn.ModuleDict({"l": layer}))
    x = torch.randn(4, 8)
    a, b = layer.lora_A.weight, layer.lora_B.weight
    torch.testing.assert_close(layer(x), x @ base.weight + base.bias + x @ a.t() @ b.t())
    merged = x @ (base.weight + layer.delta()) + base.bias
    torch.testing.assert_close(layer(x), merged)


def test_the_default_targets_are_the_attention_and_mlp_projections_and_the_rest_freezes():
    model = _gpt()
    adapted = add_lora(model, LoRASettings(rank=2), gpt_spec(model.cfg), seed=3)
    assert adapted == [f"blocks.{i}.{n}" for i in range(2)
                       for n in ("attn.qkv", "attn.out", "mlp.up", "mlp.down")]
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable == sorted(f"{a}.lora_{f}.weight" for a in adapted for f in "AB")
    names = [n for n, _ in model.named_parameters()]
    assert "blocks.0.attn.qkv.base_layer.weight" in names


@pytest.mark.parametrize("targets, problem", [
    (("q_proj",), "matches no module"),
    (("ln1",), "not a linear layer"),
    (("head",), "output head"),
])
def test_targets_that_cannot_be_adapted_are_refused_in_one_line(targets, problem):
    model = _gpt()
    with pytest.raises(ConfigError) as info:
        add_lora(model, LoRASettings(rank=2, targets=targets), gpt_spec(model.cfg), seed=3)
    assert info.value.field == "model.lora_targets" and problem in str(info.value)
    assert info.value.fix and "\n" not in str(info.value)


def test_targets_are_needed_where_the_spec_names_no_projections():
    from disttrain.spec import generic_spec

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.raises(ConfigError, match="model.lora_targets"):
        add_lora(model, LoRASettings(rank=2), generic_spec(model), seed=0)
    assert add_lora(model, LoRASettings(rank=2, targets=("0", "2")), generic_spec(model),
                    seed=0) == ["0", "2"]


def test_the_adapters_are_seeded_by_name_alike_on_meta_and_on_a_device():
    """A model built on meta gets its adapters from the seeded initialiser; one with
    values from add_lora itself: the same A (B zero) either way, and the base's seeded
    values are those of the model without adapters."""
    from disttrain.weights import initial_weights

    real, meta, plain = _gpt(), _gpt(meta=True), _gpt(meta=True)
    for model in (real, meta):
        add_lora(model, LoRASettings(rank=2), gpt_spec(model.cfg), seed=9)
    seeded, unadapted = initial_weights(meta, 9), initial_weights(plain, 9)
    name = "blocks.1.mlp.down"
    got_a = seeded.tensor(f"model/{name}.lora_A.weight")
    torch.testing.assert_close(got_a, real.get_submodule(name).lora_A.weight.detach(),
                               atol=0, rtol=0)
    assert got_a.abs().sum() > 0
    assert not seeded.tensor(f"model/{name}.lora_B.weight").any()
    torch.testing.assert_close(seeded.tensor(f"model/{name}.weight"),
                               unadapted.tensor(f"model/{name}.weight"), atol=0, rtol=0)


def test_the_tp_plan_splits_each_adapter_with_its_layer():
    model = _gpt(meta=True)
    add_lora(model, LoRASettings(rank=2), gpt_spec(model.cfg), seed=0)
    kinds = classify_tp_params(model, GPT_TP_PLAN)
    assert kinds["blocks.0.attn.qkv.weight"] == SHARDED  # the base, under its own name
    assert kinds["blocks.0.attn.qkv.lora_A.weight"] == PARTIAL
    assert kinds["blocks.0.attn.qkv.lora_B.weight"] == SHARDED
    assert kinds["blocks.0.attn.out.lora_A.weight"] == SHARDED
    assert kinds["blocks.0.attn.out.lora_B.weight"] == PARTIAL


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(4)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16))


def test_a_llama_gets_adapters_on_its_seven_projections():
    from disttrain.spec import spec_for

    model = _tiny_llama()
    adapted = add_lora(model, LoRASettings(rank=2), spec_for(model), seed=0)
    leaves = sorted({n.rpartition(".")[2] for n in adapted})
    assert leaves == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj",
                      "v_proj"]
    assert len(adapted) == 14


def test_peft_computes_the_same_logits_from_the_same_tensors():
    """peft's own LoRA on the same base, given our adapter tensors under peft's names
    (``base_model.model.<path>.lora_A.weight``): the same logits."""
    peft = pytest.importorskip("peft", reason="peft is an optional dependency (the "
                               "'peft' extra)")
    import copy

    from disttrain.spec import spec_for

    base = _tiny_llama()
    ours = copy.deepcopy(base)
    add_lora(ours, LoRASettings(rank=4, alpha=8.0), spec_for(ours), seed=0)
    _random_adapters(ours)
    theirs = peft.get_peft_model(base, peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                           "gate_proj", "up_proj", "down_proj"]))
    tensors = {f"base_model.model.{n}": p.detach() for n, p in ours.named_parameters()
               if ".lora_" in n}
    result = peft.set_peft_model_state_dict(theirs, tensors)
    assert not result.unexpected_keys
    ids = torch.arange(20).reshape(2, 10) % 64
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=ids).logits, theirs(input_ids=ids).logits)
