"""Config loading and validation: every bad input is one ConfigError naming the field."""

from __future__ import annotations

import pytest

from disttrain.config import load_config
from disttrain.config.dump import config_to_toml
from disttrain.errors import ConfigError, InputErrors, UserError
from disttrain.run_checks import resolve


def test_defaults_resolve_for_two_ranks():
    plan = resolve(load_config(), 2)
    assert (plan.layout.degree("dp"), plan.batch.global_batch, plan.batch.micro_batch,
            plan.batch.grad_accum) == (2, 32, 16, 1)


def test_toml_then_overrides(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[train]\nsteps = 7\nlr = 0.01\n[model]\nd_model = 64\n')
    cfg = load_config(path, ["train.lr=2e-3", 'data.path=""'])
    assert (cfg.train.steps, cfg.train.lr, cfg.model.d_model) == (7, 2e-3, 64)
    assert {"train.steps", "train.lr", "model.d_model"} <= cfg.explicit


def test_int_accepted_for_float_and_bare_string():
    cfg = load_config(overrides=["train.lr=1", "train.optimizer=sgd"])
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)
    assert cfg.train.optimizer == "sgd"


@pytest.mark.parametrize("given,expected", [
    ({"micro_batch": 4}, (32, 4, 4)),              # global from default, accum derived
    ({"grad_accum": 4}, (32, 4, 4)),               # micro derived
    ({"global_batch": 64}, (64, 32, 1)),
    ({"global_batch": 16, "micro_batch": 2}, (16, 2, 4)),
    ({"micro_batch": 2, "grad_accum": 3}, (12, 2, 3)),
    ({"global_batch": 24, "micro_batch": 3, "grad_accum": 4}, (24, 3, 4)),
])
def test_batch_triple_derives_the_third(given, expected):
    cfg = load_config(overrides=[f"train.{k}={v}" for k, v in given.items()])
    b = resolve(cfg, 2).batch
    assert (b.global_batch, b.micro_batch, b.grad_accum) == expected


@pytest.mark.parametrize("overrides,world,field,words", [
    (["train.stpes=3"], 2, "train.stpes", "did you mean train.steps"),
    (["trian.steps=3"], 2, "[trian]", "did you mean train"),
    (["train.steps=ten"], 2, "train.steps", "expected int"),
    (["train.steps=2.5"], 2, "train.steps", "expected int"),
    (["train.lr=-1"], 2, "train.lr", "must be > 0"),
    (["train.steps=0"], 2, "train.steps", "must be >= 1"),
    (["parallel.zero=4"], 2, "parallel.zero", "must be <= 3"),
    (["train.optimizer=adam"], 2, "train.optimizer", "adamw, sgd"),
    (["parallel.dp=3"], 2, "parallel.dp", "set parallel.dp=2"),
    (["train.micro_batch=5"], 2, "train.global_batch", "not divisible"),
    (["train.global_batch=30", "train.micro_batch=4"], 2, "train.global_batch",
     "not divisible"),
    (["train.global_batch=32", "train.micro_batch=4", "train.grad_accum=2"], 2,
     "train.global_batch", "must equal micro_batch x grad_accum x dp"),
    (["model.d_model=30", "model.n_head=4"], 2, "model.d_model", "divisible"),
    (["data.path=/no/such/dir"], 2, "data.path", "no such directory"),
    (["parallel.backend=nccl", "train.device=cpu"], 2, "parallel.backend", "gloo"),
    (["train.precision=fp16", "train.device=cpu"], 2, "train.precision", "bf16"),
    (["monitor.hang_timeout=400"], 2, "monitor.hang_timeout", "below"),
    (["train.compile=true", "parallel.tp=2"], 2, "train.compile", "parallel.tp=1"),
])
def test_bad_values_name_field_value_and_fix(overrides, world, field, words):
    with pytest.raises(ConfigError) as err:
        resolve(load_config(overrides=overrides), world)
    assert err.value.field == field
    message = str(err.value)
    assert words in message and "\n" not in message
    assert err.value.fix, "every error carries a fix"


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps = 1")
    with pytest.raises(UserError, match="not valid TOML"):
        load_config(bad)
    with pytest.raises(UserError, match="section.key=value"):
        load_config(overrides=["steps=3"])


def test_snapshot_round_trips_at_any_world_size(tmp_path):
    cfg = load_config(overrides=["train.micro_batch=4", "model.n_layer=3",
                                 "checkpoint.async=false"])
    plan = resolve(cfg, 2)
    path = tmp_path / "snap.toml"
    path.write_text(config_to_toml(cfg, plan))
    again = load_config(path)
    assert resolve(again, 2) == plan
    assert again.model.n_layer == 3 and again.checkpoint.async_ is False
    # the same global batch on another world size: the derived member adapts
    assert resolve(again, 4).batch.global_batch == 32
    assert resolve(again, 4).batch.grad_accum == 2


def test_every_bad_value_is_reported_not_only_the_first():
    with pytest.raises(InputErrors) as err:
        load_config(overrides=["train.steps=many", "train.lr=0", "model.nlayer=2", "oops"])
    fields = [getattr(e, "field", None) for e in err.value.errors]
    assert fields == [None, "model.nlayer", "train.steps", "train.lr"]  # --set, then by section
    lines = str(err.value).splitlines()
    assert len(lines) == 4 and "oops" in lines[0] and "did you mean model.n_layer" in lines[1]


def test_independent_section_checks_are_reported_together():
    with pytest.raises(InputErrors) as err:
        resolve(load_config(overrides=["model.d_model=30", "data.path=/no/such/dir"]), 2)
    assert [e.field for e in err.value.errors] == ["model.d_model", "data.path"]


def test_one_bad_value_is_still_one_config_error():
    with pytest.raises(ConfigError) as err:
        load_config(overrides=["train.steps=0", "train.lr=1e-3"])
    assert not isinstance(err.value, InputErrors) and err.value.field == "train.steps"
