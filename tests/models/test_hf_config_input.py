"""``model.hf_config`` is untrusted input: a config.json that is not JSON, names no or an
unknown family, holds values its config class rejects or dimensions no model can be
built with, or describes an encoder (which, trained as a causal LM, would see the tokens
it predicts) is refused before any worker starts: exit 2, one line naming
``model.hf_config``, no run directory. A sound decoder config still trains."""

from __future__ import annotations

import json

import pytest

from disttrain.cli import main

pytest.importorskip("transformers")

LLAMA = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32,
         "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 16}
BERT = {"model_type": "bert", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "intermediate_size": 64}

BAD = {
    "not-json": ("{ this is not json", "is not JSON"),
    "a-list": (json.dumps([1, 2, 3]), "holds no JSON object"),
    "no-model-type": (json.dumps({"hidden_size": 32}), "has no model_type"),
    "unknown-family": (json.dumps({**LLAMA, "model_type": "nosuchfamily"}),
                       "'nosuchfamily', which transformers"),
    "no-causal-lm": (json.dumps({"model_type": "t5", "d_model": 32}),
                     "has no causal language model"),
    "heads-not-dividing": (json.dumps({**LLAMA, "hidden_size": 30}),
                           "not a multiple of the number of attention heads"),
    "negative-vocab": (json.dumps({**LLAMA, "vocab_size": -5}), "cannot build this model"),
    "bert-encoder": (json.dumps(BERT), "would see the tokens it predicts"),
    "not-utf8": (b"\xff\xfe{}", "is not JSON"),
    "huge": (" " * (2 << 20), "not a config.json"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_hf_config_is_refused_before_launch(name, tmp_path, capsys):
    content, said = BAD[name]
    path = tmp_path / "config.json"
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)
    code = main(["train", "--nproc", "1", "--run-dir", str(tmp_path / "run"),
                 "--set", f"model.hf_config={path}", "--set", "model.seq_len=16"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith("disttrain: error: model.hf_config="), err
    assert said in err[0], err[0]
    assert "Traceback" not in err[0]
    assert not (tmp_path / "run").exists()


def test_a_decoder_bert_and_a_sound_llama_are_accepted(tmp_path):
    from disttrain.config import load_config
    from disttrain.models.hf import read_hf_config
    from disttrain.run_checks import resolve

    for name, values in (("llama", LLAMA), ("bert", {**BERT, "is_decoder": True})):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(values))
        assert read_hf_config(str(path)).model_type == name
        resolve(load_config(values={"model": {"hf_config": str(path), "seq_len": 16}}), 1)
