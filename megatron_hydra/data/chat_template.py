"""Conversations to token ids, with a flag per token saying whether the model learns to say it.

Supervised fine-tuning trains on the assistant's turns only: the loss covers every token of an
assistant message's content and the end-of-turn token(s) that close it, so that the model learns
to stop; system and user turns, and the header that announces each turn, carry no loss.

Two templates:

- the tokenizer's own: a ``chat_template`` (Jinja) in the ``tokenizer_config.json`` beside its
  ``tokenizer.json``, as Hugging Face ships it (an import by ``megatron_hydra.convert`` copies it).
  It is rendered with the variables Hugging Face passes (``messages``, ``add_generation_prompt``,
  ``bos_token``, ``eos_token``, ``raise_exception``; ``{% generation %}`` tags render their body).
  Which text is the assistant's follows from rendering prefixes of the conversation: the
  assistant turn ``i`` is what ``messages[:i+1]`` adds to ``messages[:i]`` rendered with the
  generation prompt. Each piece is tokenized on its own, so a token never straddles a turn
  boundary. A template whose renders are not prefixes of each other is refused (its turns cannot
  be told apart).

  The file may come from anyone, and a Jinja template is a program: it can loop for hours or ask
  for gigabytes (``'x' * 4000000000``). So it is compiled and rendered in Jinja's sandbox in a
  process of its own (``chat_render``), with an address-space limit, a bound on the characters
  one render writes, and a deadline per conversation after which the process is killed. Breaking
  a bound is a one-line ``DataError`` naming the template's file.
- ours (``DefaultTemplate``), when the tokenizer has none (the byte and BPE tokenizers, GPT-2): every
  message is ``<|role|>\\n`` + content + the end-of-document token, e.g.
  ``<|user|>\\nHi<eod><|assistant|>\\nHello<eod>``; loss on ``Hello<eod>``.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import weakref
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from megatron_hydra import untrusted
from megatron_hydra.data.tokenizers import Tokenizer
from megatron_hydra.errors import DataError

ROLES = ("system", "user", "assistant")
Message = Dict[str, str]
# (text, learned): a rendered conversation as consecutive pieces of text.
Pieces = List[Tuple[str, bool]]

# The bounds a template renders under. A real template renders a conversation at once, into about
# as many characters as the conversation has; these leave room for conversations far beyond any
# model's context.
RENDER_SECONDS = 10.0  # all the renders of one conversation
STARTUP_SECONDS = 60.0  # the renderer's process starting (the interpreter and Jinja only)
MAX_CHARS = 8_000_000  # one render
MEMORY_BYTES = 1024 * untrusted.MiB  # the renderer's address space
CONFIG_BYTES = 16 * untrusted.MiB  # tokenizer_config.json
# The renderer runs chat_render from this package, never from the working directory.
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_START = ("import sys, runpy; sys.path[:] = [sys.argv[1]] + [p for p in sys.path if p not in ('', '.')]; "
          "runpy.run_module('megatron_hydra.data.chat_render', run_name='__main__')")


def _bound(kind: str) -> Optional[str]:
    """What a template did wrong, for the reply kinds that are a bound it broke."""
    return {"too_long": f"wrote more than {MAX_CHARS:,} characters",
            "memory": f"needed more than {MEMORY_BYTES / 2**30:g} GiB of memory",
            "recursion": "recursed deeper than Python allows"}.get(kind)


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


class _Renderer:
    """The process that compiles and renders one template (``chat_render``), and the bounds it
    runs under: a reply later than ``RENDER_SECONDS`` kills it."""

    def __init__(self, where: str):
        self.where = where
        self.proc = subprocess.Popen([sys.executable, "-c", _START, _PACKAGE_ROOT], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True)
        self._finalizer = weakref.finalize(self, _stop, self.proc)
        self._reply(STARTUP_SECONDS, "starting")

    def ask(self, request: dict, doing: str = "rendering one conversation") -> dict:
        try:
            self.proc.stdin.write(json.dumps(request).encode("ascii") + b"\n")
            self.proc.stdin.flush()
        except OSError:  # BrokenPipeError: it has stopped
            pass
        return self._reply(RENDER_SECONDS, doing)

    def _reply(self, seconds: float, doing: str = "rendering one conversation") -> dict:
        ready, _, _ = select.select([self.proc.stdout], [], [], seconds)
        line = self.proc.stdout.readline() if ready else None
        if line is None and doing == "starting":
            _stop(self.proc)
            raise DataError(f"{self.where}: the process that renders its chat_template did not start within "
                            f"{seconds:g} s; check that jinja2 is installed, or retry on a less busy machine")
        if line is None:
            _stop(self.proc)
            raise DataError(f"{self.where}: its chat_template still ran after {seconds:g} s {doing}: refused (a "
                            "template that loops without end?); fix or remove the chat_template")
        reply = _reply_of(line)
        if reply is None:  # it stopped, or wrote something that is not a reply
            _stop(self.proc)
            raise DataError(f"{self.where}: the process rendering its chat_template stopped (exit status "
                            f"{self.proc.returncode}): refused; fix or remove the chat_template")
        return reply


def _reply_of(line: bytes) -> Optional[dict]:
    try:
        reply = json.loads(line) if line else None
    except ValueError:
        return None
    return reply if isinstance(reply, dict) else None


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for stream in (proc.stdin, proc.stdout):
        try:
            stream.close()
        except OSError:
            pass


class JinjaTemplate:
    """A Hugging Face ``chat_template`` (see the module docstring), rendered by ``chat_render`` in
    a process of its own."""

    def __init__(self, tokenizer: Tokenizer, source: str, specials: Dict[str, str], where: str):
        self.tokenizer, self.where, self.name = tokenizer, where, f"the chat_template of {where}"
        self._renderer = _Renderer(where)
        setup = {"template": source, "specials": specials, "max_chars": MAX_CHARS, "memory_bytes": MEMORY_BYTES}
        self._answer(self._renderer.ask(setup, "compiling"), "compiling")

    def _answer(self, reply: dict, doing: str = "rendering one conversation") -> dict:
        """``reply`` when it is not an error; a bound the template broke is a ``DataError`` naming its
        file, a conversation it refused or failed on a ``ValueError`` (the caller names the
        conversation)."""
        kind, message = reply.get("error"), reply.get("message", "")
        if kind is None:
            return reply
        if kind == "syntax":
            raise DataError(f"{self.where}: its chat_template is not a valid Jinja template ({message})")
        if _bound(kind):
            detail = f" ({message})" if message else ""
            raise DataError(f"{self.where}: its chat_template {_bound(kind)} {doing}: refused{detail}; "
                            "fix or remove the chat_template")
        if kind == "refused":
            raise ValueError(f"{self.name} refused the conversation ({message})")
        raise ValueError(f"{self.name} failed on the conversation ({message})")

    def renders(self, messages: Sequence[Message], prefixes: Sequence[Tuple[int, bool]]) -> List[str]:
        """``messages[:k]`` rendered, with the generation prompt when asked, for each ``(k, prompt)``
        of ``prefixes``: one exchange with the renderer per conversation."""
        request = {"messages": list(messages), "renders": [[k, bool(p)] for k, p in prefixes]}
        return self._answer(self._renderer.ask(request))["texts"]

    def render(self, messages: Sequence[Message], add_generation_prompt: bool) -> str:
        return self.renders(messages, [(len(messages), add_generation_prompt)])[0]

    def pieces(self, messages: Sequence[Message]) -> Pieces:
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        texts = self.renders(messages, [(k, prompt) for i in turns for k, prompt in ((i, True), (i + 1, False))]
                             + [(len(messages), False)])
        out: Pieces = []
        done = ""  # the text already split into pieces
        for j in range(len(turns)):
            prompt, answered = texts[2 * j], texts[2 * j + 1]
            if not prompt.startswith(done) or not answered.startswith(prompt):
                raise ValueError(f"{self.name} does not render a conversation's turns as prefixes of each "
                                 "other, so the assistant's tokens cannot be found; use a tokenizer without it "
                                 "(the default template)")
            out += [(prompt[len(done):], False), (answered[len(prompt):], True)]
            done = answered
        full = texts[-1]
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
    if not config or not os.path.lexists(config):
        return DefaultTemplate(tokenizer)
    values = untrusted.load_json(config, CONFIG_BYTES, "tokenizer_config.json", DataError)
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
