"""Value checks that hold for every key of a kind: floats are finite, seeds fit the generators.

Part of ``config.derive``: pure, before any worker starts, one ``ConfigError`` line per violation.
Hydra and OmegaConf parse ``nan`` and ``inf`` as valid floats, and a NaN passes every ``<`` or
``>`` test a range check would make (``nan < 0`` is false), so a NaN learning rate or clipping
threshold would otherwise reach the optimizer and train on garbage. No key of the schema gives
``inf`` a meaning (unbounded things are ``null`` or ``0``), so the finite check walks the whole
config instead of naming keys: a key added later is covered too.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Iterator, Tuple

from megatron_hydra.errors import ConfigError

# numpy's RandomState and Lightning's seed_everything take seeds in [0, 2**32).
SEED_LIMIT = 2 ** 32
# parallel.random.stage_seed offsets the run seed by this much per pipeline stage.
STAGE_SEED_STRIDE = 100

# key -> (test, what the value must be); checked only when the value is not null.
RANGES: Tuple[Tuple[str, Callable[[Any], bool], str], ...] = (
    ("data.seed", lambda v: 0 <= v < SEED_LIMIT, f"an integer in [0, {SEED_LIMIT}) (numpy's seed range)"),
    ("optim.adam_beta1", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("optim.adam_beta2", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("optim.adam_eps", lambda v: v > 0, "> 0"),
    ("optim.weight_decay", lambda v: v >= 0, ">= 0 (0 disables it)"),
    ("model.norm_eps", lambda v: v >= 0, ">= 0"),
    ("model.rope_theta", lambda v: v > 0, "> 0"),
)


def _children(node: Any) -> Iterator[Tuple[str, Any]]:
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        for f in dataclasses.fields(node):
            yield f".{f.name}", getattr(node, f.name)
    elif isinstance(node, Mapping):
        for k, v in node.items():
            yield f".{k}", v
    elif isinstance(node, Sequence) and not isinstance(node, (str, bytes)):
        for i, v in enumerate(node):
            yield f"[{i}]", v


def non_finite(cfg: Any) -> Iterator[Tuple[str, float]]:
    """``(key, value)`` of every NaN or infinite float in ``cfg``, lists and nested nodes included."""
    stack = list(_children(cfg))[::-1]  # depth first, in schema order: the first bad key is named
    while stack:
        key, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            yield key.lstrip("."), value
        else:
            stack.extend([(key + k, v) for k, v in _children(value)][::-1])


def _get(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def check_ranges(cfg: Any) -> None:
    """Every float finite, and the keys of ``RANGES`` and ``seed`` in range."""
    for key, value in non_finite(cfg):
        raise ConfigError(f"{key}={value} is not a finite number: give it a finite value (its meaning and "
                          "default are in megatron_hydra/config/schema.py)")
    pp = max(1, cfg.parallel.pipeline_parallel_size)
    limit = SEED_LIMIT - STAGE_SEED_STRIDE * (pp - 1)
    if not 0 <= cfg.seed < limit:
        staged = f" (pipeline stage k seeds with seed + {STAGE_SEED_STRIDE} k)" if pp > 1 else ""
        raise ConfigError(f"seed={cfg.seed} must be an integer in [0, {limit}){staged}: numpy and Lightning take "
                          f"seeds in [0, 2**32); give a seed in that range, e.g. seed=1234")
    for key, test, what in RANGES:
        value = _get(cfg, key)
        if value is not None and not test(value):
            raise ConfigError(f"{key}={value} must be {what}: change it (the default is in "
                              "megatron_hydra/config/schema.py)")
