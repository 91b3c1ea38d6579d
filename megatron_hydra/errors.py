"""Errors meant for people: one line that names the key or file and says how to fix it.

``launch.py`` and the command-line tools print these without a traceback and exit with code 2.
"""


class MegatronHydraError(Exception):
    """Base of the user-facing errors."""


class ConfigError(MegatronHydraError):
    """A config value is invalid or inconsistent with another one."""


class DataError(MegatronHydraError):
    """A data file or data setting is unusable."""


class CheckpointError(MegatronHydraError):
    """A checkpoint is missing, incomplete or does not match the model."""
