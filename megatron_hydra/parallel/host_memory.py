"""Host memory reused from one step to the next for a step's largest tensors: the logits and the
gradient of the embedding table.

On a CPU every large tensor is fresh memory from the operating system: the C library maps
allocations of more than a few megabytes anew and unmaps them when they are freed, so each step
faults every page of them in again (a kernel trap and a page of zeros written per 4 KiB). For a
GPT-2-sized vocabulary at 512 tokens in fp32 that is 25,000 faults for the logits and 38,000 for
the table's gradient, together about 5% of a two-layer model's step. An accelerator's caching
allocator already keeps such blocks, so elsewhere this is plain ``torch.empty``.

On a CPU, ``reusable_empty`` hands out the storage of an earlier tensor once nothing else refers
to it (no tensor or view of it is alive: its storage's use count is the pool's own one). A tensor
still in use (the logits of a micro-batch whose backward has not run yet, logits a caller kept, a
gradient the optimizer has not stepped with) is never handed out twice; another storage is
allocated then. The pool keeps at most ``MAX_KEPT`` storages, evicting the smallest free one, so
changing shapes cannot grow it without bound. What it keeps between steps is memory the step held
at its peak anyway.

The contents of a reused storage are the last user's: callers overwrite every entry (the head
writes its matmul with ``beta=0``, which ignores what was there, NaN included; the lookup's
backward zero-fills its gradient first).
"""

from __future__ import annotations

import math
import threading
from typing import List, Sequence

import torch

MAX_KEPT = 4

_kept: List[torch.UntypedStorage] = []
_lock = threading.Lock()


def _only_the_pool_holds(storage: torch.UntypedStorage) -> bool:
    return torch._C._storage_Use_Count(storage._cdata) == 1


def reusable_empty(shape: Sequence[int], dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialised contiguous tensor of ``shape``, on a CPU in memory an earlier tensor freed."""
    device = torch.device(device)
    if device.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    with _lock:
        free = [s for s in _kept if _only_the_pool_holds(s)]
        fitting = [s for s in free if s.nbytes() >= nbytes]
        if fitting:
            storage = min(fitting, key=lambda s: s.nbytes())
        else:
            if len(_kept) >= MAX_KEPT and free:
                _kept.remove(min(free, key=lambda s: s.nbytes()))
            storage = torch.empty(nbytes, dtype=torch.uint8).untyped_storage()
            if len(_kept) < MAX_KEPT:
                _kept.append(storage)
        return torch.empty(0, dtype=dtype).set_(storage, 0, tuple(shape))  # contiguous strides


def release_all() -> None:
    """Drop every kept storage (memory measurements that must see each allocation)."""
    with _lock:
        _kept.clear()


def kept_bytes() -> int:
    """Bytes the pool holds, in use or free."""
    with _lock:
        return sum(s.nbytes() for s in _kept)
