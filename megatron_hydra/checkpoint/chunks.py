"""A rank's part of a logical tensor as rectangular chunks: what the checkpoint writes and reads.

Each rank holds a logical tensor (named and shaped as in the unsharded model) as its *TP-local*
tensor: its shard along ``tp_partition_dim``, or all of it when replicated over TP. The
distributed optimizer and FSDP hold even less: a contiguous range ``[lo, hi)`` of that tensor
flattened row-major. Such a range of a ``[rows, cols]`` tensor is at most three rectangles (the
tail of its first row, the whole rows between, the head of its last row), and each is a
rectangle of the logical tensor once shifted by the shard's TP offset. Those rectangles are what
``torch.distributed.checkpoint`` stores, each with its offsets in the logical tensor; on load it
reads, for each rectangle a rank asks for, exactly the overlapping parts of whatever rectangles
were saved. So any layout loads any other's, with or without the distributed optimizer or FSDP,
and no rank ever gathers a whole tensor: the checkpoint describes each rank's flat ranges in its
metadata, as Megatron's fully sharded optimizer format does.

Vocabulary tables are padded to a multiple that depends on tp; their logical tensor has only the
real rows, and rectangles are clipped to them (padding rows are neither written nor read).

``Chunks`` speaks the protocol DCP's planners use for DTensor (``__create_write_items__``,
``__create_chunk_list__``, ``__get_tensor_shard__``); ``SavePlanner`` and ``LoadPlanner`` below
find a chunk's tensor through it, which DCP's own planners only do for ``torch.Tensor``
subclasses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType


@dataclass(frozen=True)
class Placement:
    """Where a TP-local tensor of shape ``local`` sits in its logical tensor of shape ``logical``:
    shifted by ``offset`` along ``dim`` (``None``: replicated over TP, no shift)."""

    logical: Tuple[int, ...]
    local: Tuple[int, ...]
    dim: Optional[int] = None
    offset: int = 0

    def shift(self, d: int) -> int:
        return self.offset if d == self.dim else 0


Rectangle = Tuple[Tuple[int, ...], Tuple[int, ...], int]  # logical offsets, sizes, flat start in the range


def rectangles(place: Placement, lo: int, hi: int) -> List[Rectangle]:
    """The rectangles of the logical tensor that elements ``[lo, hi)`` of the flattened TP-local
    tensor are, clipped to the logical tensor (a vocabulary table's padding rows), each with where
    its data starts counted from ``lo``."""
    local = place.local
    if hi <= lo:
        return []
    if len(local) == 0:
        return [((), (), 0)]
    row = math.prod(local[1:])
    r0, c0 = divmod(lo, row)
    r1, c1 = divmod(hi, row)
    if len(local) == 1:
        spans = [(r0, 0, r1 - r0, 1)]
    elif r0 == r1:
        spans = [(r0, c0, 1, c1 - c0)]
    else:
        spans = []
        if c0:
            spans.append((r0, c0, 1, row - c0))
            r0 += 1
        if r1 > r0:
            spans.append((r0, 0, r1 - r0, row))
        if c1:
            spans.append((r1, 0, 1, c1))
    if len(local) > 2 and any(cols != row for _, _, _, cols in spans):
        raise ValueError(f"a flat range of a {len(local)}-d tensor must cover whole rows, got [{lo}, {hi}) of {local}")
    out = []
    for r, c, rows, cols in spans:
        start = r * row + c - lo
        first = r + place.shift(0)
        rows = min(rows, place.logical[0] - first)  # vocabulary padding
        if rows <= 0:
            continue
        if len(local) == 1:
            out.append(((first,), (rows,), start))
        elif len(local) == 2:
            out.append(((first, c + place.shift(1)), (rows, cols), start))
        else:
            out.append(((first, *(0 for _ in local[1:])), (rows, *local[1:]), start))
    return out


class Chunks:
    """The rectangles of one logical tensor that this rank writes or reads, each a tensor viewing
    the rank's own storage (loading fills them in place)."""

    def __init__(self, logical: Sequence[int], parts: List[Tuple[Tuple[int, ...], torch.Tensor]]):
        self.logical = torch.Size(logical)
        self.parts = parts

    @classmethod
    def of(cls, place: Placement, flat: torch.Tensor, lo: int = 0) -> "Chunks":
        """The rectangles of ``flat``, elements ``[lo, lo + flat.numel())`` of the TP-local tensor
        ``place`` describes (``flat`` may be the TP-local tensor itself: ``lo=0``)."""
        flat = flat.reshape(-1) if flat.is_contiguous() else flat.contiguous().view(-1)
        parts = []
        for offsets, sizes, start in rectangles(place, lo, lo + flat.numel()):
            parts.append((offsets, flat[start:start + math.prod(sizes)].view(sizes)))
        return cls(place.logical, parts)

    def size(self) -> torch.Size:
        return self.logical

    def local_tensors(self) -> List[torch.Tensor]:
        return [t for _, t in self.parts]

    def map_local(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "Chunks":
        """The same rectangles over ``fn`` of each tensor (a host copy for an asynchronous save)."""
        return Chunks(self.logical, [(offsets, fn(t)) for offsets, t in self.parts])

    # DCP's protocol -------------------------------------------------------------------------
    def __create_write_items__(self, fqn: str, obj) -> List[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=t.size()),
                              properties=TensorProperties.create_from_tensor(t), size=self.logical))
                for offsets, t in self.parts]

    def __create_chunk_list__(self) -> List[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=t.size()) for offsets, t in self.parts]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for offsets, t in self.parts:
            if torch.Size(offsets) == index.offset:
                return t
        raise ValueError(f"no chunk of {index.fqn} at {list(index.offset or [])}")


def _lookup(state_dict: dict, index: MetadataIndex):
    obj = state_dict[index.fqn]
    return obj.__get_tensor_shard__(index) if isinstance(obj, Chunks) else None


class SavePlanner(dcp.DefaultSavePlanner):
    """DCP's default save planner, finding ``Chunks``' tensors."""

    def lookup_object(self, index: MetadataIndex):
        found = _lookup(self.state_dict, index)
        return super().lookup_object(index) if found is None else found


class LoadPlanner(dcp.DefaultLoadPlanner):
    """DCP's default load planner, finding ``Chunks``' tensors (and keeping them: its set-up
    replaces every value it does not know by ``None``)."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        chunks = {k: v for k, v in state_dict.items() if isinstance(v, Chunks)}
        super().set_up_planner(state_dict, metadata, is_coordinator)
        state_dict.update(chunks)
        self.state_dict.update(chunks)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        found = _lookup(self.state_dict, index)
        return super().lookup_tensor(index) if found is None else found
