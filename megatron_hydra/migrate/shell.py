"""The training command of a shell script (Megatron-LM's ``examples/*/train_*.sh``), read without
running anything.

Megatron-LM users keep their flags in bash scripts: variables, arrays expanded with
``${ARGS[@]}``, defaults such as ``${1:-"checkpoints/x"}``, and ``if`` blocks that add flags for
a data type. This module follows what such a script would do with the values written in it:
variables assigned literally, arrays, ``${NAME:-default}``, integer ``$((...))``, and ``if``
conditions that compare known strings. Nothing else is evaluated: a command substitution, a
variable the file never sets, the script's own arguments, a file test or a loop stays unknown,
and each is reported (``Script.unresolved``) instead of guessed. An unknown value keeps its
name in the flags (``$CHECKPOINT_PATH``), so the translated command still reads sensibly.
"""

from __future__ import annotations

import ast
import fnmatch
import operator
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

from megatron_hydra.errors import ConfigError
from megatron_hydra.migrate.shell_lexer import ASSIGNMENT, Array, Lexer, Op, Word

KEYWORD_STARTS = ("then", "else", "do", "{")
DECLARATIONS = ("export", "declare", "typeset", "local", "readonly")
PYTHON = re.compile(r"(^|/)python[0-9.]*$")
LAUNCHERS = ("torchrun", "srun", "mpirun", "deepspeed", "accelerate")
WRAPPERS = ("nohup", "exec", "time", "env")


@dataclass
class Command:
    words: List[Union[Word, Array]]
    line: int
    sep: str  # how it joins the command before it: ";", "&&", "||" or "|"


@dataclass
class Script:
    argv: List[str]  # the training command, expanded
    unresolved: List[str]  # what could not be read, one line each
    line: int  # where the command starts (0: the file is a list of flags)


@dataclass
class _Var:
    value: Union[str, List[str]]  # unknown parts stand in it by their own text ($1, $PWD)
    reasons: Tuple[str, ...] = ()
    unknown: bool = False  # the whole value is one unknown expansion: it then stands as $NAME


@dataclass
class _Run:
    argv: List[str]
    reasons: List[str]
    line: int


def read_script(text: str, source: str) -> Script:
    """The training command of ``text``: the last command that runs a Python script (a
    ``*train*.py`` one first), or, for a file of bare flags, every ``--flag`` line together."""
    shell = _Shell(_commands(text), text.splitlines())
    shell.block(0, ())
    for run in shell.runs:
        run.argv = _unwrapped(run.argv)
    runs = [r for r in shell.runs if _is_python_run(r.argv)]
    trainers = [r for r in runs if "train" in _script_name(r.argv)]
    chosen = (trainers or runs or [None])[-1]
    if chosen is None:
        flags = [r for r in shell.runs if r.argv and r.argv[0].startswith("--")]
        if not flags:
            raise ConfigError(f"{source}: no training command found: expected a line that runs pretrain_gpt.py "
                              "(torchrun/python ...) or lines of --flags")
        chosen = _Run([w for r in flags for w in r.argv], [x for r in flags for x in r.reasons], 0)
    argv = [w for w in chosen.argv if w not in ("$@", "$*")]
    reasons = list(dict.fromkeys(shell.unresolved + chosen.reasons))
    if len(argv) < len(chosen.argv):
        reasons.append("$@: the script's own arguments are not known: give them after --")
    return Script(argv, reasons, chosen.line)


def _unwrapped(argv: List[str]) -> List[str]:
    """``argv`` without the commands that only wrap it (``nohup``, ``exec``, ``time``, ``env A=b``)."""
    i = 0
    while i < len(argv) and argv[i] in WRAPPERS:
        i += 1
        while i < len(argv) and ASSIGNMENT.match(argv[i]):
            i += 1
    return argv[i:]


def _is_python_run(argv: Sequence[str]) -> bool:
    """A command that runs a Python script: python, a launcher, or the script itself."""
    if not argv:
        return False
    head = argv[0].rsplit("/", 1)[-1]
    return bool(PYTHON.search(head)) or head in LAUNCHERS or head.endswith(".py")


def _script_name(argv: Sequence[str]) -> str:
    return next((w.rsplit("/", 1)[-1] for w in argv if w.endswith(".py")), "")


def _commands(text: str) -> List[Command]:
    """The simple commands in order; a keyword that shares its line with a command (``then
    echo``) becomes a command of its own; ``name() {`` becomes ``function name``."""
    out: List[Command] = []
    words: List[Union[Word, Array]] = []
    sep, line = ";", 1
    tokens = list(Lexer(text).tokens())
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if isinstance(tok, Op):
            if tok.text == "(" and len(words) == 1 and i + 1 < len(tokens) and \
                    isinstance(tokens[i + 1], Op) and tokens[i + 1].text == ")":
                words = [Word([("lit", "function", False)], tok.line), words[0]]
                i += 2
                continue
            if words:
                out.extend(_split_keyword(Command(words, line, sep)))
            words, sep = [], {"\n": ";", ";;": ";", "&": ";", "(": ";", ")": ";"}.get(tok.text, tok.text)
        else:
            if not words:
                line = tok.line
            words.append(tok)
        i += 1
    if words:
        out.extend(_split_keyword(Command(words, line, sep)))
    return out


def _split_keyword(cmd: Command) -> List[Command]:
    head = _literal(cmd.words[0])
    if head in KEYWORD_STARTS and len(cmd.words) > 1:
        return [Command(cmd.words[:1], cmd.line, cmd.sep), Command(cmd.words[1:], cmd.line, ";")]
    return [cmd]


def _literal(word: Union[Word, Array]) -> Optional[str]:
    return word.literal() if isinstance(word, Word) else None


class _Shell:
    """Runs the assignments and control flow of the commands; records every other command."""

    def __init__(self, commands: List[Command], lines: List[str]):
        self.commands, self.lines = commands, lines
        self.vars: Dict[str, _Var] = {}
        self.functions: Dict[str, int] = {}
        self.runs: List[_Run] = []
        self.unresolved: List[str] = []
        self.stopped = False

    def block(self, i: int, stops: Tuple[str, ...]) -> int:
        """Run commands from ``i`` up to one whose keyword is in ``stops``; its index."""
        while i < len(self.commands) and not self.stopped:
            head = _literal(self.commands[i].words[0])
            if head in stops:
                return i
            if head == "if":
                i = self._if(i)
            elif head in ("for", "while", "until", "select", "case"):
                end = self._skip(i)
                self._unknown(i, f"a {head} {'block' if head == 'case' else 'loop'} is not run: "
                                 "flags it sets were not read")
                i = end + 1
            elif head == "function":
                name = _literal(self.commands[i].words[1]) if len(self.commands[i].words) > 1 else ""
                self.functions[(name or "").rstrip("()")] = self.commands[i].line
                i = self._skip(i) + 1
            else:
                self._simple(self.commands[i])
                i += 1
        return i

    # -- control flow ---------------------------------------------------------------------------
    def _if(self, i: int) -> int:
        """Run the branch whose condition holds; an unknown condition skips them all."""
        start, taken = i, False
        while True:
            then = self._find_then(i)
            value = None if taken else self._condition(i, then)
            if value is None and not taken:
                self._unknown(start, "the condition of this if is not known without running the script: none "
                                     "of its branches was read")
                return self._skip_to(start + 1, ("fi",)) + 1
            if value:
                taken = True
                i = self.block(then + 1, ("elif", "else", "fi"))
            else:
                i = self._skip_to(then + 1, ("elif", "else", "fi"))
            if self.stopped:
                return len(self.commands)
            head = _literal(self.commands[i].words[0])
            if head == "elif":
                continue
            if head == "else":
                i = self._skip_to(i + 1, ("fi",)) if taken else self.block(i + 1, ("fi",))
            return len(self.commands) if self.stopped else self._skip_to(i, ("fi",)) + 1

    def _find_then(self, i: int) -> int:
        j = i + 1
        while j < len(self.commands) and _literal(self.commands[j].words[0]) != "then":
            j += 1
        if j >= len(self.commands):
            raise ConfigError(f"line {self.commands[i].line}: an if has no 'then': fix the script")
        return j

    def _condition(self, start: int, then: int) -> Optional[bool]:
        """Kleene logic over the ``&&``/``||`` chain of tests between ``if`` and ``then``."""
        result: Optional[bool] = None
        for k in range(start, then):
            cmd = self.commands[k]
            words = cmd.words[1:] if k == start else cmd.words
            value = self._test(words)
            if k == start:
                result = value
            elif cmd.sep == "&&":
                result = False if False in (result, value) else (None if None in (result, value) else True)
            elif cmd.sep == "||":
                result = True if True in (result, value) else (None if None in (result, value) else False)
            else:
                result = value
        return result

    def _test(self, words) -> Optional[bool]:
        if not words or not isinstance(words[0], Word):
            return None
        head = words[0].literal()
        if head not in ("[[", "[", "test"):
            return None
        fields: List[Tuple[str, bool]] = []
        for w in words[1:]:
            if not isinstance(w, Word):
                return None
            got, why = self.expand(w, split=head != "[[")
            fields.extend((text, not why) for text in got)
        if head != "test":
            if not fields or fields[-1][0] != ("]]" if head == "[[" else "]"):
                return None
            fields = fields[:-1]
        return _Test(fields).evaluate()

    def _skip(self, i: int) -> int:
        """Index of the command that closes the block opened at ``i``."""
        cmd = self.commands[i]
        head = _literal(cmd.words[0])
        if head == "function":  # its body is the { ... } on its line or the next
            opened = any(isinstance(w, Word) and w.literal() == "{" for w in cmd.words[1:])
            return self._skip_to(i + 1 if opened else i + 2, ("}",))
        return self._skip_to(i + 1, ({"if": "fi", "case": "esac"}.get(head, "done"),))

    def _skip_to(self, i: int, stops: Tuple[str, ...]) -> int:
        opens = {"if": "fi", "case": "esac", "for": "done", "while": "done", "until": "done", "select": "done",
                 "{": "}"}
        depth: List[str] = []
        while i < len(self.commands):
            head = _literal(self.commands[i].words[0])
            if not depth and head in stops:
                return i
            if head in opens:
                depth.append(opens[head])
            elif head == "function" and any(isinstance(w, Word) and w.literal() == "{" for w in self.commands[i].words):
                depth.append("}")
            elif depth and head == depth[-1]:
                depth.pop()
            i += 1
        raise ConfigError(f"a block is never closed with {' or '.join(stops)}: fix the script")

    # -- simple commands ------------------------------------------------------------------------
    def _simple(self, cmd: Command) -> None:
        words = cmd.words
        k = 0
        while k < len(words) and (isinstance(words[k], Array) or words[k].assignment()):
            k += 1
        if k == len(words):
            for w in words:
                self._assign(w)
            return
        head = _literal(words[k])
        if head in DECLARATIONS:
            for w in words[k + 1:]:
                if isinstance(w, Array) or w.assignment():
                    self._assign(w)
            return
        if head == "unset":
            for w in words[k + 1:]:
                self.vars.pop(_literal(w) or "", None)
            return
        if head == "exit":
            self.stopped = True
            return
        if head in ("source", ".", "eval"):
            self._unknown_line(cmd.line, f"'{head}' is not followed: flags it would add were not read")
            return
        if head in self.functions:
            self._unknown_line(cmd.line, f"{head} is a shell function (line {self.functions[head]}): not run")
            return
        argv, reasons = [], []
        for w in words[k:]:
            got, why = self.expand(w, split=True) if isinstance(w, Word) else ([], [])
            argv.extend(got)
            reasons.extend(why)
        self.runs.append(_Run(argv, reasons, cmd.line))

    def _assign(self, w: Union[Word, Array]) -> None:
        if isinstance(w, Array):
            values, reasons = [], []
            for item in w.words:
                got, why = self.expand(item, split=True)
                values.extend(got)
                reasons.extend(why)
            name, append = w.name, w.append
        else:
            name, append, value = w.assignment()
            got, reasons = self.expand(value, split=False)
            values = " ".join(got)
        unknown = bool(reasons) and not append and isinstance(w, Word) and len(value.parts) == 1 and \
            value.parts[0][0] != "lit"
        old = self.vars.get(name)
        if append and old is not None:
            if isinstance(values, list):
                values = (old.value if isinstance(old.value, list) else [old.value]) + values
            else:
                values = " ".join(old.value) + values if isinstance(old.value, list) else old.value + values
            reasons = list(old.reasons) + reasons
        self.vars[name] = _Var(values, tuple(dict.fromkeys(reasons)), unknown)

    # -- expansion ------------------------------------------------------------------------------
    def expand(self, word: Word, split: bool) -> Tuple[List[str], List[str]]:
        """The fields ``word`` becomes, as bash makes them (quoted parts are never split), and
        why any part of it is unknown."""
        fields: List[str] = []
        current: Optional[str] = None
        reasons: List[str] = []
        for kind, text, quoted in word.parts:
            if kind == "lit":
                current = (current or "") + text
                continue
            value, why = self._part(kind, text, quoted, word.line)
            reasons.extend(why)
            if quoted and isinstance(value, list):  # "${ARRAY[@]}": one field per element
                for n, item in enumerate(value):
                    if n:
                        fields.append(current or "")
                        current = None
                    current = (current or "") + item
                continue
            value = " ".join(value) if isinstance(value, list) else value
            if quoted or not split:
                current = (current or "") + value
                continue
            for n, piece in enumerate(re.split(r"[ \t\n]+", value)):
                if n and current is not None:
                    fields.append(current)
                    current = None
                if piece:
                    current = (current or "") + piece
        if current is not None:
            fields.append(current)
        return fields, reasons

    def _part(self, kind: str, text: str, quoted: bool, line: int):
        if kind == "var":
            return self._lookup(text, line)
        if kind == "param":
            return self._parameter(text, quoted, line)
        if kind == "arith":
            return self._arithmetic(text, line)
        return f"$({text})", [f"line {line}: $({text.strip()}): a command substitution is not run"]

    def _lookup(self, name: str, line: int, index: Optional[str] = None):
        var = self.vars.get(name)
        if var is None:
            what = ("the script's own arguments" if name in "@*" else f"the script's argument {name}"
                    if name.isdigit() else "a shell special parameter" if not name[0].isalpha() and name[0] != "_"
                    else "not set in the file")
            return f"${name}", [f"line {line}: ${name}: {what}"]
        if var.unknown:
            return f"${name}", [f"${name} <- {r}" for r in var.reasons]
        reasons = list(var.reasons)
        value = var.value
        if index in ("@", "*"):
            return (value if isinstance(value, list) else [value]), reasons
        if isinstance(value, list):
            n = int(index or 0)
            return (value[n] if n < len(value) else ""), reasons
        return (value if index in (None, "0") else ""), reasons

    def _parameter(self, inner: str, quoted: bool, line: int):
        m = re.fullmatch(r"(#?)([A-Za-z_][A-Za-z0-9_]*|[0-9]+|[@*#?$!-])(?:\[(@|\*|[0-9]+)\])?(?:(:?[-=+?])(.*))?",
                         inner, re.S)
        if not m:
            return "${" + inner + "}", [f"line {line}: ${{{inner}}}: only ${{NAME}}, ${{NAME:-default}} and "
                                        "${ARRAY[@]} are read"]
        count, name, index, op, default = m.groups()
        var = self.vars.get(name)
        if count:
            if var is None or var.reasons:
                return "${" + inner + "}", [f"line {line}: ${{{inner}}}: {name} is not known"]
            value = var.value
            return str(len(value) if isinstance(value, list) and index else len(" ".join(value) if isinstance(
                value, list) else value)), []
        is_set = var is not None and not (op and op.startswith(":") and var.value in ("", []))
        if op and op.endswith("+"):
            return (self._default(default, quoted, line) if is_set else ("", []))
        if op and not is_set and not op.endswith("?"):
            value, reasons = self._default(default, quoted, line)
            if op.endswith("="):
                self.vars[name] = _Var(value, tuple(reasons))
            return value, reasons
        return self._lookup(name, line, index)

    def _default(self, text: str, quoted: bool, line: int):
        fields, reasons = self.expand(Word(Lexer(text, line=line).whole_word(quoted), line), split=False)
        return " ".join(fields), reasons

    def _arithmetic(self, expr: str, line: int):
        unknown = f"$(({expr}))", [f"line {line}: $(({expr.strip()})): not an integer expression of known values"]
        names = set(re.findall(r"\$?\{?([A-Za-z_][A-Za-z0-9_]*)\}?", expr))
        values = {}
        for name in names:
            var = self.vars.get(name)
            if var is None or var.reasons or isinstance(var.value, list) or not re.fullmatch(r"-?\d+", var.value):
                return unknown
            values[name] = int(var.value)
        text = re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", r"\1", expr)
        try:
            return str(_integer(ast.parse(text.strip(), mode="eval").body, values)), []
        except (SyntaxError, ValueError, ZeroDivisionError, KeyError):
            return unknown

    def _unknown(self, i: int, why: str) -> None:
        self._unknown_line(self.commands[i].line, why)

    def _unknown_line(self, line: int, why: str) -> None:
        text = self.lines[line - 1].strip() if 0 < line <= len(self.lines) else ""
        self.unresolved.append(f"line {line}: {text[:80]}: {why}")


_INTEGER_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.floordiv,
                ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}


def _integer(node, values: Dict[str, int]) -> int:
    """Bash integer arithmetic over known values: + - * / %, unary minus, parentheses."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.Name):
        return values[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _integer(node.operand, values)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _INTEGER_OPS:
        left, right = _integer(node.left, values), _integer(node.right, values)
        if abs(left) > 2 ** 62 or abs(right) > 2 ** 62:
            raise ValueError("out of range")
        return _INTEGER_OPS[type(node.op)](left, right)
    raise ValueError("not integer arithmetic")


@dataclass
class _Test:
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


_COMPARE = {
    "=": lambda a, b: fnmatch.fnmatchcase(a, b), "==": lambda a, b: fnmatch.fnmatchcase(a, b),
    "!=": lambda a, b: not fnmatch.fnmatchcase(a, b), "=~": _regex,
    "-eq": lambda a, b: int(a) == int(b), "-ne": lambda a, b: int(a) != int(b), "-lt": lambda a, b: int(a) < int(b),
    "-le": lambda a, b: int(a) <= int(b), "-gt": lambda a, b: int(a) > int(b), "-ge": lambda a, b: int(a) >= int(b),
}
