"""Megatron-LM's pickles, read as data: a crafted file runs nothing.

A legacy checkpoint (``model_optim_rng.pt``) and a ``torch_dist`` checkpoint's ``common.pt`` are
``torch.save`` pickles holding, beside tensors, Megatron-LM's ``argparse.Namespace`` of arguments
(with Megatron-Core enums among its values) and numpy random states. They are read with
``torch.load(weights_only=True)``, whose unpickler builds only tensors, plain containers and the
exact globals listed here; any other global (``os.system``, ``builtins.eval``, a class of
Megatron we do not know) is refused before anything is called.

Nothing of Megatron or numpy is imported to read them, and no object of theirs is built: each
listed global of theirs resolves to a stand-in of ours. An enum member becomes a ``MegatronEnum``
(its class's name and value), a numpy array or dtype an ``Opaque`` that discards its state
(they appear only in random states, which a converted checkpoint does not carry: a run draws its
own), a Megatron dataclass a ``Record`` of its fields. ``argparse.Namespace``,
``types.SimpleNamespace`` and ``pathlib.PosixPath`` are built as themselves: they only hold
values. The list is Megatron-Core's own (``megatron.core.safe_globals``), each entry checked here;
it is the whole allowlist while a file is read, whatever else the process registered.

A file is opened once, without following a link, and checked to be a regular file on the open
descriptor; everything read comes through that descriptor, so the file cannot be swapped for a
link between the check and the read. Its tensors are memory-mapped through the descriptor's own
path (not the name, which may have changed), or, for ``common.pt``, the file is read whole up to
a bound.
"""

from __future__ import annotations

import argparse
import io
import os
import pathlib
import re
import stat
import types
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional

import torch

from megatron_hydra import untrusted
from megatron_hydra.errors import CheckpointError

COMMON_BYTES = 256 * untrusted.MiB  # common.pt: args, counters, param groups; far below this
# A torch.save file older than torch 1.6 is no zip archive and cannot be memory-mapped: it is read
# whole, so its size is bounded (Megatron-LM's files of that time held a model share each).
UNZIPPED_BYTES = 4096 * untrusted.MiB
ZIP_MAGIC = b"PK\x03\x04"


@dataclass(frozen=True)
class MegatronEnum:
    """A Megatron enum member as read from a pickle: its class's path and its value."""

    cls: str
    value: Any


class _EnumClass:
    """Stands for one Megatron enum class: ``cls(value)`` is how a pickle rebuilds a member."""

    def __init__(self, path: str):
        self.path = path

    def __call__(self, value: Any) -> MegatronEnum:
        return MegatronEnum(self.path, value)


class Opaque:
    """A numpy array or dtype, or a layer's opaque extra state (``io.BytesIO``), left unbuilt:
    takes any arguments and state, keeps none."""

    def __init__(self, *args: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass


def _reconstruct(*args: Any) -> Opaque:
    return Opaque()


class Record:
    """A dataclass of Megatron's (its ``OptimizerConfig``) as read from a pickle: its fields only."""

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.__dict__.update(state)


# Enums that Megatron-LM's arguments and state dicts hold (as of core 0.16; the signal its
# arguments name for a clean exit).
MEGATRON_ENUMS = (
    "signal.Signals", "megatron.core.enums.ModelType", "megatron.core.enums.Fp8Recipe",
    "megatron.core.enums.Fp4Recipe",
    *(f"megatron.core.transformer.enums.{n}" for n in (
        "ModelType", "LayerType", "AttnType", "AttnMaskType", "AttnBackend", "CudaGraphScope", "CudaGraphModule",
        "InferenceCudaGraphScope")),
    *(f"megatron.core.rerun_state_machine.{n}" for n in (
        "RerunMode", "RerunState", "RerunDiagnostic", "RerunValidationStatus")),
)
STAND_INS = {
    "numpy.core.multiarray._reconstruct": _reconstruct, "numpy._core.multiarray._reconstruct": _reconstruct,
    "numpy.ndarray": Opaque, "numpy.dtype": Opaque, "numpy.dtypes.UInt32DType": Opaque, "_io.BytesIO": Opaque,
    "megatron.core.optimizer.optimizer_config.OptimizerConfig": Record,
}


def _safe_globals() -> list:
    """What ``torch.load(weights_only=True)`` may resolve beyond tensors: (object, its pickled name)."""
    return [argparse.Namespace, types.SimpleNamespace, pathlib.PosixPath,
            *((_EnumClass(path), path) for path in MEGATRON_ENUMS), *((obj, path) for path, obj in STAND_INS.items())]


@contextmanager
def _only(allowed: list):
    """``allowed`` as the whole allowlist of ``torch.load``: any globals registered process-wide
    (Megatron-Core registers its own when imported) are set aside meanwhile."""
    saved = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals(allowed)
    try:
        yield
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(saved)


def _refusal(path: str, error: Exception) -> CheckpointError:
    """One line for a pickle ``torch.load`` refused or could not read."""
    text = str(error)
    found = re.search(r"GLOBAL (\S+)", text) or re.search(r"unrecognized function (.+?)(?: which|$)", text, re.M)
    if found:
        return CheckpointError(f"{path}: refused to load: it names {found.group(1)}, which is not among the classes "
                               "a Megatron-LM checkpoint holds (a crafted or unknown file); nothing in it was run")
    first = (text.strip().splitlines() or [type(error).__name__])[0]
    return CheckpointError(f"{path}: not a readable Megatron checkpoint file ({first[:200]}): it is damaged or "
                           "was not written by Megatron-LM")


def regular(path: str) -> os.stat_result:
    """``path`` is a regular file, not a link (a link could lead anywhere on this machine): the
    one-line check before a file is handed to a reader (``open_checked`` makes it again on the
    descriptor that is read)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; the Megatron checkpoint is incomplete") from None
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{path}: not a regular file (a link, FIFO or directory, which no checkpoint "
                              "holds): refused")
    return st


def open_checked(path: str) -> int:
    """A read-only descriptor of the regular file ``path``, opened without following a link and
    checked on the descriptor (``untrusted.open_regular``)."""
    regular(path)
    return untrusted.open_regular(path, "Megatron checkpoint file", CheckpointError, follow_links=False)


def _read(f, path: str, limit: int) -> bytes:
    data = f.read(limit + 1)
    if len(data) > limit:
        raise CheckpointError(f"{path}: larger than {limit:,} bytes, more than such a Megatron checkpoint file holds: "
                              "refused as damaged or crafted")
    return data


def _fd_path(fd: int) -> str:
    """A path naming the open descriptor ``fd`` itself, not whatever ``path`` names now."""
    return f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else f"/dev/fd/{fd}"


def load(path: str, limit: Optional[int] = None) -> Any:
    """The object pickled in the ``torch.save`` file ``path``, its tensors on the CPU. Without
    ``limit`` the tensors are memory-mapped (a legacy checkpoint's whole model share), not read;
    with it the file is read whole, refused above ``limit`` bytes."""
    fd = open_checked(path)
    try:
        with os.fdopen(fd, "rb") as f, _only(_safe_globals()):
            if limit is not None:
                return torch.load(io.BytesIO(_read(f, path, limit)), map_location="cpu", weights_only=True)
            if f.read(len(ZIP_MAGIC)) == ZIP_MAGIC:
                return torch.load(_fd_path(fd), map_location="cpu", weights_only=True, mmap=True)
            f.seek(0)  # a pre-1.6 torch.save: no zip, so no mapping
            return torch.load(io.BytesIO(_read(f, path, UNZIPPED_BYTES)), map_location="cpu", weights_only=True)
    except CheckpointError:
        raise
    except Exception as e:  # any malformed or refused stream: one line, never a traceback
        raise _refusal(path, e) from None
