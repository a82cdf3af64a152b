"""Which tokens of an instruction or chat example are trained on, exactly, for four chat
template families (ChatML with a default system prompt, Llama 3, Mistral's [INST]
with the system merged into the first turn, and ChatML with ``{% generation %}``
markers), and prompt / completion examples. The expected tokens are written out by
hand (the test tokenizer makes every word and special token one token)."""

from __future__ import annotations

import pytest
from chat_support import save_tokenizer

from disttrain.data.chat import BadExample, ExampleEncoder, NoChatTemplate, load_tokenizer

pytest.importorskip("transformers")

CONVERSATION = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": "hello there"},
                {"role": "assistant", "content": "hi how are you"},
                {"role": "user", "content": "fine thanks"},
                {"role": "assistant", "content": "ok ."}]
# (token, trained) for the conversation; "+" marks a trained token
EXPECTED = {
    "chatml": "<|im_start|> system be brief <|im_end|> <|im_start|> user hello there "
              "<|im_end|> <|im_start|> assistant +hi +how +are +you +<|im_end|> "
              "<|im_start|> user fine thanks <|im_end|> <|im_start|> assistant +ok +. "
              "+<|im_end|>",
    "chatml-markers": "<|im_start|> system be brief <|im_end|> <|im_start|> user hello "
                      "there <|im_end|> <|im_start|> assistant +hi +how +are +you "
                      "+<|im_end|> <|im_start|> user fine thanks <|im_end|> <|im_start|> "
                      "assistant +ok +. +<|im_end|>",
    "llama3": "<|begin_of_text|> <|start_header_id|> system <|end_header_id|> be brief "
              "<|eot_id|> <|start_header_id|> user <|end_header_id|> hello there "
              "<|eot_id|> <|start_header_id|> assistant <|end_header_id|> +hi +how +are "
              "+you +<|eot_id|> <|start_header_id|> user <|end_header_id|> fine thanks "
              "<|eot_id|> <|start_header_id|> assistant <|end_header_id|> +ok +. "
              "+<|eot_id|>",
    "mistral": "<s> [INST] be brief hello there [/INST] +hi +how +are +you +</s> [INST] "
               "fine thanks [/INST] +ok +. +</s>",
}


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    out = {}
    for family in (*EXPECTED, "unstable", "none"):
        directory = save_tokenizer(root / family, family)
        out[family] = ExampleEncoder(load_tokenizer(directory, "data.tokenizer"), directory)
    return out


def _marked(encoder, record) -> str:
    ids, trained = encoder.encode(record)
    tokens = encoder.tokenizer.convert_ids_to_tokens(ids)
    return " ".join(("+" if t else "") + tok for tok, t in zip(tokens, trained, strict=True))


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_only_the_assistant_turns_are_trained(encoders, family):
    assert _marked(encoders[family], {"messages": CONVERSATION}) == EXPECTED[family]


def test_the_default_system_prompt_of_a_template_is_context(encoders):
    """ChatML's template adds a system turn when there is none: it renders at every
    prefix, so it is found as context, never trained."""
    got = _marked(encoders["chatml"], {"messages": CONVERSATION[1:3]})
    assert got == ("<|im_start|> system be brief <|im_end|> <|im_start|> user hello there "
                   "<|im_end|> <|im_start|> assistant +hi +how +are +you +<|im_end|>")


@pytest.mark.parametrize("family", ["chatml", "llama3", "mistral"])
def test_prompt_completion_trains_the_completion_and_the_end_token(encoders, family):
    eos = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>", "mistral": "</s>"}[family]
    got = _marked(encoders[family], {"prompt": "what is two plus three ?",
                                     "completion": "five", "id": 7})
    assert got == f"what is two plus three ? +five +{eos}"
    # a completion that already ends with the end token does not get a second one
    got = _marked(encoders[family], {"prompt": "yes ?", "completion": f"no {eos}"})
    assert got == f"yes ? +no +{eos}"


def test_the_first_token_is_never_trained(encoders):
    """No logit predicts position 0, so a completion with an empty prompt starts
    training at its second token."""
    assert _marked(encoders["mistral"], {"prompt": "", "completion": "hi there"}) == \
        "hi +there +</s>"


def test_a_template_that_rewrites_earlier_turns_is_refused_not_guessed(encoders):
    with pytest.raises(BadExample, match="renders message 2 differently") as error:
        encoders["unstable"].encode({"messages": CONVERSATION[1:3]})
    assert "{% generation %}" in error.value.detail.fix


def test_a_chat_for_a_tokenizer_without_a_template(encoders):
    with pytest.raises(NoChatTemplate, match="has no chat template"):
        encoders["none"].encode({"messages": CONVERSATION})
    # prompt / completion needs none
    assert _marked(encoders["none"], {"prompt": "hi", "completion": "ok"}) == "hi +ok +</s>"


BAD = [
    ({"prompt": "hi"}, "missing field 'completion'"),
    ({"completion": "hi"}, "missing field 'prompt'"),
    ({"prompt": "hi", "completion": 3}, "field 'completion' is a int"),
    ({"text": "hi"}, "has neither prompt/completion nor messages (keys: text)"),
    ({"messages": CONVERSATION, "prompt": "x"}, "has both"),
    ({"messages": []}, "messages is not a non-empty list"),
    ({"messages": [{"role": "user"}]}, "message 1 is not an object with role and content"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "ok"}]},
     "message 2 has unknown role 'bot'"),
    ({"messages": [{"role": "user", "content": ["hi"]}]}, "message 1's content is a list"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "has no assistant message"),
    ({"messages": [{"role": "assistant", "content": "hi"}]}, "opens with an assistant"),
]


@pytest.mark.parametrize("record, problem", BAD, ids=[p for _, p in BAD])
def test_bad_records_say_what_is_wrong(encoders, record, problem):
    with pytest.raises(BadExample) as error:
        encoders["chatml"].encode(record)
    assert problem in error.value.detail.problem


def test_a_template_refusing_a_conversation_is_a_bad_example(encoders):
    """Mistral's template raises on turns that do not alternate."""
    two_users = [{"role": "user", "content": "hi"}, {"role": "user", "content": "yes"},
                 {"role": "assistant", "content": "ok"}]
    with pytest.raises(BadExample, match="roles must alternate") as error:
        encoders["mistral"].encode({"messages": two_users})
    assert "\n" not in error.value.detail.problem
