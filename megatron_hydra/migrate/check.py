"""The translated overrides composed as launch.py would, held to what the translation meant, and
(``--check``) run as ``mode=plan`` and a one-step ``mode=dry_run`` of chosen ranks."""

from __future__ import annotations

import copy
import math
from typing import Any, List, Optional, Sequence

from megatron_hydra.config import RunConfig
from megatron_hydra.errors import ConfigError, MegatronHydraError, one_line
from megatron_hydra.migrate.translation import Translation
from megatron_hydra.migrate.values import hydra_value


def compose(overrides: Sequence[str]) -> RunConfig:
    """The typed config of ``overrides`` on a GPU job's terms (``trainer=gpu`` is in them)."""
    from omegaconf.errors import OmegaConfBaseException

    from megatron_hydra.config.bundled import compose as bundled_compose

    try:
        return bundled_compose(list(overrides))
    except (MegatronHydraError, OmegaConfBaseException, ValueError) as e:
        raise ConfigError(f"the translated overrides do not compose: {one_line(e)}") from None
    except Exception as e:  # noqa: BLE001 - Hydra's own errors (an unknown option, a bad override)
        if type(e).__module__.startswith("hydra"):
            raise ConfigError(f"the translated overrides do not compose: {one_line(e)}") from None
        raise


def check_composed(t: Translation, cfg: RunConfig) -> Optional[str]:
    """Why ``cfg`` does not hold every translated value (a preset or a dropped default changed
    one), in one line with the override that restores it; None when it holds them all."""
    for key, value in t.keys.items():
        got = _get(cfg, key)
        if not _same(got, value):
            return (f"{key}: the translation means {hydra_value(value)}, but the printed overrides compose to "
                    f"{hydra_value(got)}: add {key}={hydra_value(value)}")
    return None


def validate(cfg: RunConfig) -> Optional[str]:
    """derive's one-line error for ``cfg``, or None when it passes."""
    from megatron_hydra.config.derive import derive

    try:
        derive(cfg)
    except ConfigError as e:
        return one_line(e)
    return None


def run_check(cfg: RunConfig, ranks: Optional[List[int]]) -> None:
    """``mode=plan``, then a dry run of ``ranks`` (rank 0 by default): both print their tables,
    and what the dry run changes is said first, one line each."""
    from megatron_hydra.launcher import run

    plan = copy.deepcopy(cfg)
    plan.mode = "plan"
    run(plan)
    from megatron_hydra.training.dry_run import stand_in_config

    dry, changed = stand_in_config(cfg, ranks or [0])
    for line in changed:
        print(f"note: {line}")
    run(dry)


def _get(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and math.isclose(a, b, rel_tol=1e-12, abs_tol=0.0)
    return a == b
