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

The DCP ``.metadata`` of a ``torch_dist`` checkpoint is a plain pickle that DCP would unpickle
without restriction; it is read with ``safe_reader``'s allowlist plus the classes Megatron-Core's
planner adds (its saved plans and the descriptors of byte entries, which are never loaded).
"""

from __future__ import annotations

import argparse
import io
import os
import pathlib
import pickle
import re
import stat
import types
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta, TensorStorageMetadata

from megatron_hydra import untrusted
from megatron_hydra.checkpoint.safe_reader import ALLOWED_GLOBALS
from megatron_hydra.errors import CheckpointError

COMMON_BYTES = 256 * untrusted.MiB  # common.pt: args, counters, param groups; far below this
METADATA_BYTES = 1024 * untrusted.MiB  # .metadata lists every saved chunk and plan of every rank


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
    """``path`` is a regular file, not a link (a link could lead anywhere on this machine)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; the Megatron checkpoint is incomplete") from None
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{path}: not a regular file (a link, FIFO or directory, which no checkpoint "
                              "holds): refused")
    return st


def load(path: str, limit: int | None = None) -> Any:
    """The object pickled in the ``torch.save`` file ``path``, its tensors on the CPU. Without
    ``limit`` the tensors are memory-mapped (a legacy checkpoint's whole model share), not read;
    with it the file is read whole, refused above ``limit`` bytes."""
    regular(path)
    try:
        with _only(_safe_globals()):
            if limit is not None:
                data = untrusted.read_bytes(path, limit, "Megatron checkpoint file", CheckpointError)
                return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            try:
                return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as e:
                if "zip" not in str(e).lower():
                    raise
                return torch.load(path, map_location="cpu", weights_only=True)  # a pre-1.6 torch.save
    except CheckpointError:
        raise
    except Exception as e:  # any malformed or refused stream: one line, never a traceback
        raise _refusal(path, e) from None


# DCP metadata as Megatron-Core's torch_dist writes it --------------------------------------------
DCP_EXTRA = {
    "torch.distributed.checkpoint.metadata": frozenset({"BytesStorageMetadata"}),
    "torch.distributed.checkpoint.planner": frozenset({"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"}),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        allowed = ALLOWED_GLOBALS.get(module, frozenset()) | DCP_EXTRA.get(module, frozenset())
        if "." in name or name not in allowed:
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")
        return super().find_class(module, name)


def read_metadata(path: str) -> Metadata:
    """The DCP metadata of the ``torch_dist`` directory ``path``, checked to list tensors and byte
    entries only, each stored in a plain file of that directory."""
    file = os.path.join(path, ".metadata")
    regular(file)
    try:
        data = untrusted.read_bytes(file, METADATA_BYTES, "checkpoint metadata file", CheckpointError)
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"{file}: refused to load ({type(e).__name__}: {str(e)[:200]}): not a metadata file "
                              "Megatron-Core's torch_dist writes") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointError(f"{file}: holds a {type(metadata).__name__}, not DCP metadata: refused")
    for key, md in metadata.state_dict_metadata.items():
        if not isinstance(md, (TensorStorageMetadata, BytesStorageMetadata)):
            raise CheckpointError(f"{file}: entry {str(key)[:80]!r} is a {type(md).__name__}: refused")
    for info in (metadata.storage_data or {}).values():
        rel = str(getattr(info, "relative_path", ""))
        if not rel or rel in (".", "..") or os.path.basename(rel) != rel:
            raise CheckpointError(f"{file}: names the storage file {rel[:80]!r}, outside the checkpoint: refused")
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    return metadata
