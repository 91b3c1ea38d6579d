"""The raw collectives every parallel layer uses, along any tensor dimension, with accounting.

All communication of model code funnels through these few functions, so that a benchmark (or a
test) can count the exact bytes each group moves by installing a ``CommCounter``, or record when
each collective was issued and waited for (``record_comm``: the order tests and the overlap
benchmark read). A group of size one (or no group at all) makes every function the identity,
without touching torch.distributed.
"""

from __future__ import annotations

import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist


class CommCounter:
    """Bytes each kind of collective contributed from this rank (its input tensor's size)."""

    def __init__(self) -> None:
        self.bytes: Counter = Counter()
        self.calls: Counter = Counter()

    def add(self, kind: str, tensor: torch.Tensor) -> None:
        self.bytes[kind] += tensor.numel() * tensor.element_size()
        self.calls[kind] += 1


_counter: Optional[CommCounter] = None


@dataclass
class CommEvent:
    """One collective as this rank saw it: when it was issued and when waiting for it began and
    ended (``time.perf_counter``, the host's monotonic clock, shared by the ranks of one machine);
    ``order``: its place among everything the recorder saw (collectives and ``mark``s)."""

    kind: str
    nbytes: int
    issued: float
    order: int
    wait_start: Optional[float] = None
    wait_end: Optional[float] = None


class CommRecorder:
    """The collectives issued while it is installed (``record_comm``), in issue order, and the
    points in between that the caller ``mark``s (e.g. a layer's backward finishing), so that a test
    can check what was issued before what, and a benchmark how long each wait was exposed."""

    def __init__(self) -> None:
        self.events: List[CommEvent] = []
        self.marks: List[Tuple[str, int, float]] = []  # (label, order, time)
        self._order = 0

    def _next(self) -> int:
        self._order += 1
        return self._order

    def issue(self, kind: str, nbytes: int) -> CommEvent:
        event = CommEvent(kind, nbytes, time.perf_counter(), self._next())
        self.events.append(event)
        return event

    def mark(self, label: str) -> None:
        self.marks.append((label, self._next(), time.perf_counter()))


class _RecordedWork:
    """A work handle whose ``wait`` is timed into its ``CommEvent``."""

    def __init__(self, work, event: CommEvent):
        self.work, self.event = work, event

    def wait(self, *args, **kwargs):
        self.event.wait_start = time.perf_counter()
        try:
            return self.work.wait(*args, **kwargs)
        finally:
            self.event.wait_end = time.perf_counter()

    def __getattr__(self, name):
        return getattr(self.work, name)


_recorder: Optional[CommRecorder] = None


@contextmanager
def record_comm() -> Iterator[CommRecorder]:
    """Record every collective issued through this module until the block ends."""
    global _recorder
    previous, _recorder = _recorder, CommRecorder()
    try:
        yield _recorder
    finally:
        _recorder = previous


def mark(label: str) -> None:
    """A point in the recorded order (nothing when no recorder is installed)."""
    if _recorder is not None:
        _recorder.mark(label)


def _account(kind: str, tensor: torch.Tensor) -> Optional[CommEvent]:
    """Count the collective's bytes and record its issue, where a counter or recorder is installed."""
    if _counter is not None:
        _counter.add(kind, tensor)
    return _recorder.issue(kind, tensor.numel() * tensor.element_size()) if _recorder is not None else None


def _recorded(work, event: Optional[CommEvent]):
    return work if event is None else _RecordedWork(work, event)


def _waited(event: Optional[CommEvent]) -> None:
    """A blocking collective: its wait is the call itself, which has just returned."""
    if event is not None:
        event.wait_start, event.wait_end = event.issued, time.perf_counter()

# torch 2.13 renamed the tensor-in/tensor-out collectives (the old names warn); older torch has
# only the old names.
_all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@contextmanager
def count_comm() -> Iterator[CommCounter]:
    global _counter
    previous, _counter = _counter, CommCounter()
    try:
        yield _counter
    finally:
        _counter = previous


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def reduce_scatter_into(out: torch.Tensor, tensor: torch.Tensor, group, kind: str = "reduce_scatter"):
    """Sum ``tensor`` over the group into ``out`` (this rank's 1/size of it; may alias its slice of
    ``tensor``), asynchronously: returns the work handle to wait on."""
    event = _account(kind, tensor)
    return _recorded(_reduce_scatter_into(out, tensor, group=group, async_op=True), event)


def all_gather_into(out: torch.Tensor, tensor: torch.Tensor, group, kind: str = "all_gather"):
    """Concatenate every rank's ``tensor`` into ``out`` (``tensor`` may alias this rank's slice of
    it), asynchronously: returns the work handle to wait on."""
    event = _account(kind, out)
    return _recorded(_all_gather_into(out, tensor, group=group, async_op=True), event)


def all_reduce_async(tensor: torch.Tensor, group, kind: str = "all_reduce"):
    """Sum over the group in place, asynchronously: returns the work handle to wait on."""
    event = _account(kind, tensor)
    return _recorded(dist.all_reduce(tensor, group=group, async_op=True), event)


def all_reduce(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """Reduce (sum by default) over the group, in place."""
    if group_size(group) == 1:
        return tensor
    event = _account("all_reduce", tensor)
    dist.all_reduce(tensor, op=op, group=group)
    _waited(event)
    return tensor


def all_gather(tensor: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along ``dim``, in rank order."""
    world = group_size(group)
    if world == 1:
        return tensor
    event = _account("all_gather", tensor)
    moved = tensor.movedim(dim, 0).contiguous()
    out = torch.empty((world * moved.shape[0],) + moved.shape[1:], dtype=tensor.dtype, device=tensor.device)
    _all_gather_into(out, moved, group=group)
    _waited(event)
    return out.movedim(0, dim)


def reduce_scatter(tensor: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum over the group, then keep this rank's chunk along ``dim``."""
    world = group_size(group)
    if world == 1:
        return tensor
    event = _account("reduce_scatter", tensor)
    moved = tensor.movedim(dim, 0).contiguous()
    out = torch.empty((moved.shape[0] // world,) + moved.shape[1:], dtype=tensor.dtype, device=tensor.device)
    _reduce_scatter_into(out, moved, group=group)
    _waited(event)
    return out.movedim(0, dim)


def split(tensor: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's chunk along ``dim`` (no communication)."""
    world = group_size(group)
    if world == 1:
        return tensor
    return tensor.chunk(world, dim=dim)[group_rank(group)].contiguous()


def ring_exchange(sends, recvs, group, kind: str = "cp_p2p") -> list:
    """Send each tensor of ``sends`` to the next rank of the group's ring and receive ``recvs``
    (in the same order) from the previous one, asynchronously: returns the works to wait on.
    One batched call, so that the sends and receives of a step are issued together."""
    world, rank = group_size(group), group_rank(group)
    following = dist.get_global_rank(group, (rank + 1) % world)
    preceding = dist.get_global_rank(group, (rank - 1) % world)
    ops = [dist.P2POp(dist.isend, t, following, group) for t in sends]
    ops += [dist.P2POp(dist.irecv, t, preceding, group) for t in recvs]
    if _counter is not None:
        for t in sends:
            _counter.add(kind, t)
    event = None
    if _recorder is not None and sends:  # one event for the batch: its works complete together
        event = _recorder.issue(kind, sum(t.numel() * t.element_size() for t in sends))
    works = dist.batch_isend_irecv(ops) if ops else []
    return [_recorded(w, event) if i == 0 else w for i, w in enumerate(works)]


def all_to_all(tensor: torch.Tensor, group, kind: str = "cp_a2a") -> torch.Tensor:
    """Chunk ``j`` of ``tensor`` along dim 0 goes to rank ``j``; chunk ``j`` of the result came
    from rank ``j``."""
    if group_size(group) == 1:
        return tensor
    event = _account(kind, tensor)
    tensor = tensor.contiguous()
    out = torch.empty_like(tensor)
    dist.all_to_all_single(out, tensor, group=group)
    _waited(event)
    return out


def all_to_all_uneven(tensor: torch.Tensor, output_splits, input_splits, group, kind: str = "ep_a2a") -> torch.Tensor:
    """``input_splits[j]`` rows of ``tensor`` (dim 0, in rank order) go to rank ``j``; the result
    holds ``output_splits[j]`` rows from rank ``j``, in rank order. Both lists are host ints: the
    receivers learn theirs from an exchange of counts first (``all_to_all`` of a small tensor)."""
    if group_size(group) == 1:
        return tensor
    event = _account(kind, tensor)
    tensor = tensor.contiguous()
    out = tensor.new_empty((sum(output_splits),) + tuple(tensor.shape[1:]))
    dist.all_to_all_single(out, tensor, list(output_splits), list(input_splits), group=group)
    _waited(event)
    return out
