"""Megatron's tensor-parallel layers: column-, row- and vocab-parallel.

A layer holds only its shard of the logical (unsharded) weight and tags each parameter with
``tp_partition_dim`` (the dim it is split along, or ``None`` when every TP rank holds all of it),
so that initialisation, gradient clipping and checkpoints can relate the shard to the logical
tensor without knowing the layer. Parameters replicated across TP whose gradient is computed from
a sequence-parallel slice carry ``sequence_parallel=True``: their grads must be summed over TP.

Layers take the TP process group directly; they know nothing of models or of ``ParallelState``.
Weights are created empty: ``models.init.init_weights`` fills them layout-independently.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron_hydra.parallel import collectives as C
from megatron_hydra.parallel import mappings as M


def tp_param(shape, dtype, device, partition_dim: Optional[int], sequence_parallel: bool = False) -> nn.Parameter:
    """An uninitialised parameter tagged with how it relates to its logical tensor."""
    p = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
    p.tp_partition_dim = partition_dim
    p.sequence_parallel = sequence_parallel and partition_dim is None
    return p


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
    (half the bytes of an all-reduce followed by a split)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_group=None, *,
                 sequence_parallel: bool = False, dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        local = _shard(num_embeddings, C.group_size(tp_group), "num_embeddings")
        self.vocab_start = C.group_rank(tp_group) * local
        self.weight = tp_param((local, embedding_dim), dtype, device, 0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if C.group_size(self.tp_group) == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return M.reduce_scatter_to_sp(out, self.tp_group)
        return M.reduce_from_tp(out, self.tp_group)


def parallel_lm_logits(hidden: torch.Tensor, weight: torch.Tensor, tp_group, sequence_parallel: bool) -> torch.Tensor:
    """Logits of this rank's vocabulary shard from the (possibly tied) vocab-parallel weight."""
    return F.linear(enter_tp_region(hidden, tp_group, sequence_parallel), weight)


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int, tp_rank: int) -> torch.Tensor:
    """Set the logits of padded vocabulary entries of this TP shard to -inf (in place: the
    linear layer that made them keeps no output for backward), so that the loss and sampled
    tokens do not depend on how much padding the layout needs."""
    first_padded = vocab_size - tp_rank * logits.shape[-1]
    if first_padded < logits.shape[-1]:
        logits[..., max(first_padded, 0):] = float("-inf")
    return logits
