"""Refuse config keys the schema does not know.

Hydra's ``+key=value`` adds a key even to a typed (structured) config, and turning that config into
the ``RunConfig`` dataclass then drops it without a word: ``+trainer.max_step=5`` would train for
the default number of steps. Walking the composed config against the dataclasses finds such keys.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Iterator, Optional

from omegaconf import DictConfig

from megatron_hydra.config.schema import RunConfig
from megatron_hydra.errors import ConfigError


def _dataclass_of(hint) -> Optional[type]:
    """The dataclass a field holds (``Optional[ClusterConfig]`` -> ``ClusterConfig``), else None."""
    if dataclasses.is_dataclass(hint):
        return hint
    for arg in typing.get_args(hint):
        if dataclasses.is_dataclass(arg):
            return arg
    return None


def unknown_keys(node: DictConfig, schema: type = RunConfig, prefix: str = "") -> Iterator[str]:
    """Dotted names of the keys of ``node`` that ``schema`` (a dataclass) has no field for."""
    hints = typing.get_type_hints(schema)
    for key in node.keys():
        name = f"{prefix}{key}"
        child = node._get_node(key)
        if key not in hints:
            yield _first_leaf(child, name)
            continue
        inner = _dataclass_of(hints[key])
        if inner is not None and isinstance(child, DictConfig) and not child._is_none():
            yield from unknown_keys(child, inner, f"{name}.")


def _first_leaf(node, name: str) -> str:
    """``+unknown.key=1`` adds a dict ``unknown``: name the key as the user wrote it."""
    while isinstance(node, DictConfig) and not node._is_none() and len(node) > 0:
        key = next(iter(node.keys()))
        node, name = node._get_node(key), f"{name}.{key}"
    return name


def check_known_keys(cfg: DictConfig) -> None:
    """A one-line ConfigError naming the first key the schema does not know."""
    for name in unknown_keys(cfg):
        raise ConfigError(f"unknown config key {name!r}: the schema (megatron_hydra/config/schema.py) has no such "
                          "key, so it would be ignored; remove it or fix its spelling")
