"""A checkpoint written one logical tensor at a time, each made only when the writer reaches it.

An import from another format produces every tensor of a model; holding them all before the
save would need the whole model in memory, which a model larger than the machine's memory does
not allow. Here each logical tensor is a ``LazyTensor``: its shape and dtype (all the save plan and
the metadata need) and a function that makes it. ``torch.distributed.checkpoint`` resolves write
items one by one as it writes them (``FileSystemWriter`` with one thread), so a tensor is made
when its turn comes and dropped once written. DCP keeps every tensor it wrote into one file until
that file is closed, so each tensor goes into a file of its own: memory stays at one tensor.

The result is the format ``sharded.load`` reads at any layout: whole logical tensors under
``model/<name>`` (one chunk at offset zero), in the dtype they were made in, which loading casts
into the run's own; optionally optimizer entries beside them, made the same way (Adam's moments
``optim/<name>/exp_avg`` and ``exp_avg_sq``, its ``optim/<name>/step``, the fp32 ``main/<name>``
weights of a 16-bit model), which a run then resumes with; ``meta.json`` with the checksums; the
marker last.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Mapping, Optional, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from megatron_hydra.checkpoint import store
from megatron_hydra.checkpoint.safe_reader import dcp_failure
from megatron_hydra.errors import CheckpointError


@dataclass(frozen=True)
class LazyTensor:
    """A tensor of ``shape`` and ``dtype`` that ``make()`` produces when it is written."""

    shape: Tuple[int, ...]
    dtype: torch.dtype
    make: Callable[[], torch.Tensor]

    def __create_write_items__(self, fqn: str, obj) -> list:
        size = torch.Size(self.shape)
        offsets = torch.Size([0] * len(size))
        properties = TensorProperties.create_from_tensor(torch.empty(0, dtype=self.dtype))
        return [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=size),
                                                      properties=properties, size=size))]


class _Planner(dcp.DefaultSavePlanner):
    """DCP's default planner, making a ``LazyTensor`` when its write item's turn comes and
    checking it: the promised shape and dtype, finite values (a checkpoint never holds NaN or inf,
    as ``sharded.write`` refuses them)."""

    def lookup_object(self, index: MetadataIndex):
        lazy = self.state_dict[index.fqn]
        t = lazy.make()
        if tuple(t.shape) != tuple(lazy.shape) or t.dtype != lazy.dtype:
            raise CheckpointError(f"{index.fqn}: made as {list(t.shape)} {t.dtype}, promised as {list(lazy.shape)} "
                                  f"{lazy.dtype}: its source changed while it was read; convert it again")
        if not _finite(t):
            raise CheckpointError(f"{index.fqn} holds NaN or inf: refused, nothing was written (the source weights "
                                  "are damaged)")
        return t.detach().contiguous()


# aminmax is one fast pass that allocates nothing; isfinite of a 16-bit tensor computes in fp32.
_MINMAX_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _finite(t: torch.Tensor, chunk: int = 1 << 24) -> bool:
    """No NaN or inf in ``t``: both ends finite (NaN propagates through min and max), or, for
    dtypes aminmax does not take (fp8), isfinite a slice at a time."""
    if not t.is_floating_point() or t.numel() == 0:
        return True
    if t.dtype in _MINMAX_DTYPES:
        lo, hi = torch.aminmax(t)
        return bool(torch.isfinite(lo) & torch.isfinite(hi))
    return all(bool(torch.isfinite(part.float()).all()) for part in t.reshape(-1).split(chunk))


def write(path: str, tensors: Mapping[str, LazyTensor], meta: dict,
          optimizer: Optional[Mapping[str, LazyTensor]] = None) -> None:
    """Write ``tensors`` (by logical name, in this order) as a checkpoint into the existing
    directory ``path``, with ``meta`` as its ``meta.json`` (checksums of every file in ``path``
    added, files put there before included), then the marker. ``optimizer``: optimizer entries
    under their checkpoint keys (``optim/<name>/exp_avg``, ``main/<name>``, ...; none: a
    weights-only checkpoint). A failure is the one line of whatever went wrong (a tensor's own
    ``CheckpointError``, the system's reason for an ``OSError``), never DCP's wrapper."""
    state: Dict[str, LazyTensor] = {f"model/{name}": t for name, t in tensors.items()}
    state.update(optimizer or {})
    writer = dcp.FileSystemWriter(path, single_file_per_rank=False, thread_count=1)
    try:
        dcp.save(state, storage_writer=writer, planner=_Planner(), no_dist=True)
    except CheckpointException as e:
        raise dcp_failure(e) from None
    store.seal(path, {**meta, "has_optimizer": any(k.startswith("optim/") for k in optimizer or {})})
