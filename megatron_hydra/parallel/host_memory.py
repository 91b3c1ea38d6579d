"""CPU only: the LM head and the embedding lookup computed in host memory reused from one step to
the next. ``parallel.layers.kernels_for`` picks this module for tensors on a CPU and torch's own
``F.linear`` / ``F.embedding`` for every other device (an accelerator, the dry run's stand-in),
so nothing here ever runs on an accelerator, and this is the one module of the package with
custom autograd nodes and private torch calls for speed.

Why a CPU needs it: there every large tensor is fresh memory from the operating system. The C
library maps allocations of more than a few megabytes anew and unmaps them when they are freed,
so each step faults every page of the logits and of the [vocab, hidden] gradients in again (a
kernel trap and a page of zeros written per 4 KiB; docs/memory.md has the counts). An
accelerator's caching allocator already keeps such blocks.

The pool keeps storages and lends one out once nothing but the pool refers to it (its use count
is the pool's own one). It lends it as a tensor with a storage of its own over the same bytes (a
DLPack exchange), which holds the kept storage for as long as it lives. To autograd that tensor
is fresh memory nothing else refers to, so where two gradients of one tensor meet (a tied
embedding's lookup and head) it adds one into the other in place instead of allocating their sum
(as it would if the tensor were over the kept storage itself, which the pool's reference makes a
storage with two users). A tensor still in use (the logits of a micro-batch whose backward has
not run yet, logits a caller kept, a gradient the optimizer has not stepped with) is never handed
out twice; other memory is used then. The pool keeps at most ``MAX_KEPT`` storages, evicting the
smallest free one, so changing shapes cannot grow it without bound. Between steps it keeps the
memory of all three tensors, one more such tensor than a step holds at once.

The contents of a reused storage are the last user's: callers overwrite every entry (the head's
matmuls write their whole output, ignoring what was there, NaN included; the lookup's backward
zero-fills its gradient first).

Private torch calls, CPU-only like the rest: ``torch._C._storage_Use_Count`` (whether a kept
storage is free: no public API tells; a torch without it fails this module's tests) and
``torch._C._will_engine_execute_node`` (which of the head's gradients a split backward uses; a torch
without it gets every gradient computed, slower, never wrong).
"""

from __future__ import annotations

import math
import threading
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch.utils.dlpack import from_dlpack, to_dlpack

MAX_KEPT = 4

_kept: List[torch.UntypedStorage] = []
_lock = threading.Lock()


def _only_the_pool_holds(storage: torch.UntypedStorage) -> bool:
    return torch._C._storage_Use_Count(storage._cdata) == 1


def reusable_empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor of ``shape``, in memory an earlier tensor freed."""
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


def head(rows: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], first_padded: int) -> torch.Tensor:
    """Logits [tokens, vocab / tp] of ``rows`` [tokens, hidden], entries from ``first_padded`` on -inf.

    Computed vocabulary-major, ``weight @ rows^T`` ([vocab / tp, tokens]) in reused memory, and
    handed back as its transpose (a strided view: entries of one token lie ``tokens`` apart). The
    weight is then the matmul's first operand with nothing between it and its parameter, so its
    gradient is a contiguous [vocab, hidden] tensor (in reused memory too) into which autograd adds
    a tied embedding's lookup gradient in place; through ``F.linear`` it would reach the parameter
    as a transposed view, and the two gradients would be summed into a third tensor."""
    logits_t = _HeadMatmul.apply(weight, rows.t(), bias)
    _mask_rows(logits_t, first_padded)
    return logits_t.t()


def _mask_rows(logits_t: torch.Tensor, first_padded: int) -> None:
    """-inf into the vocabulary-major logits' padded rows, in place and outside autograd, on the
    matmul's own output before any view of it exists: the matmul keeps no output for backward, and
    the gradient reaching these entries is already zero (a softmax of -inf, never a target). Done
    to a view, it would make autograd rebuild the view's backward as a strided copy of the base."""
    if first_padded < logits_t.shape[0]:
        with torch.no_grad():
            logits_t[max(first_padded, 0):] = float("-inf")


class _HeadMatmul(torch.autograd.Function):
    """``weight @ rows (+ bias)`` in reused memory. The backward writes the weight's gradient into
    reused memory too, where torch's own matmul node would return a fresh tensor, and, as torch's
    node does, computes only the gradients the running backward pass uses (a zero-bubble schedule's
    input and weight passes run one matmul each)."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, rows: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        ctx.save_for_backward(weight, rows)
        out = reusable_empty((weight.shape[0], rows.shape[1]), weight.dtype)
        if bias is None:
            return torch.mm(weight, rows, out=out)
        return torch.addmm(bias.unsqueeze(-1), weight, rows, out=out)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        weight, rows = ctx.saved_tensors
        grad_weight = grad_rows = grad_bias = None
        if _pass_computes(ctx, 0):
            grad_weight = torch.mm(grad, rows.t(), out=reusable_empty(weight.shape, weight.dtype))
        if _pass_computes(ctx, 1):
            grad_rows = grad.t().mm(weight).t()
        if _pass_computes(ctx, 2):
            grad_bias = grad.sum(1)
        return grad_weight, grad_rows, grad_bias


def _pass_computes(ctx, i: int) -> bool:
    """Whether the running backward pass uses the gradient of the node's input ``i``. A zero-bubble
    schedule's input pass (``autograd.grad`` to the stage's inputs) uses no weight's, its weight
    pass (from the saved gradients of the nodes that lead to weights) no input's. torch declines to
    answer for a parameter whose gradient ``autograd.grad`` captures: that gradient is used. The
    question is torch's private API; a torch without it gets every gradient computed (slower in a
    split backward, never wrong)."""
    if not ctx.needs_input_grad[i]:
        return False
    node, will_execute = ctx.next_functions[i][0], getattr(torch._C, "_will_engine_execute_node", None)
    try:
        return node is None or will_execute is None or will_execute(node)
    except RuntimeError:  # a parameter whose gradient autograd.grad captures
        return True


def lookup(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``F.embedding(ids, table)`` whose table gradient (zeros but for the rows looked up, as large
    as the table) is built in reused memory instead of fresh pages, equal to torch's own backward
    to the bit in every dtype."""
    if table.requires_grad:
        return _LookupWithReusedGrad.apply(ids, table)
    return F.embedding(ids, table)


class _LookupWithReusedGrad(torch.autograd.Function):
    """The backward runs torch's own embedding backward on the rows looked up alone (the ids
    renumbered 0..n-1 in order of value), then copies those n rows into a zero-filled table.
    torch's backward adds each occurrence's gradient row into its table row in the order the ids
    come, rounding after each addition in 16-bit dtypes; the renumbering keeps that order per row,
    so every dtype gets torch's very sums."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.table_shape, ctx.table_dtype = table.shape, table.dtype
        return F.embedding(ids, table)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        (ids,) = ctx.saved_tensors
        looked_up, renumbered = torch.unique(ids.reshape(-1), return_inverse=True)
        rows = torch.ops.aten.embedding_dense_backward(grad.reshape(-1, ctx.table_shape[1]), renumbered,
                                                       looked_up.numel(), -1, False)
        table_grad = reusable_empty(ctx.table_shape, ctx.table_dtype).zero_()
        return None, table_grad.index_copy_(0, looked_up.long(), rows)
