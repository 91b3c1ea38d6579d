"""The byte rules the memory plan's modules share (``planning.memory``, ``planning.moe``): what a
rank's parameters and their optimizer state take, and the config reduced to what shapes them."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from megatron_hydra.config.transformer_config import TransformerConfig

HALF = (torch.bfloat16, torch.float16)
GATED_ACTIVATIONS = ("swiglu", "geglu")


def state_bytes(numel: int, dtype: torch.dtype, shard: Optional[int] = None, padded: Optional[int] = None,
                frozen: int = 0):
    """(weights, grads, main weights, optimizer state) bytes of ``numel`` trained parameters on one
    rank. ``shard``: the elements this rank's optimizer owns (distributed optimizer; default all);
    ``padded``: the length of the flat buffers when padded for sharding (default ``numel``);
    ``frozen``: elements that do not train (LoRA's base, ``planning.frozen``), weights alone."""
    item = dtype.itemsize
    shard = numel if shard is None else shard
    length = numel if padded is None else padded
    weights = (length + frozen) * item
    grads = length * (4 if dtype in HALF else item)
    main = shard * 4 if dtype in HALF else 0
    optimizer = 2 * shard * (8 if dtype == torch.float64 else 4)
    return weights, grads, main, optimizer


def shape_only(tcfg: TransformerConfig) -> TransformerConfig:
    """``tcfg`` with what does not change the logical tensors reset (a cache key for the builds)."""
    return dataclasses.replace(tcfg, sequence_parallel=False, hidden_dropout=0.0, attention_dropout=0.0,
                               recompute_granularity=None, recompute_method="uniform", recompute_num_layers=1,
                               transformer_impl="local", fp8=None, context_parallel_size=1, cp_comm_type="p2p",
                               sliding_window=None, window_layers=(), attn_logit_softcapping=None,
                               final_logit_softcapping=None)


def buffer_bytes(model: torch.nn.Module) -> int:
    """Bytes of a (meta) model's buffers: what a rank holds besides parameters from its start."""
    return sum(b.numel() * b.element_size() for b in model.buffers())
