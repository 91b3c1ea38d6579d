"""Checks of what a run records besides its checkpoints: its loggers and its profiled steps.

Pure functions of the config, called by ``derive`` (``check_observability``), except
``check_logger_packages``, which looks for the optional packages a logger needs and runs in the
launcher's preflight: either way a bad value is one line before any worker starts.
"""

from __future__ import annotations

from importlib.util import find_spec

from megatron_hydra.config.schema import RunConfig
from megatron_hydra.errors import ConfigError

LOGGERS = ("tensorboard", "csv", "wandb")
WANDB_MODES = ("online", "offline", "disabled")
# The pip package and the extra of this project that installs it, per logger that needs one.
LOGGER_PACKAGES = {"wandb": ("wandb", "wandb")}


def check_observability(cfg: RunConfig) -> None:
    """``trainer.logger`` names known loggers, each once; ``trainer.profile_steps`` is
    ``[first, last]`` with ``0 <= first <= last < trainer.max_steps`` (0-based steps, both profiled)."""
    loggers = list(cfg.trainer.logger)
    for name in loggers:
        if name not in LOGGERS:
            raise ConfigError(f"trainer.logger: {name!r} is not a logger: use a list of {', '.join(LOGGERS)} "
                              "(e.g. trainer.logger=[tensorboard,csv,wandb])")
    if len(set(loggers)) != len(loggers):
        raise ConfigError(f"trainer.logger={loggers} names a logger twice: list each once")
    mode = cfg.trainer.wandb.mode
    if mode is not None and mode not in WANDB_MODES:
        raise ConfigError(f"trainer.wandb.mode={mode!r} is not a W&B mode: use one of {', '.join(WANDB_MODES)}, "
                          "or null (the WANDB_MODE environment variable decides)")
    steps = cfg.trainer.profile_steps
    if steps is None:
        return
    steps = list(steps)
    max_steps = cfg.trainer.max_steps
    if len(steps) != 2 or not all(isinstance(s, int) and not isinstance(s, bool) for s in steps):
        raise ConfigError(f"trainer.profile_steps={steps} must be two step numbers [first, last] "
                          "(e.g. trainer.profile_steps=[10,12]), or null")
    first, last = steps
    if not 0 <= first <= last < max_steps:
        raise ConfigError(f"trainer.profile_steps={steps} needs 0 <= first <= last < trainer.max_steps={max_steps} "
                          "(steps count from 0, both ends are profiled): change the steps or trainer.max_steps")


def check_logger_packages(cfg: RunConfig) -> None:
    """The optional package of each chosen logger is installed (found without importing it)."""
    for name in cfg.trainer.logger:
        if name in LOGGER_PACKAGES and find_spec(LOGGER_PACKAGES[name][0]) is None:
            package, extra = LOGGER_PACKAGES[name]
            raise ConfigError(f"trainer.logger includes {name}, but the {package} package is not installed: "
                              f"pip install '.[{extra}]' (or pip install {package}), or drop it from trainer.logger")
