"""Put the test doubles of GPU-only packages (tests/doubles/: transformer_engine, apex) on
sys.path for the duration of a test, and take them away again, imported modules included."""

from __future__ import annotations

import importlib
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

DOUBLES = str(Path(__file__).resolve().parent / "doubles")
PACKAGES = ("transformer_engine", "apex")


def _forget() -> None:
    for name in [m for m in sys.modules if m.split(".")[0] in PACKAGES]:
        del sys.modules[name]
    importlib.invalidate_caches()


@contextmanager
def installed() -> Iterator[None]:
    _forget()
    sys.path.insert(0, DOUBLES)
    try:
        yield
    finally:
        sys.path.remove(DOUBLES)
        _forget()


def install() -> None:
    """For a spawned rank, which exits when its test function returns."""
    sys.path.insert(0, DOUBLES)
    importlib.invalidate_caches()
