"""Megatron's tensor-parallel layers: column-, row- and vocab-parallel.

A layer holds only its shard of the logical (unsharded) weight and tags each parameter with
``tp_partition_dim`` (the dim it is split along, or ``None`` when every TP rank holds all of it),
so that initialisation, gradient clipping and checkpoints can relate the shard to the logical
tensor without knowing the layer. Parameters replicated across TP whose gradient is computed from
a sequence-parallel slice carry ``sequence_parallel=True``: their grads must be summed over TP.

Layers take the TP process group directly; they know nothing of models or of ``ParallelState``.
Weights are created empty (in training on the meta device): ``models.init`` gives them storage and
fills them layout-independently.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron_hydra.parallel import collectives as C
from megatron_hydra.parallel import mappings as M
from megatron_hydra.parallel.host_memory import reusable_empty


def tp_param(shape, dtype, device, partition_dim: Optional[int], sequence_parallel: bool = False) -> nn.Parameter:
    """An uninitialised parameter tagged with how it relates to its logical tensor."""
    p = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
    p.tp_partition_dim = partition_dim
    p.sequence_parallel = sequence_parallel and partition_dim is None
    return p


def sharded_param(shape, dim: int, tp_group, dtype, device) -> nn.Parameter:
    """A parameter of logical ``shape`` of which this rank holds a 1/tp slice along ``dim``."""
    local = list(shape)
    local[dim] = _shard(shape[dim], C.group_size(tp_group), f"dim {dim} of {tuple(shape)}")
    return tp_param(tuple(local), dtype, device, dim)


def replicated(module: nn.Module, sequence_parallel: bool = False) -> nn.Module:
    """Tag a plain module's parameters as held whole by every TP rank; ``sequence_parallel``:
    each rank computes their gradient from its own sequence slice, so it is summed over TP."""
    for p in module.parameters():
        p.tp_partition_dim, p.sequence_parallel = None, sequence_parallel
    return module


def _shard(size: int, world: int, what: str) -> int:
    if size % world:
        raise ValueError(f"{what}={size} is not divisible by the tensor-parallel size {world}")
    return size // world


def enter_tp_region(x: torch.Tensor, tp_group, sequence_parallel: bool) -> torch.Tensor:
    """The full input that every rank's column-parallel matmul reads: all-gathered from the
    sequence slices (SP; backward reduce-scatter) or passed as is (backward all-reduce). Layers
    that read the same input (SwiGLU's gate and up projections) must share one call: the backward
    then reduces their summed gradient once instead of once per layer."""
    return M.gather_from_sp(x, tp_group) if sequence_parallel else M.copy_to_tp(x, tp_group)


class ColumnParallelLinear(nn.Module):
    """``y = x A^T + b`` with A split along its output rows: each rank computes a slice of y.

    Input is the full activation (or, with sequence parallelism, this rank's sequence slice, which
    is all-gathered first); output is this rank's slice of the features unless ``gather_output``.
    ``forward(x, input_entered=True)`` takes an input already passed through ``enter_tp_region``.
    """

    def __init__(self, in_features: int, out_features: int, tp_group=None, *, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False,
                 dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.tp_group, self.gather_output, self.sequence_parallel = tp_group, gather_output, sequence_parallel
        self.in_features, self.out_features = in_features, out_features
        local_out = _shard(out_features, C.group_size(tp_group), "out_features")
        self.weight = tp_param((local_out, in_features), dtype, device, 0)
        self.bias = tp_param((local_out,), dtype, device, 0) if bias else None

    def forward(self, x: torch.Tensor, input_entered: bool = False) -> torch.Tensor:
        if not input_entered:
            x = enter_tp_region(x, self.tp_group, self.sequence_parallel)
        y = F.linear(x, self.weight, self.bias)
        return M.gather_from_tp(y, self.tp_group) if self.gather_output else y


def same_input(x: torch.Tensor, *layers: ColumnParallelLinear):
    """Several column-parallel layers over one input (a gated MLP's gate and up projections):
    the input enters the TP region once, so backward reduces their summed input gradient once
    instead of once per layer."""
    x = enter_tp_region(x, layers[0].tp_group, layers[0].sequence_parallel)
    return tuple(layer(x, input_entered=True) for layer in layers)


class RowParallelLinear(nn.Module):
    """``y = x A^T + b`` with A split along its input columns: each rank holds a slice of x (the
    output of a column-parallel layer) and the partial products are summed over TP (or
    reduce-scattered along the sequence with sequence parallelism). The bias is added once, after
    the reduction."""

    def __init__(self, in_features: int, out_features: int, tp_group=None, *, bias: bool = True,
                 sequence_parallel: bool = False, dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.in_features, self.out_features = in_features, out_features
        local_in = _shard(in_features, C.group_size(tp_group), "in_features")
        self.weight = tp_param((out_features, local_in), dtype, device, 1)
        self.bias = tp_param((out_features,), dtype, device, None, sequence_parallel) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        y = M.reduce_scatter_to_sp(y, self.tp_group) if self.sequence_parallel else M.reduce_from_tp(y, self.tp_group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding table split along the vocabulary: rank r owns ids [r*V/tp, (r+1)*V/tp). Ids
    outside the range look up nothing (zeros) and the partial lookups are summed over TP; with
    sequence parallelism the sum is reduce-scattered, so each rank leaves with its sequence slice
    (half the bytes of an all-reduce followed by a split).

    ``tied``: the table is also the output layer's weight. A model split into pipeline stages
    then holds it on the first stage and a ``pipeline_copy`` on the last (Megatron's scheme):
    same logical name and initial values; ``parallel.pipeline`` sums the two copies' grads, and
    gradient clipping and checkpoints count the copy zero times.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_group=None, *,
                 sequence_parallel: bool = False, tied: bool = False, pipeline_copy: bool = False,
                 dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = sharded_param((num_embeddings, embedding_dim), 0, tp_group, dtype, device)
        self.vocab_start = C.group_rank(tp_group) * self.weight.shape[0]
        if tied:
            self.weight.shared_embedding = True
            self.weight.shared_embedding_copy = pipeline_copy

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if C.group_size(self.tp_group) == 1:
            return lookup(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = lookup(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return M.reduce_scatter_to_sp(out, self.tp_group)
        return M.reduce_from_tp(out, self.tp_group)


def lookup(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``F.embedding(ids, table)``. On a CPU, the gradient of the table (zeros but for the rows
    looked up, as large as the table) is built in host memory an earlier step's gradient left free
    (``parallel.host_memory``) instead of fresh pages, equal to torch's own backward to the bit in
    every dtype. Accelerators keep torch's backward (their caching allocator already reuses memory)."""
    if table.requires_grad and table.device.type == "cpu":
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
        table_grad = reusable_empty(ctx.table_shape, ctx.table_dtype, grad.device).zero_()
        return None, table_grad.index_copy_(0, looked_up.long(), rows)


class PositionEmbedding(nn.Embedding):
    """Learned absolute positions, replicated over TP. Under sequence parallelism each rank holds
    the sequence slice ``[tp_rank * s, (tp_rank + 1) * s)`` and looks up those positions (so
    the grads, computed from one slice each, are summed over TP)."""

    def __init__(self, max_positions: int, embedding_dim: int, tp_group=None, *, sequence_parallel: bool = False,
                 dtype: torch.dtype = torch.float32, device=None):
        super().__init__(max_positions, embedding_dim, dtype=dtype, device=device)
        replicated(self, sequence_parallel)
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel

    def forward(self, length: int, offset: int = 0, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """[length, dim] for the ``length`` positions from ``offset`` (generation: the tokens
        already cached), or for this rank's slice under sequence parallelism. ``position_ids``
        ([batch, seq], context parallelism): the positions themselves; [batch, length, dim] of
        this rank's slice of them."""
        if position_ids is not None:
            start = C.group_rank(self.tp_group) * length if self.sequence_parallel else 0
            return super().forward(position_ids[:, start:start + length])
        start = C.group_rank(self.tp_group) * length if self.sequence_parallel else offset
        return super().forward(torch.arange(start, start + length, device=self.weight.device))


def vocab_parallel_logits(hidden: torch.Tensor, weight: torch.Tensor, tp_group, sequence_parallel: bool,
                          vocab_size: int, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Logits of this rank's vocabulary shard, [..., padded_vocab / tp], from the (possibly tied)
    vocab-parallel ``weight`` (+ ``bias``); padded entries are -inf.

    Computed vocabulary-major, ``weight @ hidden^T`` ([vocab / tp, tokens]), and handed back as its
    transpose (a strided view: entries of one token lie ``tokens`` apart). The weight is then the
    matmul's first operand with nothing between it and its parameter, so its gradient is a
    contiguous [vocab, hidden] tensor into which autograd adds a tied embedding's lookup gradient
    in place. Through ``F.linear`` the gradient would reach the parameter as a transposed view, and
    the two gradients would be summed into a third (an allocation and a pass over 150 MB a step for
    GPT-2's table in fp32). The logits and the weight's gradient take memory that, on a CPU, an
    earlier step's left free (``parallel.host_memory``), so the step's largest tensors do not fault
    their pages in anew every step; the backward computes only the gradients its pass uses (a
    zero-bubble schedule's input and weight passes run one matmul each)."""
    x = enter_tp_region(hidden, tp_group, sequence_parallel)
    rows = x.reshape(-1, x.shape[-1]).t()
    logits_t = _HeadMatmul.apply(weight, rows, bias)
    mask_padded_vocab(logits_t, vocab_size, C.group_rank(tp_group))
    return logits_t.t().view(*x.shape[:-1], logits_t.shape[0])


class _HeadMatmul(torch.autograd.Function):
    """``weight @ rows (+ bias)`` in reused host memory. The backward writes the weight's gradient
    into reused memory too, where torch's own matmul node would return a fresh tensor, and, as
    torch's node does, computes only the gradients the running backward pass uses."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, rows: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        ctx.save_for_backward(weight, rows)
        out = reusable_empty((weight.shape[0], rows.shape[1]), weight.dtype, weight.device)
        if bias is None:
            return torch.mm(weight, rows, out=out)
        return torch.addmm(bias.unsqueeze(-1), weight, rows, out=out)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        weight, rows = ctx.saved_tensors
        grad_weight = grad_rows = grad_bias = None
        if _pass_computes(ctx, 0):
            grad_weight = torch.mm(grad, rows.t(), out=reusable_empty(weight.shape, weight.dtype, weight.device))
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


def mask_padded_vocab(logits_t: torch.Tensor, vocab_size: int, tp_rank: int) -> torch.Tensor:
    """Set the vocabulary-major logits ([vocab / tp, tokens]) of this TP shard's padded vocabulary
    entries to -inf, so that the loss and sampled tokens do not depend on how much padding the
    layout needs.

    In place and outside autograd, on the matmul's own output before any view of it exists: the
    matmul keeps no output for backward, and the gradient reaching these entries is already zero
    (a softmax of -inf, never a target). Recorded by autograd, the assignment would copy the whole
    [tokens, vocab] gradient in backward only to zero what is zero; done to a view, it would make
    autograd rebuild the view's backward as a strided copy of the whole base."""
    first_padded = vocab_size - tp_rank * logits_t.shape[0]
    if first_padded < logits_t.shape[0]:
        with torch.no_grad():
            logits_t[max(first_padded, 0):] = float("-inf")
    return logits_t
