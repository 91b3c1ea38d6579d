"""Model and optimizer state per rank under ``parallel.data_parallel=fsdp`` (``parallel.fsdp``).

FSDP shards every TP-local parameter along dim 0 over the D = dp x cp ranks: rank r holds rows
``[r c, (r + 1) c)`` with c = ceil(rows / D), in storage padded to c rows, so a rank's sharded
element count is S = sum over parameters of ceil(rows / D) x (numel / rows) (N / D when every row
count divides). What a rank holds from step to step (g = 4 for 16-bit models, else itemsize):

    weights        fp32/fp64: S x itemsize; 16-bit: 0 (the fp32 shards are the main weights)
    grads          S x g (the reduced shards)
    main weights   S x 4 for 16-bit models, else 0
    optimizer      2 x S x 4 (2 x S x 8 for float64)

and while a step runs, besides (``gathered``), unsharded copies in the compute dtype and grads in g:

    weights        pp = 1: the root unit (embeddings, final norm, output layer: gathered for the
                   whole step) + two blocks (the one running and the prefetched next); pp > 1:
                   every parameter of the rank (blocks stay gathered from a micro-batch's forward
                   to its backward, and some micro-batch is always in flight)
    grads          the root and one block when one backward reduces (one micro-batch, pp = 1);
                   else every parameter (micro-batches accumulate unsharded, reduced once after
                   the last)
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache
from typing import List, Optional, Tuple

import torch

from megatron_hydra.config.transformer_config import TransformerConfig

HALF = (torch.bfloat16, torch.float16)


@lru_cache(maxsize=None)
def _chunk_params(tcfg: TransformerConfig, num_layers: int, pre: bool, post: bool) -> tuple:
    from megatron_hydra.models.gpt import GPTModel
    from megatron_hydra.parallel.state import ParallelState

    model = GPTModel(tcfg, ParallelState.single(), layers=range(num_layers), pre_process=pre,
                     post_process=post, device="meta")
    return tuple((p.numel(), getattr(p, "tp_partition_dim", None), p.shape[0] if p.ndim else 1,
                  name.split(".")[1] if name.startswith("layers.") else None) for name, p in model.named_parameters())


def chunk_params(tcfg: TransformerConfig, num_layers: int, pre: bool, post: bool, tp: int) -> List[Tuple[int, int, Optional[str]]]:
    """(elements, rows, block or None for the root) of each parameter one TP rank holds of a chunk."""
    shape_only = dataclasses.replace(tcfg, sequence_parallel=False, hidden_dropout=0.0, attention_dropout=0.0,
                                     recompute_granularity=None, transformer_impl="local", fp8=None)
    out = []
    for numel, dim, rows, unit in _chunk_params(shape_only, num_layers, pre, post):
        if dim is not None:
            numel //= tp
            rows = rows // tp if dim == 0 else rows
        out.append((numel, rows, unit))
    return out


def sharded_elements(params: List[Tuple[int, int, Optional[str]]], d: int) -> int:
    """S: the elements a rank's FSDP shards hold, padding included."""
    return sum(-(-rows // d) * (numel // rows) if rows else 0 for numel, rows, _ in params)


def fsdp_state_bytes(params: List[Tuple[int, int, Optional[str]]], dtype: torch.dtype, d: int, pp: int,
                     num_microbatches: int) -> Tuple[int, int, int, int, int]:
    """(weights, grads, main weights, optimizer state, gathered) bytes of a rank holding ``params``
    (module docstring)."""
    item, grad_item = dtype.itemsize, 4 if dtype in HALF else dtype.itemsize
    shard = sharded_elements(params, d)
    total = sum(n for n, _, _ in params)
    root = sum(n for n, _, unit in params if unit is None)
    blocks = {}
    for n, _, unit in params:
        if unit is not None:
            blocks[unit] = blocks.get(unit, 0) + n
    block = max(blocks.values(), default=0)
    gathered_weights = total if pp > 1 else root + 2 * block
    unsharded_grads = total if pp > 1 or num_microbatches > 1 else root + block
    weights = 0 if dtype in HALF else shard * item
    main = shard * 4 if dtype in HALF else 0
    optimizer = 2 * shard * (8 if dtype == torch.float64 else 4)
    return weights, shard * grad_item, main, optimizer, gathered_weights * item + unsharded_grads * grad_item
