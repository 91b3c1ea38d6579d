"""Autograd-aware collectives over the tensor-parallel group (Megatron's "mappings").

Each forward collective is paired with its adjoint in backward, so a region of the network that
is split across TP ranks gets exactly the gradient the unsplit network would:
- copy_to_tp:        forward identity,   backward all-reduce   (enter a column-parallel layer)
- reduce_from_tp:    forward all-reduce, backward identity     (leave a row-parallel layer)
- gather_from_tp:    forward all-gather (last dim), backward split
- scatter_to_tp:     forward split (last dim), backward all-gather
and for sequence parallelism, along the sequence dimension:
- gather_from_sp:    forward all-gather, backward reduce-scatter
- reduce_scatter_to_sp: forward reduce-scatter, backward all-gather
and between a TP-replicated tensor and per-rank sequence slices that are whole values (not
partial sums): the slices of tokens that TP ranks process apart, e.g. experts that are not split
over TP:
- split_sequence:    forward split,      backward all-gather
- gather_sequence:   forward all-gather, backward split

The all-reduces work in place, on the forward input or on the incoming gradient, as Megatron's
do: callers hand them tensors just computed by a matmul, which nothing else reads.
"""

from __future__ import annotations

import torch

from megatron_hydra.parallel import collectives as C

SEQ_DIM = 1  # activations are [batch, sequence, hidden]


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return C.all_reduce(grad.contiguous(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return C.all_reduce(x.contiguous(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Gather(torch.autograd.Function):
    """Forward all-gather along ``dim``, backward this rank's split: the pieces are whole values."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return C.all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return C.split(grad, ctx.dim, ctx.group), None, None


class _Split(torch.autograd.Function):
    """Forward this rank's split along ``dim``, backward all-gather."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return C.split(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return C.all_gather(grad, ctx.dim, ctx.group), None, None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return C.all_gather(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return C.reduce_scatter(grad, SEQ_DIM, ctx.group), None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return C.reduce_scatter(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return C.all_gather(grad, SEQ_DIM, ctx.group), None


def _apply(fn, x, group, *more):
    return x if C.group_size(group) == 1 else fn.apply(x, group, *more)


def copy_to_tp(x, group):
    return _apply(_CopyToTP, x, group)


def reduce_from_tp(x, group):
    return _apply(_ReduceFromTP, x, group)


def gather_from_tp(x, group):
    return _apply(_Gather, x, group, -1)


def scatter_to_tp(x, group):
    return _apply(_Split, x, group, -1)


def gather_from_sp(x, group):
    return _apply(_GatherFromSP, x, group)


def reduce_scatter_to_sp(x, group):
    return _apply(_ReduceScatterToSP, x, group)



def split_sequence(x, group):
    return _apply(_Split, x, group, SEQ_DIM)


def gather_sequence(x, group):
    return _apply(_Gather, x, group, SEQ_DIM)
