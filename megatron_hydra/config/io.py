"""The run config as text: what the launcher hands its workers (``resolved_config.yaml``) and what
every checkpoint carries in its ``meta.json``; one serialisation for both. Also ``free_port``,
the local rendezvous port a launcher or a test picks for its ranks."""

from __future__ import annotations

import dataclasses
import os
import random
import socket
from typing import Tuple

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megatron_hydra.config.schema import RunConfig
from megatron_hydra.errors import ConfigError

CONFIG_FILE = "resolved_config.yaml"


def to_yaml(cfg: RunConfig) -> str:
    """``cfg`` as YAML, keys in schema order. Plain ``yaml.safe_dump`` of the dataclass fields:
    the same text as OmegaConf's ``to_yaml(structured(cfg))`` (the config holds only YAML scalars,
    lists and dicts) at a tenth of the cost; each worker writes it into every checkpoint."""
    return yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False, allow_unicode=True)


def from_yaml(text: str, source: str) -> RunConfig:
    """The typed config in ``text``; a one-line ``ConfigError`` naming ``source`` when it does not
    fit the schema (a checkpoint written by another version). A missing ``run_dir`` (a config that
    is not a run's) becomes ``unused``."""
    try:
        loaded = OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.create(text))
    except OmegaConfBaseException as e:
        raise ConfigError(f"{source}: its config does not fit this version's schema "
                          f"({str(e).splitlines()[0]})") from None
    if OmegaConf.is_missing(loaded, "run_dir"):
        loaded.run_dir = "unused"
    return OmegaConf.to_object(loaded)


def write_config(cfg: RunConfig, run_dir: str) -> str:
    """Write ``cfg`` as ``run_dir/resolved_config.yaml``; returns its path."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, CONFIG_FILE)
    with open(path, "w") as f:
        f.write(to_yaml(cfg))
    return path


def read_config(path: str) -> RunConfig:
    with open(path) as f:
        return from_yaml(f.read(), path)


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
