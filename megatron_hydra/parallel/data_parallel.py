"""Data-parallel gradient reduction: contiguous grad buffers, bucketed, overlapped with backward.

Each parameter's gradient lives in one flat buffer (``p.main_grad``, a view), grouped into
buckets of about ``bucket_size`` elements in reverse registration order (roughly the order
backward produces them). With ``overlap`` (``parallel.overlap_grad_reduce``), the parameters of
each bucket are counted as their grads become final; when a bucket is complete its reduction over
the data-parallel group is started asynchronously while backward continues on earlier layers (as
Megatron's and PyTorch DDP's buckets do). A grad is final in the backward of the last micro-batch
that reaches it, and who knows which that is differs by caller: without a pipeline the caller
turns counting on for the last micro-batch (``sync_enabled``), and the post-accumulate-grad hook
counts; a pipeline schedule's backwards of different chunks interleave, so it ``arm``s each
chunk's parameters just before that chunk's last backward (the hook counts them then), or, for a
zero-bubble W pass that adds grads by hand (no hook fires), declares them ``ready`` right after it.
``finish`` launches what is left (a bucket whose parameter got no gradient, one holding a tied
embedding the pipeline sums first, or every bucket without ``overlap``), waits, and turns the sums
into means, dividing by the micro-batch count as well where the caller summed micro-batches
unscaled (a pipeline): dividing before the reduce would write into buckets already in flight.

The buffer's dtype is the parameters' for fp32/fp64 models: ``p.grad`` *is* the view, autograd
accumulates straight into it. For bf16/fp16 models the buffer is fp32 (grads are accumulated and
reduced in fp32, as Megatron does): autograd leaves each micro-batch's 16-bit grad in ``p.grad``,
the hook adds it into the fp32 view and frees it.

With ``distributed=True`` (the distributed optimizer) every bucket is padded to a multiple of the
size of the group it is reduced over and reduce-scattered instead of all-reduced: rank r of that
group ends up with the mean of the r-th 1/size of each bucket (``Bucket.shard``), which is all its
optimizer shard needs.

Expert parameters (``is_expert``: a MoE layer's experts, split over the expert-parallel group)
get buckets of their own, after the dense ones in the same flat buffer, reduced over the expert
data-parallel group (the ranks holding the same experts) instead of dp x cp. Every bucket is then
divided by dp x cp, the expert ones too, although they were summed over only dp x cp / ep ranks:
the expert-parallel dispatch already summed, on each expert's holder, the gradients of the local
losses of its whole ep group, so the sum over the expert data-parallel group is the sum over all
dp x cp ranks, and the gradient of the global loss (the mean of the ranks' local losses) is that
sum divided by dp x cp.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional

import torch

from megatron_hydra.parallel import collectives as C
from megatron_hydra.parallel.fsdp import local_shard

HALF_DTYPES = (torch.bfloat16, torch.float16)


def grad_dtype_for(param_dtype: torch.dtype) -> torch.dtype:
    """Gradients are kept in fp32 for 16-bit models, else in the parameters' dtype."""
    return torch.float32 if param_dtype in HALF_DTYPES else param_dtype


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` start at the same element of the same storage. (Comparing
    ``data_ptr`` says the same for real tensors, but the dry run's fake tensors have no data:
    their pointers are offsets, equal for unrelated tensors.)"""
    return a.untyped_storage()._cdata == b.untyped_storage()._cdata and a.storage_offset() == b.storage_offset()


def main_grad(p: torch.nn.Parameter) -> Optional[torch.Tensor]:
    """The gradient of ``p`` as the buffer holds it. A 16-bit grad that autograd left in
    ``p.grad`` without the hook seeing it (a pipeline schedule that assigns weight grads by hand)
    is folded in first, so callers always see the whole gradient. An FSDP parameter's gradient is
    this rank's rows of it (``parallel.fsdp.local_shard``)."""
    buffered = getattr(p, "main_grad", None)
    if buffered is None:
        return None if p.grad is None else local_shard(p.grad)
    if p.grad is not None and not same_memory(p.grad, buffered):
        buffered.add_(p.grad)
        p.grad = None
    return buffered


def is_expert(p: torch.nn.Parameter) -> bool:
    """Whether ``p`` is this rank's share of a MoE layer's experts (``expert_parallel``): it differs
    across the expert-parallel group and is replicated only over the expert data-parallel one."""
    return getattr(p, "expert_parallel", False)


class _Local:
    """The handle of a reduction over a group of one rank: nothing to wait for."""

    @staticmethod
    def wait() -> bool:
        return True


class Bucket:
    """Consecutive parameters of the buffer, reduced together over ``group``."""

    def __init__(self, params: List[torch.nn.Parameter], start: int, end: int, buffer: torch.Tensor, group):
        self.params, self.start, self.end = params, start, end
        self.group, self.size = group, C.group_size(group)
        self.view = buffer[start:end]
        size = (end - start) // self.size
        self.shard_start = start + C.group_rank(group) * size  # the distributed optimizer's slice (global offsets)
        self.shard_end = self.shard_start + size
        self.shard = buffer[self.shard_start:self.shard_end]
        self.ready = 0
        self.handle = None


def bucket_layout(numels: List[int], bucket_size: int, pad_to: int = 1) -> List[tuple]:
    """``(first, last_exclusive, start, end)`` per bucket over parameters in buffer order: the
    parameter index range and the element range, each bucket padded to a multiple of ``pad_to``.
    Pure, so that the memory plan computes exactly the buffer a run allocates."""
    layout, first, start, offset = [], 0, 0, 0
    for i, n in enumerate(numels):
        offset += n
        if offset - start >= bucket_size or i == len(numels) - 1:
            end = start + -(-(offset - start) // pad_to) * pad_to
            layout.append((first, i + 1, start, end))
            first, start, offset = i + 1, end, end
    return layout


def split_layout(parts: List[tuple], bucket_size: int) -> List[tuple]:
    """``(members, start, end, group)`` per bucket of one flat buffer. ``parts``: ``(params,
    group, pad_to)`` per reduction group, in buffer order; each part is laid out by
    ``bucket_layout`` after the previous one, so that no bucket mixes two groups."""
    out, at = [], 0
    for params, group, pad_to in parts:
        if not params:
            continue
        for lo, hi, start, end in bucket_layout([p.numel() for p in params], bucket_size, pad_to):
            out.append((params[lo:hi], at + start, at + end, group))
        at = out[-1][2]
    return out


class GradBuffer:
    """The gradients of ``params``, reduced over ``dp_cp_group``; with ``expert_dp_group`` (expert
    parallelism), expert parameters' over that group instead (see the module docstring). Without
    it, expert-tagged parameters are reduced as dense ones, which is right where ep is 1."""

    def __init__(self, params: Iterable[torch.nn.Parameter], dp_cp_group, bucket_size: int,
                 distributed: bool = False, expert_dp_group=None, overlap: bool = True):
        self.params = [p for p in params if p.requires_grad]
        self.group, self.dp = dp_cp_group, C.group_size(dp_cp_group)
        self.expert_group = expert_dp_group
        self.distributed, self.overlap = distributed, overlap
        self._armed: set = set()  # parameters the hook counts although sync is off (``arm``)
        ordered = list(reversed(self.params))
        first = ordered[0]
        self.dtype = grad_dtype_for(first.dtype)
        self.separate = self.dtype != first.dtype  # 16-bit params: grads move into the fp32 buffer
        split = expert_dp_group is not None
        expert = [p for p in ordered if split and is_expert(p)]
        dense = [p for p in ordered if not (split and is_expert(p))]
        parts = [(members, group, C.group_size(group) if distributed else 1)
                 for members, group in ((dense, dp_cp_group), (expert, expert_dp_group))]
        layout = split_layout(parts, bucket_size)
        self.buffer = torch.zeros(layout[-1][2], dtype=self.dtype, device=first.device)
        self.offsets: Dict[torch.nn.Parameter, int] = {}
        self.buckets: List[Bucket] = []
        self._bucket_of = {}
        for members, start, end, group in layout:
            bucket = Bucket(members, start, end, self.buffer, group)
            self.buckets.append(bucket)
            offset = start
            for p in members:
                self.offsets[p] = offset
                p.main_grad = self.buffer[offset:offset + p.numel()].view_as(p)
                self._bucket_of[p] = bucket
                offset += p.numel()
        self.zero()
        self.sync_enabled = True
        needs_hooks = self.dp > 1 or self.separate
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in ordered] if needs_hooks else []

    def close(self) -> None:
        """Detach from the parameters: no hook of this buffer fires after this."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _on_grad_ready(self, p: torch.nn.Parameter) -> None:
        if self.separate:
            main_grad(p)
        if self.sync_enabled or p in self._armed:
            self._count(p)

    def arm(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Have the hook count ``params`` from their next gradient on, whatever ``sync_enabled``
        says: a pipeline calls it just before a chunk's last backward (see the module docstring)."""
        if self.overlap and self.dp > 1:
            self._armed.update(p for p in params if p in self._bucket_of)

    def ready(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Count ``params`` as final now (their grads were added by hand, and folded into the buffer)."""
        for p in params:
            if p in self._bucket_of:
                self._count(p)

    def _count(self, p: torch.nn.Parameter) -> None:
        if not self.overlap or self.dp == 1:
            return
        bucket = self._bucket_of[p]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        if bucket.size == 1:  # experts held by one rank of each ep group: nothing to add up
            bucket.handle = _Local()
        elif self.distributed:
            bucket.handle = C.reduce_scatter_into(bucket.shard, bucket.view, bucket.group, "dp_reduce_scatter")
        else:
            bucket.handle = C.all_reduce_async(bucket.view, bucket.group, "dp_all_reduce")

    def zero(self) -> None:
        """Zero all grads and (re)attach them to the buffer: anything that set ``.grad = None``
        in between (Lightning zeroes grads with set_to_none before fitting) is undone here."""
        self.buffer.zero_()
        for p in self.offsets:
            if self.separate:
                p.grad = None
            elif p.grad is None or not same_memory(p.grad, p.main_grad):
                p.grad = p.main_grad
        for bucket in self.buckets:
            bucket.ready, bucket.handle = 0, None
        self._armed.clear()

    def finish(self, microbatches: int = 1) -> None:
        """Complete the reduction; afterwards every DP rank holds the mean gradient (of its shards,
        when distributed): each bucket's sum over its group, divided by dp x cp and by
        ``microbatches`` (the number of unscaled micro-batch grads summed into it, a pipeline's)."""
        if self.separate:
            for p in self.offsets:
                main_grad(p)
        if self.dp > 1:
            for bucket in self.buckets:
                if bucket.handle is None:  # params that got no gradient, a tied embedding, or no overlap
                    self._launch(bucket)
        scale = self.dp * microbatches
        for bucket in self.buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
            bucket.handle, bucket.ready = None, 0
            if scale != 1:
                (bucket.shard if self.distributed else bucket.view).div_(scale)
        self._armed.clear()


def allreduce_sequence_parallel_grads(params: Iterable[torch.nn.Parameter], tp_group,
                                      grads: Optional[List[torch.Tensor]] = None) -> None:
    """Norm weights and row-parallel biases see only this rank's sequence slice under sequence
    parallelism; their full gradient is the sum over the TP group. ``grads`` (one per param)
    overrides where each gradient is read and written, e.g. the distributed optimizer's shards."""
    params = list(params)
    grads = [main_grad(p) for p in params] if grads is None else grads
    grads = [g for p, g in zip(params, grads) if getattr(p, "sequence_parallel", False) and g is not None]
    if not grads or C.group_size(tp_group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    C.all_reduce(flat, tp_group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
