"""Shared by the instruction-data tests: a tiny word-level tokenizer saved with
``save_pretrained`` (nothing downloaded) under the chat template of one of four
families, and a tiny Llama saved beside it.

Every word and every special token is one token (``Whitespace`` pre-tokenization drops
spaces and newlines), so a test can write the token sequence it expects by hand."""

from __future__ import annotations

import json
from pathlib import Path

SPECIALS = ["<unk>", "<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>",
            "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
            "[INST]", "[/INST]"]
WORDS = ("system user assistant be brief hello there hi how are you fine thanks what is "
         "two plus three four five six seven the sky blue green red colour of grass yes "
         "no ok . ? ,").split()
VOCAB = 64  # the tiny Llama's; the tokenizer's ids stay below it

_CHATML = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nbe brief<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}")
_CHATML_MARKERS = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n"
    "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}\n{% else %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
    "<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% endif %}")
# the system message goes into the first user turn; roles must alternate
_MISTRAL = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] %}{% set rest = messages[1:] %}{% else %}"
    "{% set system = '' %}{% set rest = messages %}{% endif %}{% for m in rest %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
    "{% if m['role'] == 'user' %}[INST] {% if loop.first and system %}{{ system }}\n\n"
    "{% endif %}{{ m['content'] }} [/INST]{% else %}{{ m['content'] }}{{ eos_token }}"
    "{% endif %}{% endfor %}")
# marks the last message differently: a conversation's beginning is not a prefix of it
_UNSTABLE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if loop.last %}<|eot_id|>{% else %}<|im_end|>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# family -> (chat template or None, bos token, eos token)
FAMILIES = {"chatml": (_CHATML, "<s>", "<|im_end|>"),
            "chatml-markers": (_CHATML_MARKERS, "<s>", "<|im_end|>"),
            "llama3": (_LLAMA3, "<|begin_of_text|>", "<|eot_id|>"),
            "mistral": (_MISTRAL, "<s>", "</s>"),
            "unstable": (_UNSTABLE, "<s>", "</s>"),
            "none": (None, "<s>", "</s>")}


def save_tokenizer(directory: Path, family: str) -> Path:
    """A word-level fast tokenizer with ``family``'s chat template, saved in
    ``directory`` (tokenizer.json, tokenizer_config.json, chat_template.jinja)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    template, bos, eos = FAMILIES[family]
    vocab = {w: i for i, w in enumerate(SPECIALS + WORDS)}
    assert len(vocab) <= VOCAB
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>",
                                        pad_token="<pad>", bos_token=bos, eos_token=eos)
    if template is not None:
        tokenizer.chat_template = template
    tokenizer.save_pretrained(directory)
    return Path(directory)


def save_llama(directory: Path, family: str = "chatml", seq: int = 32) -> Path:
    """A tiny random Llama with ``family``'s tokenizer: a pretrained directory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(2)
    LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq,
        bos_token_id=2, eos_token_id=5, pad_token_id=1)).save_pretrained(directory)
    return save_tokenizer(directory, family)


def write_jsonl(path: Path, records: list) -> Path:
    """``records`` one per line: dicts as JSON, strings as they are (bad lines)."""
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
