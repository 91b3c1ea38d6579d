"""Host memory reused from one step to the next for a step's largest tensors: the logits and the
gradients of the output layer's weight and of the embedding table.

On a CPU every large tensor is fresh memory from the operating system: the C library maps
allocations of more than a few megabytes anew and unmaps them when they are freed, so each step
faults every page of them in again (a kernel trap and a page of zeros written per 4 KiB). For a
GPT-2-sized vocabulary at 512 tokens in fp32 that is 25,000 faults for the logits and 38,000 for
each [vocab, hidden] gradient, together about 8% of a two-layer model's CPU time. An accelerator's
caching allocator already keeps such blocks, so elsewhere this is plain ``torch.empty``.

On a CPU the pool keeps storages and lends one out once nothing but the pool refers to it (its use
count is the pool's own one). It lends it as a tensor with a storage of its own over the same bytes
(a DLPack exchange), which holds the kept storage for as long as it lives. To autograd that tensor
is fresh memory nothing else refers to, so where two gradients of one tensor meet (a tied
embedding's lookup and head) it adds one into the other in place instead of allocating their sum
(as it would if the tensor were over the kept storage itself, which the pool's reference makes a
storage with two users). A tensor still in use (the logits of a micro-batch whose backward has not
run yet, logits a caller kept, a gradient the optimizer has not stepped with) is never handed out
twice; other memory is used then. The pool keeps at most ``MAX_KEPT`` storages, evicting the
smallest free one, so changing shapes cannot grow it without bound. Between steps it keeps the
memory of all three tensors, one more such tensor than a step holds at once (docs/memory.md).

The contents of a reused storage are the last user's: callers overwrite every entry (the head's
matmuls write their whole output, ignoring what was there, NaN included; the lookup's backward
zero-fills its gradient first).
"""

from __future__ import annotations

import math
import threading
from typing import List, Sequence

import torch
from torch.utils.dlpack import from_dlpack, to_dlpack

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
            if len(_kept) >= MAX_KEPT:  # every kept storage is in use
                return torch.empty(shape, dtype=dtype)
            storage = torch.empty(nbytes, dtype=torch.uint8).untyped_storage()
            _kept.append(storage)
        lender = torch.empty(0, dtype=dtype).set_(storage, 0, tuple(shape))  # contiguous strides
        return from_dlpack(to_dlpack(lender))  # a storage of its own, which keeps the lender alive


def release_all() -> None:
    """Drop every kept storage (memory measurements that must see each allocation); one still in
    use is freed when its tensor is."""
    with _lock:
        _kept.clear()


def kept_bytes() -> int:
    """Bytes the pool holds, in use or free."""
    with _lock:
        return sum(s.nbytes() for s in _kept)
