"""The bundled ``conf/`` as a Hydra config source, for tools that compose outside ``launch.py``.

``conf/`` is also the package ``megatron_hydra.conf``: in a checkout ``megatron_hydra/conf`` links
to the top-level directory, and a wheel carries its files as package data (pyproject.toml). So
Hydra finds it as ``pkg://megatron_hydra.conf`` in an editable install, a non-editable one, or a
plain checkout alike, never by where this file sits. ``launch.py`` keeps ``config_path="conf"``.
"""

from __future__ import annotations

from contextlib import contextmanager
from importlib import resources
from typing import Iterator, List, Sequence

from hydra import compose as hydra_compose
from hydra import initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from megatron_hydra.config.machine import resolve
from megatron_hydra.config.schema import RunConfig, register_configs

CONF_MODULE = "megatron_hydra.conf"


@contextmanager
def _initialized() -> Iterator[None]:
    register_configs()
    with initialize_config_module(config_module=CONF_MODULE, version_base=None):
        yield


def compose(overrides: Sequence[str] = (), visible_gpus: int = 0) -> RunConfig:
    """The typed config ``launch.py`` would run for ``overrides`` on a machine with ``visible_gpus``
    GPUs (a CPU machine by default; ``auto`` values resolved, ``run_dir`` left unused)."""
    with _initialized():
        cfg = hydra_compose(config_name="config", overrides=["run_dir=unused", *overrides])
    return resolve(OmegaConf.to_object(cfg), visible_gpus)


def group_options(group: str) -> List[str]:
    """The options of a config group (``parallel`` -> ``pp2``, ``single``, ``tp2``, ...)."""
    with _initialized():
        return sorted(GlobalHydra.instance().config_loader().get_group_options(group))


def has_option(group: str, option: str) -> bool:
    """Whether ``conf/<group>/<option>.yaml`` is bundled; reads the package data without Hydra,
    so it also answers inside a running Hydra app (``mode=plan_layouts``)."""
    return resources.files(CONF_MODULE).joinpath(group).joinpath(f"{option}.yaml").is_file()
