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

A script comes from elsewhere, so reading it has a bounded cost whatever it holds: the file is at
most ``MAX_SCRIPT_BYTES``; one expanded word or variable at most ``MAX_WORD`` (``A="$A$A"`` thirty
times would otherwise ask for gigabytes); everything expansion builds, the whole script long, at
most ``MAX_EXPANDED`` (twice the largest file, so the literal text of any readable script fits);
one ``$((...))`` or ``${...}`` at most ``MAX_EXPRESSION`` characters; a glob comparison in a test
at most ``shell_eval.MAX_GLOB`` characters a side (else it is unknown). Launch scripts are a few
KiB and stay far below every limit; past one, or nested too deeply to follow, the script is
refused in one line that names it and the line.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

from megatron_hydra.errors import ConfigError, one_line
from megatron_hydra.migrate.shell_eval import Test, integer
from megatron_hydra.migrate.shell_lexer import ASSIGNMENT, Array, Lexer, Op, Word
from megatron_hydra.untrusted import MiB

KEYWORD_STARTS = ("then", "else", "do", "{")
DECLARATIONS = ("export", "declare", "typeset", "local", "readonly")
PYTHON = re.compile(r"(^|/)python[0-9.]*$")
LAUNCHERS = ("torchrun", "srun", "mpirun", "deepspeed", "accelerate")
WRAPPERS = ("nohup", "exec", "time", "env")
MAX_SCRIPT_BYTES = 1 * MiB
MAX_WORD = 1 * MiB
MAX_EXPANDED = 2 * MAX_SCRIPT_BYTES
MAX_EXPRESSION = 10_000
MAX_REASONS = 20  # why a value is unknown: the first ones are enough to fix it


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
    shell = None
    try:
        shell = _Shell(_commands(text), text.splitlines())
        shell.block(0, ())
    except ConfigError as e:
        raise ConfigError(f"{source}: {one_line(e)}") from None
    except (RecursionError, MemoryError):
        where = f"line {shell.line}: " if shell else ""
        raise ConfigError(f"{source}: {where}nested too deeply or too large for this reader (launch scripts are "
                          "neither): fix the script") from None
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
        self.line = 0  # the command being run, for errors
        self.expanded = 0  # characters expansion has built so far (MAX_EXPANDED)

    def block(self, i: int, stops: Tuple[str, ...]) -> int:
        """Run commands from ``i`` up to one whose keyword is in ``stops``; its index."""
        while i < len(self.commands) and not self.stopped:
            self.line = self.commands[i].line
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
        return Test(fields).evaluate()

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
            size = _size(values)  # a new value built from the old one: checked and counted here
            if size > MAX_WORD:
                raise ConfigError(f"line {w.line}: {name} would hold {size:,} characters, more than the "
                                  f"{MAX_WORD:,} a variable may hold here: fix the script")
            self._charge(size, w.line)
        self.vars[name] = _Var(values, tuple(dict.fromkeys(reasons))[:MAX_REASONS], unknown)

    # -- expansion ------------------------------------------------------------------------------
    def expand(self, word: Word, split: bool) -> Tuple[List[str], List[str]]:
        """The fields ``word`` becomes, as bash makes them (quoted parts are never split), and
        why any part of it is unknown."""
        fields: List[str] = []
        current: Optional[List[str]] = None  # the pieces of the field being built, joined once
        reasons: List[str] = []
        size = 0
        for kind, text, quoted in word.parts:
            value, why = (text, []) if kind == "lit" else self._part(kind, text, quoted, word.line)
            reasons.extend(why[:MAX_REASONS])
            size += _size(value)
            if size > MAX_WORD:
                raise ConfigError(f"line {word.line}: a word expands to more than {MAX_WORD:,} characters, more than "
                                  "any flag holds: fix the script")
            if kind == "lit":
                current = _extended(current, text)
                continue
            if quoted and isinstance(value, list):  # "${ARRAY[@]}": one field per element
                for n, item in enumerate(value):
                    if n:
                        fields.append("".join(current or []))
                        current = None
                    current = _extended(current, item)
                continue
            value = " ".join(value) if isinstance(value, list) else value
            if quoted or not split:
                current = _extended(current, value)
                continue
            for n, piece in enumerate(re.split(r"[ \t\n]+", value)):
                if n and current is not None:
                    fields.append("".join(current))
                    current = None
                if piece:
                    current = _extended(current, piece)
        if current is not None:
            fields.append("".join(current))
        self._charge(_size(fields), word.line)
        return fields, reasons

    def _charge(self, size: int, line: int) -> None:
        self.expanded += size
        if self.expanded > MAX_EXPANDED:
            raise ConfigError(f"line {line}: expansions build more than {MAX_EXPANDED // MiB} MiB of text in this "
                              "script, more than any launch script: fix the script")

    def _part(self, kind: str, text: str, quoted: bool, line: int):
        if kind in ("param", "arith") and len(text) > MAX_EXPRESSION:
            shown = "${...}" if kind == "param" else "$((...))"
            raise ConfigError(f"line {line}: a {shown} of {len(text):,} characters, longer than the "
                              f"{MAX_EXPRESSION:,} this reader evaluates: fix the script")
        if kind == "var":
            return self._lookup(text, line)
        if kind == "param":
            return self._parameter(text, quoted, line)
        if kind == "arith":
            return self._arithmetic(text, line)
        return f"$({text})", [f"line {line}: $({_shown(text)}): a command substitution is not run"]

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
        m = re.fullmatch(r"(#?)([A-Za-z_][A-Za-z0-9_]*|[0-9]+|[@*#?$!-])(?:\[(@|\*|[0-9]{1,18})\])?(?:(:?[-=+?])(.*))?",
                         inner, re.S)
        if not m:
            return "${" + inner + "}", [f"line {line}: ${{{_shown(inner)}}}: only ${{NAME}}, ${{NAME:-default}} "
                                        "and ${ARRAY[@]} are read"]
        count, name, index, op, default = m.groups()
        var = self.vars.get(name)
        if count:
            if var is None or var.reasons:
                return "${" + inner + "}", [f"line {line}: ${{{_shown(inner)}}}: {name} is not known"]
            value = var.value
            return str(len(value) if isinstance(value, list) and index else len(" ".join(value) if isinstance(
                value, list) else value)), []
        is_set = var is not None and not (op and op.startswith(":") and var.value in ("", []))
        if op and op.endswith("+"):
            return (self._default(default, quoted, line) if is_set else ("", []))
        if op and not is_set and not op.endswith("?"):
            value, reasons = self._default(default, quoted, line)
            if op.endswith("="):
                self.vars[name] = _Var(value, tuple(reasons[:MAX_REASONS]))
            return value, reasons
        return self._lookup(name, line, index)

    def _default(self, text: str, quoted: bool, line: int):
        fields, reasons = self.expand(Word(Lexer(text, line=line).whole_word(quoted), line), split=False)
        return " ".join(fields), reasons

    def _arithmetic(self, expr: str, line: int):
        unknown = f"$(({expr}))", [f"line {line}: $(({_shown(expr)})): not an integer expression of known values"]
        names = set(re.findall(r"\$?\{?([A-Za-z_][A-Za-z0-9_]*)\}?", expr))
        values = {}
        for name in names:
            var = self.vars.get(name)
            if var is None or var.reasons or isinstance(var.value, list) or not re.fullmatch(r"-?\d{1,19}", var.value):
                return unknown
            values[name] = int(var.value)
        text = re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", r"\1", expr)
        try:
            return str(integer(ast.parse(text.strip(), mode="eval").body, values)), []
        except (SyntaxError, ValueError, ZeroDivisionError, KeyError):
            return unknown
        except (RecursionError, MemoryError):
            raise ConfigError(f"line {line}: $(({_shown(expr)})) is nested too deeply to evaluate: fix the "
                              "script") from None

    def _unknown(self, i: int, why: str) -> None:
        self._unknown_line(self.commands[i].line, why)

    def _unknown_line(self, line: int, why: str) -> None:
        text = self.lines[line - 1].strip() if 0 < line <= len(self.lines) else ""
        self.unresolved.append(f"line {line}: {_shown(text)}: {why}")


def _extended(pieces: Optional[List[str]], text: str) -> List[str]:
    if pieces is None:
        pieces = []
    pieces.append(text)
    return pieces


def _size(value: Union[str, List[str]]) -> int:
    """Characters of a value, one more per field of a list (its separator)."""
    return len(value) if isinstance(value, str) else sum(len(v) + 1 for v in value)


def _shown(text: str) -> str:
    """``text`` short enough for a line of the report."""
    text = text.strip()
    return text if len(text) <= 80 else text[:77] + "..."
