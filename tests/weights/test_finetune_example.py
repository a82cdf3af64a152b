"""The fine-tuning guide's examples (docs/guides/finetune.md) run as printed (fewer
steps) on a tiny Llama saved with ``save_pretrained``: two ranks at tp 2 start from its
weights, and the export loads back with ``from_pretrained`` under the same names; LoRA
at tp 2 saves adapters only, exported for peft and merged."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # spawns worlds or trains: not in the quick check

pytest.importorskip("transformers")

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "finetune.md"


def _run_section(heading: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """The guide's bash block under ``heading``, with 3 training steps, on a tiny Llama
    saved as ./my-llama in ``tmp_path``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    text = GUIDE.read_text(encoding="utf-8")
    start = text.index(heading)
    script = re.search(r"```bash\n(.*?)```", text[start:], re.S).group(1)
    assert len(script.strip().splitlines()) < 15
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        bos_token_id=0, eos_token_id=0)).save_pretrained(tmp_path / "my-llama")
    script = script.replace("train.steps=200", "train.steps=3")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")}
    env["DISTTRAIN_CACHE"] = str(tmp_path / "cache")
    bin_dir = Path(os.sys.executable).parent
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    done = subprocess.run(["bash", "-e", "-c", script], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tp=2" in done.stderr
    return done


def test_the_finetune_example_runs(tmp_path):
    from transformers import AutoModelForCausalLM

    _run_section("## Fine-tune a local pretrained model on 2 ranks", tmp_path)
    tuned = AutoModelForCausalLM.from_pretrained(tmp_path / "my-llama-tuned")
    original = AutoModelForCausalLM.from_pretrained(tmp_path / "my-llama")
    assert sorted(tuned.state_dict()) == sorted(original.state_dict())


def test_the_lora_example_runs(tmp_path):
    """The LoRA lines: the checkpoint holds adapters only, the merged export loads with
    from_pretrained under the base's names (and differs from the base: the adapters
    trained), the peft export loads onto the base with peft, where it is installed."""
    from transformers import AutoModelForCausalLM

    from disttrain.checkpoint.manager import find_checkpoint, open_checkpoint

    _run_section("## LoRA: adapters beside a frozen model", tmp_path)
    reader = open_checkpoint(find_checkpoint(tmp_path / "runs" / "lora",
                                             warn=pytest.fail)).reader
    assert all(".lora_" in n for n in reader.names("model/") + reader.names("optim/"))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "my-llama-merged")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "my-llama")
    assert sorted(merged.state_dict()) == sorted(base.state_dict())
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged.state_dict()[name], base.state_dict()[name])
    assert (tmp_path / "my-llama-lora" / "adapter_model.safetensors").is_file()
    peft = pytest.importorskip("peft", reason="peft is optional (the 'peft' extra)")
    ids = torch.arange(16).reshape(1, 16)
    with torch.no_grad():
        loaded = peft.PeftModel.from_pretrained(base, tmp_path / "my-llama-lora")
        torch.testing.assert_close(loaded(input_ids=ids).logits,
                                   merged(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
