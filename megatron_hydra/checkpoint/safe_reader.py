"""Reading torch.distributed.checkpoint's ``.metadata`` without running code from the file.

DCP loads tensor data with ``torch.load(weights_only=True)`` but unpickles its metadata file with
plain ``pickle``, which would execute whatever a crafted file asks for. Three holes are closed here:

- **Globals.** The unpickler resolves only the exact (module, name) pairs that DCP's metadata is
  made of. A module alone is never enough: since pickle protocol 4 a name may be dotted
  (``os.system`` looked up *through* an allowed module that imports ``os``), so dotted names and
  every name not listed are refused.
- **Byte entries.** DCP reads an entry that the metadata declares as bytes with
  ``torch.load(weights_only=False)``. megatron-hydra saves tensors only, so the class describing
  byte entries is not on the list, and the planner refuses byte reads as a second line.
- **Paths.** Each storage record names the file it lives in; a name that is not a plain file of
  the checkpoint directory (``../x``, ``/etc/x``) is refused.

The file itself is opened as a regular file only (``untrusted.open_regular``, no link followed):
a FIFO would block the reader forever.

Anything refused is a one-line ``CheckpointError`` naming the file.

Another writer's DCP metadata (Megatron-Core's ``torch_dist``) is read by the same code with the
few classes its planner adds (``extra_globals``) and the entry kinds it holds (``entries``); the
checks above stay as they are.
"""

from __future__ import annotations

import os
import pickle

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from typing import Mapping, Optional, Tuple

from megatron_hydra import untrusted
from megatron_hydra.checkpoint.chunks import LoadPlanner
from megatron_hydra.errors import CheckpointError

_DTYPES = frozenset(n for n in dir(torch) if isinstance(getattr(torch, n, None), torch.dtype))

ALLOWED_GLOBALS = {
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "TensorStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    }),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),  # maps a layout's name to torch.strided etc.
    "torch": frozenset({"Size"}) | _DTYPES,
    "pathlib": frozenset({"Path", "PosixPath", "PurePosixPath", "PureWindowsPath", "WindowsPath"}),
    "collections": frozenset({"OrderedDict"}),
}


class _RestrictedUnpickler(pickle.Unpickler):
    """Resolves only the exact (module, name) pairs of ``allowed`` (module -> names)."""

    def __init__(self, file, allowed: Mapping[str, frozenset]):
        super().__init__(file)
        self.allowed = allowed

    def find_class(self, module: str, name: str):
        if "." in name or name not in self.allowed.get(module, ()):
            raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")
        return super().find_class(module, name)


def _allowed(extra: Optional[Mapping[str, frozenset]]) -> Mapping[str, frozenset]:
    if not extra:
        return ALLOWED_GLOBALS
    return {m: ALLOWED_GLOBALS.get(m, frozenset()) | frozenset(extra.get(m, ())) for m in {*ALLOWED_GLOBALS, *extra}}


def _refuse(file: str, why: str, writer: str = "megatron-hydra") -> CheckpointError:
    return CheckpointError(
        f"{file}: refused to load ({why}): not a metadata file written by {writer}; "
        f"use a checkpoint saved by {writer}"
    )


def _check(file: str, metadata, entries: Tuple[type, ...], writer: str) -> None:
    """The unpickled object has the shape of the writer's metadata: entries of the kinds
    ``entries`` only (ours: tensors), files in the directory."""
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise _refuse(file, f"top-level object is {type(metadata).__name__}, not Metadata", writer)
    for key, md in metadata.state_dict_metadata.items():
        if not isinstance(md, entries):
            wanted = " or ".join(kind.__name__ for kind in entries)
            raise _refuse(file, f"entry {str(key)[:80]!r} is {type(md).__name__}, not {wanted}", writer)
    for info in (metadata.storage_data or {}).values():
        rel = str(getattr(info, "relative_path", ""))
        if not rel or rel in (".", "..") or os.path.basename(rel) != rel or os.path.isabs(rel):
            raise _refuse(file, f"storage file {rel[:80]!r} is outside the checkpoint directory", writer)


def read_metadata(path: str, extra_globals: Optional[Mapping[str, frozenset]] = None,
                  entries: Tuple[type, ...] = (TensorStorageMetadata,), writer: str = "megatron-hydra",
                  limit: Optional[int] = None):
    """DCP's metadata of the checkpoint directory ``path``, unpickled with the allowlist (plus
    ``extra_globals``: module -> names), its entries of the kinds ``entries`` only; ``writer``
    names the tool whose checkpoints it reads, in errors; ``limit``: the most bytes the file may
    hold (the unpickled objects grow with it)."""
    file = os.path.join(path, ".metadata")
    if not os.path.lexists(file):
        raise CheckpointError(f"{file}: missing; {path} is not a complete checkpoint directory")
    fd = untrusted.open_regular(file, "checkpoint metadata file", CheckpointError, follow_links=False)
    if limit is not None and os.fstat(fd).st_size > limit:
        os.close(fd)
        raise _refuse(file, f"larger than {limit:,} bytes", writer)
    try:
        with os.fdopen(fd, "rb") as f:
            metadata = _RestrictedUnpickler(f, _allowed(extra_globals)).load()
    except Exception as e:  # any malformed pickle stream: one line, never a traceback
        raise _refuse(file, f"{type(e).__name__}: {e}", writer) from None
    _check(file, metadata, entries, writer)
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    return metadata


class TensorOnlyPlanner(LoadPlanner):
    """Our load planner (``chunks.LoadPlanner``), except that it never unpickles a byte entry."""

    def load_bytes(self, read_item, value) -> None:
        raise CheckpointError(
            f"checkpoint entry {read_item.dest_index.fqn!r} is stored as pickled bytes; megatron-hydra "
            "checkpoints hold tensors only, so it is refused"
        )


class SafeReader(dcp.FileSystemReader):
    """``FileSystemReader`` whose metadata is read with ``read_metadata`` above."""

    def read_metadata(self, *args, **kwargs):
        metadata = read_metadata(str(self.path))
        metadata.storage_meta.load_id = self.load_id
        return metadata


def safe_load(state_dict: dict, path: str) -> None:
    """``dcp.load`` of ``state_dict`` from ``path`` through the checks above.

    The metadata is checked here first, so that a refusal is our one line rather than DCP's
    wrapped multi-rank report; a failure while reading the data is reduced to its first line too.
    """
    read_metadata(path)
    try:
        dcp.load(state_dict, storage_reader=SafeReader(path), planner=TensorOnlyPlanner())
    except CheckpointException as e:
        first = dcp_failure(e)
        if isinstance(first, CheckpointError):
            raise first from None
        detail = (str(first).strip().splitlines() or [""])[0]
        raise CheckpointError(
            f"{path}: reading the checkpoint failed ({type(first).__name__}: {detail}); "
            "the checkpoint is damaged or incomplete: load an earlier one"
        ) from None


def dcp_failure(e: CheckpointException) -> BaseException:
    """The first failed rank's own exception inside DCP's ``CheckpointException``, whose message
    is only ``CheckpointException ranks:dict_keys([0])`` and a traceback per rank."""
    first = next(iter(e.failures.values()), e)
    if isinstance(first, tuple):  # DCP keeps (exception, its stack summary) per failed rank
        first = first[0]
    return first if isinstance(first, BaseException) else e
