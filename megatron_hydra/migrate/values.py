"""Values written for Hydra's override grammar and for a shell."""

from __future__ import annotations

import re
import shlex
from typing import Any

SAFE_VALUE = re.compile(r"[A-Za-z0-9_./+\-$~%@:]+")
SAFE_WORD = re.compile(r"[A-Za-z0-9_./+\-=:,@%~\[\]]+")


def hydra_value(value: Any) -> str:
    """``value`` in Hydra's override grammar."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    text = str(value)
    if SAFE_VALUE.fullmatch(text) and not re.fullmatch(r"[-+]?[0-9.]+(e[-+]?[0-9]+)?|true|false|null|nan|inf",
                                                         text, re.I):
        return text
    # Hydra's quoted strings: backslashes are literal except before a quote or the closing quote,
    # and ${ would be an interpolation
    text = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", text.replace("${", "\\${"))
    text = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, text)
    return "'" + text + "'"


def shell_word(word: str) -> str:
    """``word`` for a shell: an unknown ``$NAME`` left for the shell to fill in; a command
    substitution never run."""
    if SAFE_WORD.fullmatch(word):
        return word
    if "$" in word and "$(" not in word and "`" not in word:
        return '"' + re.sub(r'(["\\`])', r"\\\1", word) + '"'
    return shlex.quote(word)
