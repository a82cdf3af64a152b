"""The fine-tuning guide's example (docs/guides/finetune.md) runs as printed (fewer
steps) on a tiny Llama saved with ``save_pretrained``: two ranks at tp 2 start from its
weights, and the export loads back with ``from_pretrained`` under the same names."""

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


def test_the_finetune_example_runs(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    text = GUIDE.read_text(encoding="utf-8")
    start = text.index("## Fine-tune a local pretrained model on 2 ranks")
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
    tuned = AutoModelForCausalLM.from_pretrained(tmp_path / "my-llama-tuned")
    original = AutoModelForCausalLM.from_pretrained(tmp_path / "my-llama")
    assert sorted(tuned.state_dict()) == sorted(original.state_dict())
