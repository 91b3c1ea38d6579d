"""Typed ``key=value`` arguments for the command-line tools (convert, generate).

The same override syntax as ``launch.py`` (OmegaConf dot-lists: ``sampling.top_p=0.9``), merged
into a dataclass so that a misspelled key or a wrong type is a one-line ``ConfigError``.
"""

from __future__ import annotations

from dataclasses import fields
from typing import List, Sequence

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megatron_hydra.errors import ConfigError


def parse_args(schema, overrides: Sequence[str]):
    """An instance of the dataclass ``schema`` with ``overrides`` applied."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"argument {item!r} is not key=value (keys: {', '.join(_keys(schema))})")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), OmegaConf.from_dotlist(list(overrides)))
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(f"{str(e).splitlines()[0]} (keys: {', '.join(_keys(schema))})") from None


def _keys(schema) -> List[str]:
    return [f.name for f in fields(schema)]
