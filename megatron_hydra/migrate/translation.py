"""What a translation holds while it is made: config keys with the flags they came from, the
flags that needed no key and why, and the values our schema cannot hold."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Tuple

from megatron_hydra.migrate.command_line import CommandLine
from megatron_hydra.migrate.values import hydra_value

DEFAULT = "Megatron-LM's default"


@dataclass
class Translation:
    cl: CommandLine
    groups: Dict[str, str] = field(default_factory=dict)  # config group -> option
    group_sources: Dict[str, Tuple[str, ...]] = field(default_factory=dict)  # config group -> flags
    keys: Dict[str, Any] = field(default_factory=dict)  # our key -> value
    sources: Dict[str, Tuple[str, ...]] = field(default_factory=dict)  # our key -> flags (empty: a default)
    ignored: Dict[str, str] = field(default_factory=dict)  # a translated flag that set no key -> why
    refused: List[Tuple[str, str, str]] = field(default_factory=list)  # (flag, value, why)
    notes: List[str] = field(default_factory=list)
    before: List[str] = field(default_factory=list)  # commands to run first (checkpoint conversion)

    def set(self, key: str, value: Any, *flags: str) -> None:
        """``key`` takes ``value`` because of ``flags`` (none: Megatron-LM's default for it)."""
        self.keys[key] = value
        self.sources[key] = tuple(f for f in flags if f in self.cl.raw or f in self.cl.world_flags)

    def group(self, name: str, option: str, *flags: str) -> None:
        self.groups[name] = option
        self.group_sources[name] = tuple(f for f in flags if f in self.cl.raw)

    def ignore(self, flag: str, why: str) -> None:
        if flag in self.cl.raw:
            self.ignored[flag] = why

    def refuse(self, flag: str, why: str) -> None:
        """``flag`` (given, or required and missing) asks for what our schema cannot hold."""
        if all(flag != f for f, _, _ in self.refused):  # the first reason is the one to fix
            self.refused.append((flag, " ".join(self.cl.raw.get(flag, [])), why))

    def used(self) -> Dict[str, List[str]]:
        """Flag -> the overrides it became (``precision=fp16``, ``optim.lr=0.0003``)."""
        out: Dict[str, List[str]] = {}
        for name, flags in self.group_sources.items():
            for flag in flags:
                out.setdefault(flag, []).append(f"{name}={self.groups[name]}")
        for key, flags in self.sources.items():
            for flag in flags:
                out.setdefault(flag, []).append(f"{key}={hydra_value(self.keys[key])}")
        return out

    def defaults(self) -> List[str]:
        """Keys set from Megatron-LM's defaults (no flag)."""
        return [key for key, flags in self.sources.items() if not flags]
