"""The run config as text: what the launcher hands its workers (``resolved_config.yaml``) and what
every checkpoint carries in its ``meta.json``; one serialisation for both. Also ``free_port``,
the local rendezvous port a launcher or a test picks for its ranks."""

from __future__ import annotations

import dataclasses
import os
import random
import re
import socket
from typing import Any, Tuple

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megatron_hydra import untrusted
from megatron_hydra.config.schema import RunConfig
from megatron_hydra.errors import ConfigError, one_line

CONFIG_FILE = "resolved_config.yaml"


# A stored config is a few kilobytes; a checkpoint's may hold a long data blend.
MAX_CONFIG_BYTES = 4 * 1024 * 1024
# Keys that make Hydra or OmegaConf act rather than hold a value: never in a stored config.
_ACTIVE_KEYS = ("hydra", "_target_", "defaults")


class _NoAliasDumper(yaml.SafeDumper):
    """Every value written out in full: a stored config never holds YAML anchors or aliases,
    which ``from_yaml`` refuses."""

    def ignore_aliases(self, data) -> bool:
        return True


def to_yaml(cfg: RunConfig) -> str:
    """``cfg`` as YAML, keys in schema order. Plain YAML of the dataclass fields: the same text as
    OmegaConf's ``to_yaml(structured(cfg))`` (the config holds only YAML scalars, lists and dicts)
    at a tenth of the cost; each worker writes it into every checkpoint."""
    return yaml.dump(dataclasses.asdict(cfg), Dumper=_NoAliasDumper, sort_keys=False, allow_unicode=True)


def _literal(value: Any, source: str, where: str = "") -> Any:
    """``value`` as inert data: a key that would make Hydra act is refused, and a ``${...}`` in a
    string is escaped, so OmegaConf keeps it as text instead of resolving it (a stored config was
    resolved before it was written: an interpolation in it was not put there by us)."""
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise ConfigError(f"{source}: key {key!r}{' under ' + where if where else ''} is not a string: "
                                  "not a megatron-hydra config")
            if key in _ACTIVE_KEYS or key.startswith("_"):
                raise ConfigError(f"{source}: holds the key {where + '.' if where else ''}{key}, which no stored "
                                  "config has: refused (a stored config is data, never Hydra instructions)")
            out[key] = _literal(item, source, f"{where}.{key}" if where else key)
        return out
    if isinstance(value, list):
        return [_literal(item, source, where) for item in value]
    if isinstance(value, str) and "${" in value:  # backslashes just before it doubled, then escaped
        return re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + "\\${", value)
    return value


def config_data(text: str, source: str) -> dict:
    """The mapping a stored config's YAML ``text`` holds, read as data only: bounded size and
    nesting, no aliases or tags (``untrusted.parse_yaml``), no Hydra keys, interpolations kept
    as text. ``source`` names the file in errors."""
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{source}: its config is larger than {MAX_CONFIG_BYTES:,} bytes: refused as damaged or "
                          "crafted")
    value = untrusted.parse_yaml(text, source, ConfigError)
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: its config is a {type(value).__name__}, not a mapping: not a megatron-hydra "
                          "config")
    return _literal(value, source)


def from_yaml(text: str, source: str) -> RunConfig:
    """The typed config in ``text``; a one-line ``ConfigError`` naming ``source`` when it does not
    fit the schema (a checkpoint written by another version) or is not plain data. A missing
    ``run_dir`` (a config that is not a run's) becomes ``unused``."""
    data = config_data(text, source)
    try:
        loaded = OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.create(data))
        if OmegaConf.is_missing(loaded, "run_dir"):
            loaded.run_dir = "unused"
        return OmegaConf.to_object(loaded)
    except OmegaConfBaseException as e:
        raise ConfigError(f"{source}: its config does not fit this version's schema "
                          f"({one_line(e)})") from None


def write_config(cfg: RunConfig, run_dir: str) -> str:
    """Write ``cfg`` as ``run_dir/resolved_config.yaml``; returns its path."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, CONFIG_FILE)
    with open(path, "w") as f:
        f.write(to_yaml(cfg))
    return path


def read_config(path: str) -> RunConfig:
    return from_yaml(untrusted.read_text(path, MAX_CONFIG_BYTES, "config file", ConfigError), path)


def _ephemeral_range() -> Tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A local TCP port that is free now, for a rendezvous store that binds it a moment later.
    It is drawn below the kernel's ephemeral range: outgoing connections (other runs' store
    clients) take their ports from that range, and one of them could take a port picked there
    between this check and the bind (EADDRINUSE at rank 0's store)."""
    low, _ = _ephemeral_range()
    candidates = list(range(max(1024, low - 12000), low))
    for port in random.Random().sample(candidates, min(64, len(candidates))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # everything tried is taken: let the kernel choose
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
