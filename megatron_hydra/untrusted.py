"""Reading files that come from elsewhere: checkpoints, Hugging Face directories, datasets, chat
templates. Such a file is hostile until parsed, so every read here

- opens regular files only: a FIFO, a device or a directory is refused at once instead of
  blocking the reader forever (the open itself does not block: ``O_NONBLOCK``);
- reads at most a stated number of bytes, so a huge file is an error, not an exhausted memory;
- parses JSON and YAML with bounded nesting and no YAML aliases (an alias "bomb" expands a few
  hundred bytes into billions of nodes) and no YAML tags beyond the plain scalars;
- reports every problem as one line naming the file, in the error class the caller names.

Nothing is ever executed or imported from what is read.
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any, Type

import yaml

from megatron_hydra.errors import CheckpointError, MegatronHydraError

MAX_DEPTH = 64  # nesting of JSON/YAML values: real configs stay below 10
MiB = 1024 * 1024


def open_regular(path: str, what: str = "file", error: Type[MegatronHydraError] = CheckpointError,
                 follow_links: bool = True) -> int:
    """A read-only descriptor of ``path``; a one-line ``error`` unless it is a regular file.
    Links are followed unless ``follow_links`` is false (a Hugging Face cache snapshot is links),
    but what they lead to must be a regular file."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    if not follow_links:
        flags |= os.O_NOFOLLOW
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise error(f"{path}: no such {what}") from None
    except OSError as e:
        raise error(f"{path}: cannot open this {what} ({e.strerror or e}): it must be a readable regular file") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "directory" if stat.S_ISDIR(mode) else "FIFO" if stat.S_ISFIFO(mode) else "special file"
        raise error(f"{path}: is a {kind}, not a regular file: refused (only regular files are read as a {what})")
    os.set_blocking(fd, True)
    return fd


def read_bytes(path: str, limit: int, what: str = "file", error: Type[MegatronHydraError] = CheckpointError) -> bytes:
    """The whole content of the regular file ``path``, refused when it is larger than ``limit``."""
    fd = open_regular(path, what, error)
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise error(f"{path}: larger than {limit:,} bytes, more than any {what} holds: refused as damaged or crafted")
    return data


def read_text(path: str, limit: int, what: str = "file", error: Type[MegatronHydraError] = CheckpointError) -> str:
    try:
        return read_bytes(path, limit, what, error).decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}): the {what} is damaged") from None


def depth(value: Any) -> int:
    """Nesting depth of a parsed JSON/YAML value (1 for a scalar), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        deepest = max(deepest, level)
        if isinstance(item, dict):
            stack.extend((v, level + 1) for v in item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend((v, level + 1) for v in item)
    return deepest


def _check_depth(value: Any, source: str, error: Type[MegatronHydraError], max_depth: int) -> Any:
    if depth(value) > max_depth:
        raise error(f"{source}: nested deeper than {max_depth} levels: refused as damaged or crafted")
    return value


def parse_json(text: str, source: str, error: Type[MegatronHydraError] = CheckpointError,
               max_depth: int = MAX_DEPTH) -> Any:
    """The JSON value in ``text`` (read from ``source``, named in errors)."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise error(f"{source}: nested deeper than {max_depth} levels: refused as damaged or crafted") from None
    except ValueError as e:  # JSONDecodeError
        raise error(f"{source}: not valid JSON ({str(e).splitlines()[0]})") from None
    return _check_depth(value, source, error, max_depth)


def load_json(path: str, limit: int, what: str = "file", error: Type[MegatronHydraError] = CheckpointError,
              max_depth: int = MAX_DEPTH) -> Any:
    """The JSON value in the regular file ``path`` of at most ``limit`` bytes."""
    return parse_json(read_text(path, limit, what, error), path, error, max_depth)


class _PlainLoader(yaml.SafeLoader):
    """YAML's safe loader without anchors and aliases: plain mappings, lists and scalars only.
    (The safe loader already refuses ``!!python/...`` tags.)"""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            raise yaml.constructor.ConstructorError(None, None, "aliases (*name) are not allowed here", mark)
        event = self.peek_event()
        if getattr(event, "anchor", None) is not None:
            raise yaml.constructor.ConstructorError(None, None, "anchors (&name) are not allowed here",
                                                    event.start_mark)
        return super().compose_node(parent, index)


def parse_yaml(text: str, source: str, error: Type[MegatronHydraError] = CheckpointError,
               max_depth: int = MAX_DEPTH) -> Any:
    """The YAML value in ``text``: no aliases, no anchors, no tags but YAML's plain ones."""
    try:
        value = yaml.load(text, Loader=_PlainLoader)  # noqa: S506 - _PlainLoader is a SafeLoader
    except RecursionError:
        raise error(f"{source}: nested deeper than {max_depth} levels: refused as damaged or crafted") from None
    except yaml.YAMLError as e:
        first = " ".join(str(e).split())[:300]
        raise error(f"{source}: not plain YAML data ({first})") from None
    return _check_depth(value, source, error, max_depth)


def surrogate(text: str) -> str:
    """Where ``text`` holds a lone surrogate (a JSON ``\\ud800``-style escape that is no
    character: UTF-8 cannot encode it, nor can a tokenizer), or "" when it holds none."""
    if text.isascii():
        return ""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return (f"lone surrogate escape \\u{ord(text[e.start]):04x} at character {e.start}, which is not "
                "Unicode text")
    return ""
