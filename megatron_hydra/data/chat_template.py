"""Conversations to token ids, with a flag per token saying whether the model learns to say it.

Supervised fine-tuning trains on the assistant's turns only: the loss covers every token of an
assistant message's content and the end-of-turn token(s) that close it, so that the model learns
to stop; system and user turns, and the header that announces each turn, carry no loss.

Two templates:

- the tokenizer's own: a ``chat_template`` (Jinja) in the ``tokenizer_config.json`` beside its
  ``tokenizer.json``, as Hugging Face ships it (an import by ``megatron_hydra.convert`` copies it).
  It is rendered in a sandboxed Jinja environment (the file may come from anyone) with the
  variables Hugging Face passes (``messages``, ``add_generation_prompt``, ``bos_token``,
  ``eos_token``, ``raise_exception``; ``{% generation %}`` tags render their body). Which text is
  the assistant's follows from rendering prefixes of the conversation: the assistant turn ``i`` is
  what ``messages[:i+1]`` adds to ``messages[:i]`` rendered with the generation prompt. Each piece is tokenized on its own, so a
  token never straddles a turn boundary. A template whose renders are not prefixes of each other
  is refused (its turns cannot be told apart).
- ours (``DefaultTemplate``), when the tokenizer has none (the byte and BPE tokenizers, GPT-2): every
  message is ``<|role|>\\n`` + content + the end-of-document token, e.g.
  ``<|user|>\\nHi<eod><|assistant|>\\nHello<eod>``; loss on ``Hello<eod>``.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from megatron_hydra.data.tokenizers import Tokenizer
from megatron_hydra.errors import DataError

ROLES = ("system", "user", "assistant")
Message = Dict[str, str]
# (text, learned): a rendered conversation as consecutive pieces of text.
Pieces = List[Tuple[str, bool]]


class DefaultTemplate:
    """``<|role|>\\n`` + content + end-of-document, per message (see the module docstring)."""

    name = "default"

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    def tokens(self, messages: Sequence[Message]) -> Tuple[np.ndarray, np.ndarray]:
        ids: List[int] = []
        learned: List[bool] = []
        heads = self.tokenizer.encode_batch([f"<|{m['role']}|>\n" for m in messages])
        bodies = self.tokenizer.encode_batch([m["content"] for m in messages])
        for m, head, body in zip(messages, heads, bodies):
            turn = body + [self.tokenizer.eod]
            ids += head + turn
            learned += [False] * len(head) + [m["role"] == "assistant"] * len(turn)
        return np.asarray(ids, np.int64), np.asarray(learned, bool)


class JinjaTemplate:
    """A Hugging Face ``chat_template`` (see the module docstring)."""

    def __init__(self, tokenizer: Tokenizer, source: str, specials: Dict[str, str], where: str):
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self.tokenizer, self.where, self.name = tokenizer, where, f"the chat_template of {where}"
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols", _generation_tag()])
        try:
            self._template = env.from_string(source)
        except TemplateError as e:
            raise DataError(f"{where}: its chat_template is not a valid Jinja template ({e})") from None
        self._specials = specials

    def render(self, messages: Sequence[Message], add_generation_prompt: bool) -> str:
        from jinja2 import TemplateError

        def raise_exception(message):
            raise TemplateError(message)

        try:
            return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                         raise_exception=raise_exception, **self._specials)
        except TemplateError as e:
            raise ValueError(f"{self.name} refused the conversation ({e})") from None

    def pieces(self, messages: Sequence[Message]) -> Pieces:
        out: Pieces = []
        done = ""  # the text already split into pieces
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            prompt = self.render(messages[:i], add_generation_prompt=True)
            answered = self.render(messages[: i + 1], add_generation_prompt=False)
            if not prompt.startswith(done) or not answered.startswith(prompt):
                raise ValueError(f"{self.name} does not render a conversation's turns as prefixes of each "
                                 "other, so the assistant's tokens cannot be found; use a tokenizer without it "
                                 "(the default template)")
            out += [(prompt[len(done):], False), (answered[len(prompt):], True)]
            done = answered
        full = self.render(messages, add_generation_prompt=False)
        if not full.startswith(done):
            raise ValueError(f"{self.name} renders the whole conversation differently from its turns")
        out.append((full[len(done):], False))
        return [(text, learned) for text, learned in out if text]

    def tokens(self, messages: Sequence[Message]) -> Tuple[np.ndarray, np.ndarray]:
        pieces = self.pieces(messages)
        encoded = self.tokenizer.encode_batch([text for text, _ in pieces])
        ids = [i for part in encoded for i in part]
        learned = [flag for part, (_, flag) in zip(encoded, pieces) for _ in part]
        return np.asarray(ids, np.int64), np.asarray(learned, bool)


def _generation_tag():
    """Hugging Face's ``{% generation %}...{% endgeneration %}`` marks assistant text in some
    templates; the spans here come from prefix renders, so the tag just renders its body."""
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    return Generation


def _special(value: Any) -> str:
    """A special token as tokenizer_config.json spells it: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def load_template(tokenizer: Tokenizer):
    """The tokenizer's own chat template when a ``tokenizer_config.json`` beside its file has one,
    else ``DefaultTemplate``."""
    path = getattr(tokenizer, "path", None)
    config = os.path.join(os.path.dirname(path), "tokenizer_config.json") if path else None
    if not config or not os.path.isfile(config):
        return DefaultTemplate(tokenizer)
    try:
        with open(config, encoding="utf-8") as f:
            values = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{config}: not readable JSON ({e}); fix or remove it") from None
    if not isinstance(values, dict):
        raise DataError(f"{config}: holds a JSON {type(values).__name__}, not an object; fix or remove it")
    source = _chat_template_source(values.get("chat_template"), config)
    if source is None:
        return DefaultTemplate(tokenizer)
    specials = {key: _special(values.get(key)) for key in ("bos_token", "eos_token", "pad_token", "unk_token")}
    return JinjaTemplate(tokenizer, source, specials, config)


def _chat_template_source(value: Any, where: str) -> Optional[str]:
    """The template text: a string, or the ``default`` of a list of named templates."""
    if value is None:
        return None
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    if not isinstance(value, str):
        raise DataError(f"{where}: chat_template is neither a string nor a list with a 'default' template")
    return value
