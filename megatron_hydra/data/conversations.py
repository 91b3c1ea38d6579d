"""Chat-shaped jsonl files, read for fine-tuning: their lines, their messages, their token ids.

``data=sft`` (conversations, ``sft_dataset``) and ``data=preference`` (preference pairs,
``preference_dataset``) read the same kind of file, so they refuse the same mistakes, in one line
naming ``file:line`` and the fix: a missing file, bytes that are not UTF-8, a line that is not JSON
(or is nested past ``untrusted.parse_json``'s bound), a message that is not ``{"role":
system|user|assistant, "content": a string}``, and text holding a lone surrogate escape, which no
tokenizer can encode. Blank lines are skipped.
"""

from __future__ import annotations

import os
from typing import Any, Iterator, List, Tuple

import numpy as np

from megatron_hydra.data.chat_template import ROLES, Message
from megatron_hydra.data.tokenizers import Tokenizer
from megatron_hydra.errors import DataError
from megatron_hydra.untrusted import parse_json, surrogate

MESSAGE_FORM = f"{{\"role\": {'|'.join(ROLES)}, \"content\": a string}}"


def jsonl_rows(path: str, holds: str) -> Iterator[Tuple[str, Any]]:
    """``(file:line, parsed value)`` of every non-blank line of ``path``; ``holds`` names what the
    file should hold, for the error of a missing one."""
    path = os.path.expanduser(path)
    if not os.path.isfile(path):
        raise DataError(f"data.path={path}: no such file; point it at a jsonl file of {holds}")
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            where = f"{path}:{number}"
            try:
                line = raw.decode("utf-8").strip()
            except UnicodeDecodeError as e:
                raise DataError(f"{where}: not UTF-8 ({e.reason} at byte {e.start})") from None
            if line:
                yield where, parse_json(line, where, DataError)


def checked_messages(messages: List[Any], where: str, field: str = "") -> List[Message]:
    """Copies of ``messages`` (their role and content only), each checked; ``field`` names the
    list within its line in errors (e.g. ``'chosen'``)."""
    label = f"{field} message" if field else "message"
    out = []
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise DataError(f"{where}: {label} {j} is not {MESSAGE_FORM}")
        why = surrogate(m["content"])
        if why:
            raise DataError(f"{where}: {label} {j}: {why}; fix or remove the line")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def tokens_of(template, messages: List[Message], where: str) -> Tuple[np.ndarray, np.ndarray]:
    """``template.tokens(messages)``; a conversation the template refuses is a one-line DataError
    naming ``where``."""
    try:
        return template.tokens(messages)
    except ValueError as e:
        raise DataError(f"{where}: {e}") from None


def check_token_ids(ids: np.ndarray, path: str, tokenizer: Tokenizer, template, vocab_size: int) -> None:
    """Every id of ``ids`` (the file's, tokenized) indexes the model's embedding table."""
    top, bottom = int(ids.max()), int(ids.min())
    if bottom < 0:
        raise DataError(f"{path}: the tokenizer (template {template.name}) produced the negative token id {bottom}; "
                        "check data.tokenizer")
    if top >= vocab_size:
        raise DataError(f"{path}: token id {top} (tokenizer of {tokenizer.vocab_size} ids, template "
                        f"{template.name}) >= the model's vocabulary size {vocab_size}; raise model.vocab_size")
