"""Low-rank adapters (LoRA, Hu et al. 2021) beside the tensor-parallel linear layers.

An adapter adds ``scale * B A drop(x)`` to its layer's output, with A [rank, in] and B [out, rank].
It shards with its layer, so that no collective of its own is needed:

- column-parallel layer (output split over TP): A is replicated and B split along the output like
  the weight. Every rank reads the whole (entered) input, so ``A x`` is the same on all of them; the
  input's gradient is reduced by the layer's own ``enter_tp_region``. A's gradient is partial per
  rank (each rank's slice of B contributes a part): it is summed over TP, as a sequence-parallel
  norm's is (``sequence_parallel`` tag, ``data_parallel.allreduce_sequence_parallel_grads``).
- row-parallel layer (input split over TP): A is split along the input like the weight and B
  replicated. ``B (A_r x_r)`` is a partial sum like the layer's own product, so it is added before
  the layer's reduction (all-reduce, or reduce-scatter under sequence parallelism) and rides on it.
  B's gradient, formed from a partial ``A_r x_r``, is summed over TP.

A column-parallel layer whose output interleaves several projections per query group (the fused
QKV: per group [q heads, k, v]) gets one adapter per projection (``segments``), as ``peft`` adapts
q_proj, k_proj and v_proj separately: each B_i covers its projection's rows of every group and is
split by groups like the weight, and the outputs are interleaved back into the layer's layout. The
A_i read the same input, so they run as one matmul.

Adapters hold their parameters tagged like the layers' (``tp_partition_dim``) and with ``lora``;
``enabled = False`` turns one off (DPO's reference model is the base, adapters off).
"""

from __future__ import annotations

from functools import partial
from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from megatron_hydra.parallel import collectives as C
from megatron_hydra.parallel.random import dropout


def adapter_param(shape, dtype, device, partition_dim: Optional[int], summed_over_tp: bool = False) -> nn.Parameter:
    """An uninitialised adapter parameter, tagged as the layers tag theirs and as an adapter."""
    p = nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
    p.tp_partition_dim = partition_dim
    p.sequence_parallel = summed_over_tp and partition_dim is None
    p.lora = True
    return p


def is_adapter(p: torch.Tensor) -> bool:
    return getattr(p, "lora", False)


def is_down_projection(name: str) -> bool:
    """Whether the adapter tensor ``name`` (``...lora.a``, ``...lora.a_q``) is an A, the matrix
    that reads the layer's input; else it is a B (``...lora.b``, ``...lora.b_q``)."""
    return name.rpartition(".")[2].startswith("a")


def _local(size: int, tp: int, what: str) -> int:
    if size % tp:
        raise ValueError(f"{what}={size} is not divisible by the tensor-parallel size {tp}")
    return size // tp


class ColumnLoRA(nn.Module):
    """The adapter of a column-parallel layer of ``groups`` output groups, each the concatenation
    of ``segments`` ((name, rows per group), ...); a plain layer is ``groups=out_features`` with
    one unnamed segment of one row. Parameters: ``a`` and ``b`` (one segment), else ``a_<name>``
    and ``b_<name>`` per segment; logically A [rank, in] and B [groups * rows, rank]."""

    def __init__(self, in_features: int, segments: Sequence[Tuple[str, int]], groups: int, rank: int, scale: float,
                 p_dropout: float, tp_group, dtype: torch.dtype, device=None):
        super().__init__()
        self.rank, self.scale, self.p_dropout, self.enabled = rank, scale, p_dropout, True
        self.local_groups = _local(groups, C.group_size(tp_group), "output groups")
        self.rows = [rows for _, rows in segments]
        self.names = [name for name, _ in segments]
        for name, rows in segments:
            suffix = f"_{name}" if name else ""
            self.register_parameter("a" + suffix, adapter_param((rank, in_features), dtype, device, None, True))
            self.register_parameter("b" + suffix, adapter_param((self.local_groups * rows, rank), dtype, device, 0))

    def pairs(self):
        """(A, B) of each segment, in segment order."""
        return [(getattr(self, "a" + (f"_{n}" if n else "")), getattr(self, "b" + (f"_{n}" if n else "")))
                for n in self.names]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The adapter's share of the layer's output slice, from the layer's entered input."""
        pairs = self.pairs()
        drop = partial(dropout, p=self.p_dropout, training=self.training, sharded=False)  # x: the same on every TP rank
        if len(pairs) == 1:
            a, b = pairs[0]
            return F.linear(F.linear(drop(x), a), b) * self.scale
        if self.training and self.p_dropout > 0:  # each projection its own mask, as peft's q, k, v adapters
            h = torch.cat([F.linear(drop(x), a) for a, _ in pairs], dim=-1)
        else:
            h = F.linear(x, torch.cat([a for a, _ in pairs]))  # every segment's A x in one matmul
        lead = h.shape[:-1]
        outs = [F.linear(h[..., i * self.rank:(i + 1) * self.rank], b).view(*lead, self.local_groups, rows)
                for i, ((_, b), rows) in enumerate(zip(pairs, self.rows))]
        return torch.cat(outs, dim=-1).flatten(-2) * self.scale


class RowLoRA(nn.Module):
    """The adapter of a row-parallel layer: A [rank, in] split along the input, B [out, rank]
    replicated; ``forward`` gives this rank's partial sum, which the layer reduces with its own."""

    def __init__(self, in_features: int, out_features: int, rank: int, scale: float, p_dropout: float, tp_group,
                 dtype: torch.dtype, device=None):
        super().__init__()
        self.rank, self.scale, self.p_dropout, self.enabled = rank, scale, p_dropout, True
        local_in = _local(in_features, C.group_size(tp_group), "in_features")
        self.a = adapter_param((rank, local_in), dtype, device, 1)
        self.b = adapter_param((out_features, rank), dtype, device, None, True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = dropout(x, self.p_dropout, self.training, sharded=True)  # this rank's slice of the input
        return F.linear(F.linear(x, self.a), self.b) * self.scale


def add_adapter(y: torch.Tensor, adapter: Optional[nn.Module], x: torch.Tensor) -> torch.Tensor:
    """``y`` plus ``adapter``'s output for input ``x`` when there is one and it is on."""
    if adapter is None or not adapter.enabled:
        return y
    return y + adapter(x)
