"""One instruction or chat example -> token ids and which of them are trained on.

An example is a JSON object ``{"prompt": str, "completion": str}`` (the completion and
its EOS trained) or ``{"messages": [{"role", "content"}, ...]}`` (rendered by the
tokenizer's chat template; each assistant turn trained through its end-of-turn token,
which teaches the model to stop). Every problem with an example is a
:class:`BadExample`; a chat without a chat template is a :class:`NoChatTemplate`, which
no ``data.on_bad_example`` skips: the configuration is wrong, not the example. The rules
in full: ``docs/guides/finetune.md``, "What is trained".
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from disttrain.data.records import Problem
from disttrain.errors import ConfigError

ROLES = ("system", "user", "assistant")
ASSISTANT = "assistant"
_GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")  # transformers' test
_SHAPES = 'give {"prompt": ..., "completion": ...} or {"messages": [...]}'


class BadExample(Exception):
    """An example that cannot be trained on: ``problem`` and ``fix``, one line each."""

    def __init__(self, problem: str, fix: str) -> None:
        super().__init__(problem)
        self.detail = Problem(" ".join(problem.split()), fix)


class NoChatTemplate(BadExample):
    """A chat example, and the tokenizer has no chat template."""


def load_tokenizer(directory: Path, field: str) -> Any:
    """A transformers fast tokenizer from ``directory`` (local files only); ``field``
    is the config key that named it, for the error."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as exc:  # the library's own error types: one line
        raise ConfigError(field, str(directory), "cannot be loaded as a tokenizer "
                          f"({' '.join(str(exc).split())[:300]})", "give a directory "
                          "written by save_pretrained with its tokenizer files") from None
    if not getattr(tokenizer, "is_fast", False):
        raise ConfigError(field, str(directory), "holds no fast tokenizer (tokenizer.json)",
                          "save the tokenizer with tokenizer.json: the trained tokens "
                          "are located by the fast tokenizer's character offsets")
    return tokenizer


class ExampleEncoder:
    """Examples -> (token ids, trained flags), for one tokenizer. ``encode`` gives lists
    of equal length; ``trained[0]`` is never set (no logit predicts the first token).

    A prompt is tokenized with the tokenizer's special tokens, the completion apart (no
    token spans the two), then EOS unless it ends with one. A chat's assistant spans
    come from the template's ``{% generation %}`` markers where it has them; else the
    conversation is rendered prefix by prefix (message ``i`` spans from the end of
    ``messages[:i]`` with the generation prompt to the end of ``messages[:i + 1]``, both
    required to begin the whole text), and a token is trained when its characters
    overlap a span (the rule transformers applies to the markers)."""

    def __init__(self, tokenizer: Any, where: Path) -> None:
        self.tokenizer, self.where = tokenizer, where
        self.eos: int | None = tokenizer.eos_token_id
        try:
            template: str | None = tokenizer.get_chat_template()
        except ValueError:  # none, or several and no default
            template = None
        self.template = template
        self.markers = bool(template) and bool(_GENERATION_MARKER.search(template or ""))

    def encode(self, record: Mapping[str, Any]) -> tuple[list[int], list[bool]]:
        has_chat = "messages" in record
        if has_chat and ("prompt" in record or "completion" in record):
            raise BadExample("has both messages and prompt/completion", _SHAPES)
        if has_chat:
            ids, trained = self._chat(_messages(record["messages"]))
        elif "prompt" in record or "completion" in record:
            ids, trained = self._completion(_text(record, "prompt"),
                                            _text(record, "completion"))
        else:
            raise BadExample(f"has neither prompt/completion nor messages (keys: "
                             f"{', '.join(sorted(record)[:8]) or 'none'})", _SHAPES)
        if trained:
            trained[0] = False
        return ids, trained

    def _completion(self, prompt: str, completion: str) -> tuple[list[int], list[bool]]:
        head = list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        tail = list(self.tokenizer(completion, add_special_tokens=False)["input_ids"])
        if self.eos is not None and (not tail or tail[-1] != self.eos):
            tail.append(self.eos)
        return head + tail, [False] * len(head) + [True] * len(tail)

    def _chat(self, messages: list[dict[str, str]]) -> tuple[list[int], list[bool]]:
        if not self.template:
            raise NoChatTemplate(f"is a chat (messages), and the tokenizer in {self.where} "
                                 "has no chat template", "use a tokenizer whose "
                                 "tokenizer_config.json or chat_template.jinja holds one, "
                                 "or write the examples as prompt/completion")
        if self.markers:
            out = self._apply(messages, tokenize=True, return_dict=True,
                              return_assistant_tokens_mask=True)
            return list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]
        text, spans = self._assistant_spans(messages)
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), _overlapping(enc["offset_mapping"], spans)

    def _assistant_spans(self, messages: list[dict[str, str]]
                         ) -> tuple[str, list[tuple[int, int]]]:
        """The whole conversation's text and each assistant message's character span
        in it, found by rendering it prefix by prefix."""
        text = self._apply(messages, tokenize=False)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != ASSISTANT:
                continue
            before = self._apply(messages[:i], tokenize=False, add_generation_prompt=True)
            through = self._apply(messages[:i + 1], tokenize=False)
            if not (through.startswith(before) and text.startswith(through)):
                raise BadExample(f"the chat template renders message {i + 1} differently "
                                 "once later messages follow, so its tokens cannot be "
                                 "located", "give the template {% generation %} markers "
                                 "around the assistant text, or end the conversation "
                                 "at that message")
            spans.append((len(before), len(through)))
        return text, spans

    def _apply(self, messages: list[dict[str, str]], **kwargs: Any) -> Any:
        try:
            return self.tokenizer.apply_chat_template(messages, **kwargs)
        except Exception as exc:  # the template's own raise_exception, jinja errors
            raise BadExample(f"the chat template refuses it ({exc})", "write the "
                             "conversation as the template expects (e.g. alternating "
                             "user and assistant turns)") from None


def _overlapping(offsets: Sequence[tuple[int, int]], spans: list[tuple[int, int]]
                 ) -> list[bool]:
    """Per token: whether its characters [start, end) overlap any of ``spans``."""
    return [any(start < b and end > a for a, b in spans) for start, end in offsets]


def _text(record: Mapping[str, Any], key: str) -> str:
    if key not in record:
        raise BadExample(f"missing field {key!r}", _SHAPES)
    value = record[key]
    if not isinstance(value, str):
        raise BadExample(f"field {key!r} is a {type(value).__name__}, not a string",
                         "give the text as a JSON string")
    return value


def _messages(value: Any) -> list[dict[str, str]]:
    """The conversation checked: a non-empty list of {role, content} objects with
    known roles, opened by a system or user message, with an assistant message."""
    if not isinstance(value, list) or not value:
        raise BadExample("messages is not a non-empty list",
                         'give "messages": [{"role": "user", "content": ...}, ...]')
    messages = []
    for i, m in enumerate(value, 1):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise BadExample(f"message {i} is not an object with role and content",
                             'give each message as {"role": ..., "content": ...}')
        role, content = m["role"], m["content"]
        if role not in ROLES:
            raise BadExample(f"message {i} has unknown role {role!r}",
                             f"use one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise BadExample(f"message {i}'s content is a {type(content).__name__}, not "
                             "a string", "give the content as a JSON string")
        messages.append({"role": role, "content": content})
    if messages[0]["role"] == ASSISTANT:
        raise BadExample("the conversation opens with an assistant message",
                         "begin with a system or user message")
    if not any(m["role"] == ASSISTANT for m in messages):
        raise BadExample("has no assistant message to train on",
                         "add the assistant's answer")
    return messages
