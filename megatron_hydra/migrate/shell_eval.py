"""What the script reader evaluates itself: bash integer arithmetic and ``[[ ... ]]`` / ``[ ... ]``
tests, over values the script sets literally. Everything else stays unknown (None or ValueError),
never guessed; nothing is executed.
"""

from __future__ import annotations

import ast
import fnmatch
import operator
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

MAX_GLOB = 1_000


def _divide(a: int, b: int) -> int:
    """Bash's ``/``: the quotient truncated toward zero (-7 / 2 is -3), not Python's floor."""
    quotient = abs(a) // abs(b)
    return quotient if (a < 0) == (b < 0) else -quotient


def _remainder(a: int, b: int) -> int:
    """Bash's ``%``: the sign of the dividend (-7 % 2 is -1)."""
    return a - b * _divide(a, b)


_INTEGER_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: _divide,
                ast.Mod: _remainder}


def integer(node, values: Dict[str, int]) -> int:
    """Bash integer arithmetic over known values: + - * / % (truncating, as bash), unary minus,
    parentheses."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.Name):
        return values[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = integer(node.operand, values)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _INTEGER_OPS:
        left, right = integer(node.left, values), integer(node.right, values)
        if abs(left) > 2 ** 62 or abs(right) > 2 ** 62:
            raise ValueError("out of range")
        return _INTEGER_OPS[type(node.op)](left, right)
    raise ValueError("not integer arithmetic")


@dataclass
class Test:
    """``[[ ... ]]`` / ``[ ... ]`` in Kleene logic: -z, -n, =, ==, !=, integer comparisons, !,
    &&/-a, ||/-o and parentheses over known strings. An unknown word, a file test or a regex
    is unknown (None), which ``||`` with a true side or ``&&`` with a false side overrides."""

    words: List[Tuple[str, bool]]  # (text, known)
    i: int = 0

    def evaluate(self) -> Optional[bool]:
        try:
            value = self._or()
        except (IndexError, ValueError):
            return None
        return value if self.i == len(self.words) else None

    def _peek(self) -> Optional[str]:
        return self.words[self.i][0] if self.i < len(self.words) else None

    def _or(self) -> Optional[bool]:
        value = self._and()
        while self._peek() in ("||", "-o"):
            self.i += 1
            other = self._and()
            value = True if True in (value, other) else (None if None in (value, other) else False)
        return value

    def _and(self) -> Optional[bool]:
        value = self._not()
        while self._peek() in ("&&", "-a"):
            self.i += 1
            other = self._not()
            value = False if False in (value, other) else (None if None in (value, other) else True)
        return value

    def _not(self) -> Optional[bool]:
        if self._peek() == "!":
            self.i += 1
            value = self._not()
            return None if value is None else not value
        if self._peek() == "(":
            self.i += 1
            value = self._or()
            if self._peek() != ")":
                raise ValueError("unbalanced parentheses")
            self.i += 1
            return value
        return self._primary()

    def _primary(self) -> Optional[bool]:
        w, i = self.words, self.i
        if w[i][0] in ("-z", "-n") and i + 1 < len(w):
            self.i += 2
            return (w[i + 1][0] == "") == (w[i][0] == "-z") if w[i + 1][1] else None
        if i + 2 < len(w) and w[i + 1][0] in _COMPARE:
            self.i += 3
            if not (w[i][1] and w[i + 2][1]):
                return None
            return _COMPARE[w[i + 1][0]](w[i][0], w[i + 2][0])
        if re.fullmatch(r"-[a-zA-Z]", w[i][0]) and i + 1 < len(w):
            self.i += 2  # a file test: nothing on this machine is looked at
            return None
        self.i += 1
        return (w[i][0] != "") if w[i][1] else None


def _regex(left: str, right: str) -> Optional[bool]:
    return None  # regular expressions are not evaluated


def _glob(word: str, pattern: str) -> bool:
    """Bash's ``==`` in a test: ``pattern`` is a glob. Long sides are not matched (a crafted
    pattern against a long word costs their product)."""
    if len(word) > MAX_GLOB or len(pattern) > MAX_GLOB:
        raise ValueError("too long to match")
    return fnmatch.fnmatchcase(word, pattern)


_COMPARE = {
    "=": _glob, "==": _glob, "!=": lambda a, b: not _glob(a, b), "=~": _regex,
    "-eq": lambda a, b: int(a) == int(b), "-ne": lambda a, b: int(a) != int(b), "-lt": lambda a, b: int(a) < int(b),
    "-le": lambda a, b: int(a) <= int(b), "-gt": lambda a, b: int(a) > int(b), "-ge": lambda a, b: int(a) >= int(b),
}
