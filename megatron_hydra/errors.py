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


def one_line(exc: BaseException) -> str:
    """The line to show for ``exc``. One of ours raised in a DataLoader worker process reaches the
    main process re-raised by torch with the worker's whole traceback as its message ("Caught
    DataError in DataLoader worker process 0. Original Traceback ..."); its last line holds ours."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    if isinstance(exc, MegatronHydraError) and len(lines) > 1 and lines[0].startswith("Caught "):
        return lines[-1].split(f"{type(exc).__name__}: ", 1)[-1]
    return lines[0] if not isinstance(exc, MegatronHydraError) else " ".join(lines)
