"""Reading torch.distributed.checkpoint's ``.metadata`` without running code from the file.

DCP loads tensor data with ``torch.load(weights_only=True)`` but unpickles its metadata file with
plain ``pickle``, which would execute whatever a crafted file asks for. ``SafeReader`` unpickles
it with an allowlist of the classes DCP's metadata is made of (its metadata dataclasses, torch
sizes and dtypes, paths) and refuses anything else with a one-line ``CheckpointError``.
"""

from __future__ import annotations

import os
import pickle

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import StorageMeta

from megatron_hydra.errors import CheckpointError

_ALLOWED = {
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        allowed = (
            module == "torch.distributed.checkpoint.metadata"
            or name in _ALLOWED.get(module, ())
            or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        )
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name}")
        return super().find_class(module, name)


def read_metadata(path: str):
    """DCP's metadata of the checkpoint directory ``path``, unpickled with the allowlist."""
    file = os.path.join(path, ".metadata")
    try:
        with open(file, "rb") as f:
            metadata = _RestrictedUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError) as e:
        raise CheckpointError(
            f"{file}: refused to load ({e}): not a metadata file written by torch.distributed.checkpoint; "
            "use a checkpoint saved by megatron-hydra"
        ) from None
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    return metadata


class SafeReader(dcp.FileSystemReader):
    """``FileSystemReader`` whose metadata is read with ``read_metadata`` above."""

    def read_metadata(self, *args, **kwargs):
        metadata = read_metadata(str(self.path))
        metadata.storage_meta.load_id = self.load_id
        return metadata
