"""Fully sharded data parallelism (``parallel.data_parallel=fsdp``) through torch's FSDP2.

What it shards. Every parameter, its gradient and the optimizer state are split over the
data-parallel (dp x cp) group, ZeRO-3 style. Our tensor-parallel layers hold plain tensors (this
TP rank's shard) and do their own collectives over the TP group, so FSDP sees an ordinary module:
it splits each TP-local tensor along dim 0 over the data-parallel ranks (``Shard(0)`` on the
``dp`` dimension of ``ParallelState.mesh``) and all-gathers it before the module that owns it runs.

Units. Each transformer block is one ``fully_shard`` unit (its parameters are gathered together,
one block at a time, and the next block's gather is prefetched); the model chunk is the root
unit and takes everything else (embeddings, final norm, output layer). The tied output layer
reads the embedding's weight outside the embedding's forward, which is why the embedding is not
a unit of its own: the root's parameters stay gathered for the whole forward of the chunk.
A pipeline rank's chunks are separate roots.

Precision. The sharded parameters FSDP keeps are the optimizer's main weights: fp32 for a 16-bit
model (the model's 16-bit values, widened), computed in 16 bits through ``param_dtype`` and
reduced in fp32 (``reduce_dtype``), as the ``ddp`` path keeps fp32 main weights and reduces in
fp32. fp32 and fp64 models compute, reduce and update in their own dtype.

Gradient reduction equals the ``ddp`` path's: grads are summed over the group, then divided by
its size (``set_force_sum_reduction_for_comms``, rather than FSDP's default of averaging inside
the collective). Micro-batches other than the last accumulate unsharded and unreduced
(``set_requires_gradient_sync(False)``); the pipeline schedule reduces once after all of them
(``finish_backward``).

Tags. FSDP replaces each parameter by a new ``nn.Parameter`` holding a ``DTensor``; the tags our
layers put on parameters (``TAGS``) are copied onto it, so clipping, the pipeline's tied
embedding and checkpoints read them as before. ``local_rows`` says which rows of the TP-local
tensor this rank holds.
"""

from __future__ import annotations

from typing import Iterable, List, Sequence, Tuple

import torch
from torch import nn

from megatron_hydra.parallel.state import DP_CP_MESH, ParallelState

# Attributes our code reads from parameters (parallel.layers, models.transformer): how a
# parameter relates to its logical tensor.
TAGS = ("tp_partition_dim", "sequence_parallel", "shared_embedding", "shared_embedding_copy", "logical")
HALF_DTYPES = (torch.bfloat16, torch.float16)


def is_sharded(p: torch.Tensor) -> bool:
    """Whether ``p`` is an FSDP-sharded parameter (a ``DTensor``)."""
    from torch.distributed.tensor import DTensor

    return isinstance(p, DTensor)


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: the local tensor of a ``DTensor`` (sharing its storage, so
    writing it writes the parameter or gradient), ``t`` itself otherwise."""
    return t._local_tensor if is_sharded(t) else t


def local_rows(param: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """``(rows, r0)``: the rows of the TP-local tensor this rank holds, ``[r0, r0 + len(rows))``
    along dim 0, and ``r0``. FSDP gives rank r the rows ``[r * c, min((r + 1) * c, n))`` with
    ``c = ceil(n / dp)`` (its ``torch.chunk``), so the last ranks may hold fewer rows, or none (an
    empty tensor); its padding is not part of ``rows``. A parameter not sharded by FSDP: all of
    it, from row 0."""
    if not is_sharded(param):
        return param, 0
    rows = param._local_tensor
    mesh = param.device_mesh
    n, size, rank = param.shape[0], mesh.size(), mesh.get_local_rank()
    chunk = -(-n // size) if n else 0
    return rows, min(rank * chunk, n)


def mixed_precision(dtype: torch.dtype):
    """FSDP's precision policy for a model whose parameters are ``dtype``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if dtype in HALF_DTYPES:
        return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)


def dp_mesh(ps: ParallelState):
    """The one-dimensional mesh of the data-parallel (dp x cp) group: the ``dp`` dimension of
    ``ps.mesh``, or its ``dp`` and ``cp`` dimensions flattened into one under context parallelism
    (cp ranks hold the same weights, so parameters shard over both; ``ParallelState.build``
    flattens them, torchtitan's way). (A mesh built anew from the
    group would not do in the dry run: building one computes on tensors, which are fake there.)"""
    return ps.mesh["dp"] if ps.sizes["cp"] == 1 else ps.mesh[DP_CP_MESH]


def _tags(module: nn.Module) -> dict:
    return {name: {k: getattr(p, k) for k in TAGS if hasattr(p, k)} for name, p in module.named_parameters()}


def shard_chunks(chunks: Sequence[nn.Module], layers: Sequence[Sequence[nn.Module]], ps: ParallelState,
                 dtype: torch.dtype, reshard_after_forward: bool = True) -> List[nn.Module]:
    """Apply FSDP2 to each model chunk in place: every module of ``layers[i]`` (chunk i's
    transformer blocks) a unit, the chunk the root. 16-bit parameters are widened to fp32 first
    (they become the main weights). ``reshard_after_forward=False`` keeps each block gathered from
    its forward to its backward (no second all-gather: pipeline parallelism, where many
    micro-batches are in flight). Returns the chunks (now ``FSDPModule`` subclasses)."""
    from torch.distributed.fsdp import fully_shard

    mesh = dp_mesh(ps)
    policy = mixed_precision(dtype)
    for chunk, blocks in zip(chunks, layers):
        tags = _tags(chunk)
        if dtype in HALF_DTYPES:
            for p in chunk.parameters():
                p.data = p.data.float()
        for block in blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
        # The root's parameters are needed again at the start of backward: keep them gathered.
        fully_shard(chunk, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
        for unit in [*blocks, chunk]:
            unit.set_force_sum_reduction_for_comms(True)
        for name, p in chunk.named_parameters():
            for key, value in tags[name].items():
                setattr(p, key, value)
    return list(chunks)


def fsdp_modules(modules: Iterable[nn.Module]) -> List[nn.Module]:
    """Every FSDP unit within ``modules``."""
    from torch.distributed.fsdp import FSDPModule

    return [m for root in modules for m in root.modules() if isinstance(m, FSDPModule)]


def set_gradient_sync(modules: Iterable[nn.Module], enabled: bool) -> None:
    """Whether the next backward reduce-scatters (the last micro-batch) or only accumulates."""
    for m in fsdp_modules(modules):
        m.set_requires_gradient_sync(enabled, recurse=False)


def finish_backward(chunks: Iterable[nn.Module]) -> None:
    """Reduce-scatter what backward accumulated with gradient sync off (a pipeline schedule runs
    every micro-batch's backward so), and reshard: afterwards every sharded parameter's ``.grad``
    holds the reduced gradient. What torch's pipeline stage does for an FSDP stage module
    (``perform_reduce_grad``); our stage modules wrap the chunk, so it is done here."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    for chunk in chunks:
        if not isinstance(chunk, FSDPModule):
            continue
        chunk.set_is_last_backward(True)
        chunk.set_requires_gradient_sync(True)
        chunk.set_reshard_after_backward(True)
        state = fully_shard.state(chunk)
        for unit_state in state._state_ctx.all_states:
            for group in unit_state._fsdp_param_groups:
                group.post_backward()
        state._root_post_backward_final_callback()


def sharded_bytes(modules: Iterable[nn.Module]) -> int:
    """Bytes of parameters this rank holds (local shards of FSDP parameters)."""
    return sum(local_shard(p).numel() * local_shard(p).element_size() for m in modules for p in m.parameters())
