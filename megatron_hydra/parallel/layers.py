"""Megatron's tensor-parallel layers: column-, row- and vocab-parallel.

A layer holds only its shard of the logical (unsharded) weight and tags each parameter with
``tp_partition_dim`` (the dim it is split along, or ``None`` when every TP rank holds all of it),
so that initialisation, gradient clipping and checkpoints can relate the shard to the logical
tensor without knowing the layer. Parameters replicated across TP whose gradient is computed from
a sequence-parallel slice carry ``sequence_parallel=True``: their grads must be summed over TP.

Layers take the TP process group directly; they know nothing of models or of ``ParallelState``.
Weights are created empty (in training on the meta device): ``models.init`` gives them storage and
fills them layout-independently.

With ``tp_comm_overlap`` (and sequence parallelism over tp > 1) the column- and row-parallel
layers run their all-gather and reduce-scatter as rings overlapped with partial matmuls
(``parallel.collective_matmul``); a layer with a LoRA adapter keeps the plain path.

The LM head and the embedding lookup cross one device seam, ``kernels_for``: torch's own ops on an
accelerator, CPU-only kernels over reused host memory (``parallel.host_memory``) on a CPU.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron_hydra.parallel import collectives as C
from megatron_hydra.parallel import collective_matmul
from megatron_hydra.parallel import mappings as M
from megatron_hydra.parallel import host_memory
from megatron_hydra.parallel.lora import add_adapter


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
    ``forward(x, input_entered=True)`` takes an input already passed through ``enter_tp_region``;
    ``forward(x, weights_only=True)`` returns ``(weight, bias)`` after the module's pre-hooks ran.
    ``lora``: a low-rank adapter (``parallel.lora.ColumnLoRA``) added to the output slice, or None.
    ``tp_comm_overlap``: under sequence parallelism, the all-gather overlapped with the matmul.
    """

    def __init__(self, in_features: int, out_features: int, tp_group=None, *, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False, tp_comm_overlap: bool = False,
                 dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.tp_group, self.gather_output, self.sequence_parallel = tp_group, gather_output, sequence_parallel
        self.tp_comm_overlap = tp_comm_overlap
        self.in_features, self.out_features = in_features, out_features
        local_out = _shard(out_features, C.group_size(tp_group), "out_features")
        self.weight = tp_param((local_out, in_features), dtype, device, 0)
        self.bias = tp_param((local_out,), dtype, device, 0) if bias else None
        self.lora: Optional[nn.Module] = None

    def forward(self, x: torch.Tensor, input_entered: bool = False, weights_only: bool = False):
        if weights_only:  # for ``same_input``'s shared ring: through ``__call__``, so pre-hooks run first
            return self.weight, self.bias
        if not input_entered and _overlapped(self):
            y = collective_matmul.all_gather_linear(x, self.tp_group, [self.weight], [self.bias])[0]
        else:
            if not input_entered:
                x = enter_tp_region(x, self.tp_group, self.sequence_parallel)
            y = add_adapter(F.linear(x, self.weight, self.bias), self.lora, x)
        return M.gather_from_tp(y, self.tp_group) if self.gather_output else y


def _overlapped(*layers) -> bool:
    """Whether ``layers`` run as collective matmuls: overlap asked for, sequence parallelism over
    more than one rank, and no LoRA adapter (which reads the whole gathered input)."""
    first = layers[0]
    return (first.tp_comm_overlap and first.sequence_parallel and C.group_size(first.tp_group) > 1
            and all(layer.lora is None for layer in layers))


def same_input(x: torch.Tensor, *layers: ColumnParallelLinear):
    """Several column-parallel layers over one input (a gated MLP's gate and up projections):
    the input enters the TP region once, so backward reduces their summed input gradient once
    instead of once per layer (under ``tp_comm_overlap``, one ring carries the input to all)."""
    if _overlapped(*layers):
        # Each layer hands out its weights through its own call, not by attribute: its forward
        # pre-hooks (the distributed optimizer's wait for the layer's parameter all-gather) run
        # before the ring reads them.
        weights, biases = zip(*(layer(x, weights_only=True) for layer in layers))
        return collective_matmul.all_gather_linear(x, layers[0].tp_group, list(weights), list(biases))
    x = enter_tp_region(x, layers[0].tp_group, layers[0].sequence_parallel)
    return tuple(layer(x, input_entered=True) for layer in layers)


class RowParallelLinear(nn.Module):
    """``y = x A^T + b`` with A split along its input columns: each rank holds a slice of x (the
    output of a column-parallel layer) and the partial products are summed over TP (or
    reduce-scattered along the sequence with sequence parallelism). The bias is added once, after
    the reduction. ``lora`` (``parallel.lora.RowLoRA``, or None): its partial sum joins the
    layer's before the one reduction. ``tp_comm_overlap``: under sequence parallelism, the
    reduce-scatter overlapped with the matmul."""

    def __init__(self, in_features: int, out_features: int, tp_group=None, *, bias: bool = True,
                 sequence_parallel: bool = False, tp_comm_overlap: bool = False,
                 dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.tp_group, self.sequence_parallel, self.tp_comm_overlap = tp_group, sequence_parallel, tp_comm_overlap
        self.in_features, self.out_features = in_features, out_features
        local_in = _shard(in_features, C.group_size(tp_group), "in_features")
        self.weight = tp_param((out_features, local_in), dtype, device, 1)
        self.bias = tp_param((out_features,), dtype, device, None, sequence_parallel) if bias else None
        self.lora: Optional[nn.Module] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _overlapped(self):
            y = collective_matmul.linear_reduce_scatter(x, self.weight, self.tp_group)
            return y if self.bias is None else y + self.bias
        y = add_adapter(F.linear(x, self.weight), self.lora, x)
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
    """``F.embedding(ids, table)``, through the kernels of the table's device (``kernels_for``)."""
    return kernels_for(table.device).lookup(ids, table)


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
    vocab-parallel ``weight`` (+ ``bias``); padded entries are -inf, so that the loss and sampled
    tokens do not depend on how much padding the layout needs. Computed by the kernels of the
    weight's device (``kernels_for``)."""
    x = enter_tp_region(hidden, tp_group, sequence_parallel)
    first_padded = vocab_size - C.group_rank(tp_group) * weight.shape[0]
    logits = kernels_for(weight.device).head(x.reshape(-1, x.shape[-1]), weight, bias, first_padded)
    return logits.view(*x.shape[:-1], weight.shape[0])


class StandardKernels:
    """The LM head and the embedding lookup as torch's own ops, for every device but a CPU (an
    accelerator, the dry run's stand-in): contiguous [tokens, vocab / tp] logits from ``F.linear``,
    ``F.embedding``, torch's own backward for both, no private torch API. The caching allocator of
    an accelerator already reuses the memory the CPU kernels reuse by hand."""

    @staticmethod
    def head(rows: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], first_padded: int) -> torch.Tensor:
        """Logits [tokens, vocab / tp] of ``rows`` [tokens, hidden], entries from ``first_padded`` on
        -inf. The mask is set in place outside autograd, on the matmul's own output before any view
        of it exists: the matmul keeps no output for backward, and the gradient reaching these
        entries is already zero (a softmax of -inf, never a target)."""
        logits = F.linear(rows, weight, bias)
        if first_padded < logits.shape[-1]:
            with torch.no_grad():
                logits[:, max(first_padded, 0):] = float("-inf")
        return logits

    lookup = staticmethod(F.embedding)


def kernels_for(device: torch.device):
    """The one device seam of the LM head and the embedding lookup: on a CPU, ``parallel.host_memory``
    (CPU-only custom nodes over memory reused across steps); on any other device, ``StandardKernels``.
    Both give the same values and gradients."""
    return host_memory if device.type == "cpu" else StandardKernels
