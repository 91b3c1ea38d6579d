"""Words and operators of a shell script, read without running anything (``shell`` interprets them).

A word keeps its parts apart (literal text, ``$NAME``, ``${...}``, ``$(...)``, ``$((...))``) with
whether each stood inside quotes, because that decides what the interpreter may expand and where
it splits fields, as bash would. ``NAME=( ... )`` is one ``Array`` token, since its elements are
words of their own. Here-document bodies are skipped: they are data, not commands.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Iterator, List, Optional, Tuple, Union

from megatron_hydra.errors import ConfigError

# (kind, text, quoted); kind: lit | var | param | cmd | arith
Part = Tuple[str, str, bool]

NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
ASSIGNMENT = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(\+?)=")
OPERATORS = ("&&", "||", ";;", ";", "&", "|", "(", ")")
SPECIAL_PARAMETERS = "@*#?$!-0123456789"
_BREAK = " \t\n;&|()<>"


@dataclass
class Word:
    parts: List[Part]
    line: int

    def literal(self) -> Optional[str]:
        """The word's text when it is plain literal text (keywords, option names), else None."""
        if all(kind == "lit" for kind, _, _ in self.parts):
            return "".join(text for _, text, _ in self.parts)
        return None

    def assignment(self) -> Optional[Tuple[str, bool, "Word"]]:
        """(name, append, value) of ``NAME=value`` or ``NAME+=value``, else None."""
        if not self.parts or self.parts[0][0] != "lit" or self.parts[0][2]:
            return None
        m = ASSIGNMENT.match(self.parts[0][1])
        if not m:
            return None
        rest = self.parts[0][1][m.end():]
        value = ([("lit", rest, False)] if rest else []) + self.parts[1:]
        return m.group(1), bool(m.group(2)), Word(value, self.line)


@dataclass
class Array:
    """``NAME=( words )`` or ``NAME+=( words )``."""

    name: str
    append: bool
    words: List[Word]
    line: int


@dataclass
class Op:
    text: str
    line: int


Token = Union[Word, Array, Op]


@dataclass
class Lexer:
    text: str
    i: int = 0
    line: int = 1
    in_test: bool = False  # inside [[ ... ]]: && || ( ) < > are part of the test
    heredocs: List[Tuple[str, bool]] = field(default_factory=list)

    def tokens(self) -> Iterator[Token]:
        while True:
            self._blanks()
            if self.i >= len(self.text):
                return
            c = self.text[self.i]
            if c == "#":
                while self.i < len(self.text) and self.text[self.i] != "\n":
                    self.i += 1
            elif c == "\n":
                yield Op("\n", self.line)
                self.i += 1
                self.line += 1
                self._heredoc_bodies()
            elif not self.in_test and (c in "<>" or self.text.startswith("&>", self.i)):
                self._redirection()
            elif not self.in_test and self.text.startswith(OPERATORS, self.i):
                op = next(o for o in OPERATORS if self.text.startswith(o, self.i))
                self.i += len(op)
                yield Op(op, self.line)
            else:
                token = self._word_or_array()
                if isinstance(token, Word) and (token.literal() or "").isdigit() and \
                        self.text[self.i:self.i + 1] in ("<", ">"):
                    self._redirection()  # 2>&1: the descriptor belongs to the redirection
                    continue
                yield token

    def whole_word(self, quoted: bool) -> List[Part]:
        """The parts of ``text`` read as one word (a ``${NAME:-default}``'s default)."""
        parts: List[Part] = []
        while self.i < len(self.text):
            if quoted:
                parts.extend(self._double_quoted_body(end=None))
            else:
                self._one_part(parts, breaks="")
        return _merged(parts)

    # -- pieces ----------------------------------------------------------------------------------
    def _blanks(self) -> None:
        while self.i < len(self.text):
            if self.text[self.i] in " \t\r":
                self.i += 1
            elif self.text.startswith("\\\n", self.i):
                self.i += 2
                self.line += 1
            else:
                return

    def _redirection(self) -> None:
        """``> file``, ``2>&1``, ``<<EOF``: dropped with their target (a here-document's body is
        skipped at the end of its line)."""
        if self.text.startswith("<<", self.i):
            self.i += 2
            strip = self.text.startswith("-", self.i)
            self.i += strip
            self._blanks()
            word = self._word(_BREAK)
            self.heredocs.append(("".join(text for _, text, _ in word.parts), strip))
            return
        while self.i < len(self.text) and self.text[self.i] in "<>&|":
            self.i += 1
        self._blanks()
        if self.i < len(self.text) and self.text[self.i] not in "\n;&|()":
            self._word(_BREAK)

    def _heredoc_bodies(self) -> None:
        while self.heredocs:
            end, strip = self.heredocs.pop(0)
            while self.i < len(self.text):
                stop = self.text.find("\n", self.i)
                stop = len(self.text) if stop < 0 else stop
                line = self.text[self.i:stop]
                self.i, self.line = stop + 1, self.line + 1
                if (line.lstrip("\t") if strip else line) == end:
                    break

    def _word_or_array(self) -> Token:
        word = self._word(" \t\n;" if self.in_test else _BREAK)
        text = word.literal()
        if text == "[[":
            self.in_test = True
        elif text == "]]":
            self.in_test = False
        target = word.assignment()
        if target and not target[2].parts and self.text.startswith("(", self.i):
            return self._array(target[0], target[1], word.line)
        return word

    def _array(self, name: str, append: bool, line: int) -> Array:
        self.i += 1
        words = []
        while True:
            self._blanks()
            if self.i >= len(self.text):
                raise ConfigError(f"line {line}: {name}=( is never closed with ')': fix the script")
            c = self.text[self.i]
            if c == ")":
                self.i += 1
                return Array(name, append, words, line)
            if c == "\n":
                self.i += 1
                self.line += 1
            elif c == "#":
                while self.i < len(self.text) and self.text[self.i] != "\n":
                    self.i += 1
            else:
                words.append(self._word(" \t\n()"))

    def _word(self, breaks: str) -> Word:
        line, parts = self.line, []
        start = self.i
        while self.i < len(self.text) and self.text[self.i] not in breaks:
            self._one_part(parts, breaks)
        if self.i == start:  # a lone operator character where a word was expected
            parts.append(("lit", self.text[self.i], False))
            self.i += 1
        return Word(_merged(parts), line)

    def _one_part(self, parts: List[Part], breaks: str) -> None:
        c = self.text[self.i]
        if c == "\\":
            if self.text.startswith("\\\n", self.i):
                self.line += 1
            else:
                parts.append(("lit", self.text[self.i + 1:self.i + 2], True))
            self.i += 2
        elif c == "'":
            end = self._find("'", self.i + 1)
            parts.append(("lit", self.text[self.i + 1:end], True))
            self._advance(end + 1)
        elif c == '"':
            self.i += 1
            parts.extend(self._double_quoted_body(end='"'))
        elif c == "$":
            parts.append(self._dollar(quoted=False))
        elif c == "`":
            end = self._find("`", self.i + 1)
            parts.append(("cmd", self.text[self.i + 1:end], False))
            self._advance(end + 1)
        else:  # a run of plain characters at once
            end = _plain(breaks).match(self.text, self.i).end()
            parts.append(("lit", self.text[self.i:end], False))
            self.i = end

    def _double_quoted_body(self, end: Optional[str]) -> List[Part]:
        parts: List[Part] = []
        while self.i < len(self.text):
            c = self.text[self.i]
            if end is not None and c == end:
                self.i += 1
                return parts
            if c == "\\" and self.text[self.i + 1:self.i + 2] in ('$', '`', '"', "\\", "\n"):
                if self.text[self.i + 1] != "\n":
                    parts.append(("lit", self.text[self.i + 1], True))
                self._advance(self.i + 2)
            elif c == "$":
                parts.append(self._dollar(quoted=True))
            elif c == "`":
                close = self._find("`", self.i + 1)
                parts.append(("cmd", self.text[self.i + 1:close], True))
                self._advance(close + 1)
            else:
                parts.append(("lit", c, True))
                self._advance(self.i + 1)
        if end is not None:
            raise ConfigError(f"line {self.line}: a double-quoted string is never closed: fix the script")
        return parts

    def _dollar(self, quoted: bool) -> Part:
        s, i = self.text, self.i
        if s.startswith("$((", i):
            close = self._matching(i + 1, "(", ")")
            kind, inner, end = "arith", s[i + 3:close - 1], close + 1
        elif s.startswith("$(", i):
            close = self._matching(i + 1, "(", ")")
            kind, inner, end = "cmd", s[i + 2:close], close + 1
        elif s.startswith("${", i):
            close = self._matching(i + 1, "{", "}")
            kind, inner, end = "param", s[i + 2:close], close + 1
        elif NAME.match(s, i + 1):
            m = NAME.match(s, i + 1)
            kind, inner, end = "var", m.group(), m.end()
        elif i + 1 < len(s) and s[i + 1] in SPECIAL_PARAMETERS:
            kind, inner, end = "var", s[i + 1], i + 2
        else:
            kind, inner, end = "lit", "$", i + 1
        self._advance(end)
        return kind, inner, quoted

    def _matching(self, start: int, opener: str, closer: str) -> int:
        """Index of the ``closer`` that matches the ``opener`` at ``start``, skipping quotes."""
        depth, i, s = 0, start, self.text
        while i < len(s):
            c = s[i]
            if c == "\\":
                i += 2
                continue
            if c in "'\"":
                i = self._find(c, i + 1) + 1
                continue
            if c == opener:
                depth += 1
            elif c == closer:
                depth -= 1
                if depth == 0:
                    return i
            i += 1
        raise ConfigError(f"line {self.line}: '{opener}' after '$' is never closed with '{closer}': fix the script")

    def _find(self, quote: str, start: int) -> int:
        i = start
        while i < len(self.text):
            if self.text[i] == "\\" and quote != "'":
                i += 2
                continue
            if self.text[i] == quote:
                return i
            i += 1
        raise ConfigError(f"line {self.line}: a {quote} quote is never closed: fix the script")

    def _advance(self, end: int) -> None:
        self.line += self.text.count("\n", self.i, end)
        self.i = end


@lru_cache(maxsize=None)
def _plain(breaks: str) -> "re.Pattern[str]":
    """One or more characters that are neither quoting, expansion nor in ``breaks``."""
    return re.compile("[^" + re.escape(breaks + "\\'\"$`") + "]+|.", re.S)


def _merged(parts: List[Part]) -> List[Part]:
    """Adjacent literal parts of the same quoting as one part (joined once: a long word costs its
    length, not its length squared)."""
    out: List[Part] = []
    run: List[str] = []
    quoted_run = False
    for part in parts:
        if part[0] == "lit" and run and part[2] == quoted_run:
            run.append(part[1])
            continue
        if run:
            out.append(("lit", "".join(run), quoted_run))
            run = []
        if part[0] == "lit":
            run, quoted_run = [part[1]], part[2]
        else:
            out.append(part)
    if run:
        out.append(("lit", "".join(run), quoted_run))
    return out
