"""Data-parallel gradient reduction: contiguous grad buffers, bucketed, overlapped with backward.

Each parameter's ``.grad`` is a view into one flat buffer, grouped into buckets of about
``bucket_size`` elements in reverse registration order (roughly the order backward produces
them). During the backward of the last micro-batch, a post-accumulate-grad hook counts the
parameters of each bucket whose grads are final; when a bucket is complete its all-reduce over
the data-parallel group is started asynchronously while backward continues on earlier layers
(as Megatron's and PyTorch DDP's buckets do). ``finish`` launches what is left, waits, and turns
the sums into means.
"""

from __future__ import annotations

from typing import Iterable, List

import torch
import torch.distributed as dist

from megatron_hydra.parallel import collectives as C


class _Bucket:
    def __init__(self, params: List[torch.nn.Parameter], view: torch.Tensor):
        self.params, self.view = params, view
        self.ready = 0
        self.handle = None


class GradBuffer:
    def __init__(self, params: Iterable[torch.nn.Parameter], dp_group, bucket_size: int):
        self.params = [p for p in params if p.requires_grad]
        self.group, self.dp = dp_group, C.group_size(dp_group)
        ordered = list(reversed(self.params))
        first = ordered[0]
        total = sum(p.numel() for p in ordered)
        self.buffer = torch.zeros(total, dtype=first.dtype, device=first.device)
        self.buckets: List[_Bucket] = []
        self._bucket_of = {}
        self._views = {}
        start, offset, members = 0, 0, []
        for p in ordered:
            self._views[p] = self.buffer[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
            members.append(p)
            if offset - start >= bucket_size or p is ordered[-1]:
                bucket = _Bucket(members, self.buffer[start:offset])
                self.buckets.append(bucket)
                for q in members:
                    self._bucket_of[q] = bucket
                start, members = offset, []
        self.zero()
        self.sync_enabled = True
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in ordered] if self.dp > 1 else []

    def close(self) -> None:
        """Detach from the parameters: no hook of this buffer fires after this."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _on_grad_ready(self, p: torch.nn.Parameter) -> None:
        if not self.sync_enabled:
            return
        bucket = self._bucket_of[p]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        if C._counter is not None:
            C._counter.add("dp_all_reduce", bucket.view)
        bucket.handle = dist.all_reduce(bucket.view, group=self.group, async_op=True)

    def zero(self) -> None:
        """Zero all grads and (re)attach them to the buffer: anything that set ``.grad = None``
        in between (Lightning zeroes grads with set_to_none before fitting) is undone here."""
        self.buffer.zero_()
        for p, view in self._views.items():
            if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                p.grad = view
        for bucket in self.buckets:
            bucket.ready, bucket.handle = 0, None

    def finish(self) -> None:
        """Complete the reduction; afterwards every DP rank holds the mean gradient."""
        if self.dp == 1:
            return
        for bucket in self.buckets:
            if bucket.handle is None:  # params that got no gradient, or sync was off throughout
                self._launch(bucket)
        for bucket in self.buckets:
            bucket.handle.wait()
            bucket.handle = None
        self.buffer.div_(self.dp)
        for bucket in self.buckets:
            bucket.ready = 0


def allreduce_sequence_parallel_grads(params: Iterable[torch.nn.Parameter], tp_group) -> None:
    """Norm weights and row-parallel biases see only this rank's sequence slice under sequence
    parallelism; their full gradient is the sum over the TP group."""
    grads = [p.grad for p in params if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if not grads or C.group_size(tp_group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    C.all_reduce(flat, tp_group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
