"""The layers a Transformer block is built from, per ``model.transformer_impl``.

Megatron-Core's idea of a layer spec, kept to a table of classes: ``local`` is plain torch on our
tensor-parallel layers (``models.transformer``), ``transformer_engine`` is NVIDIA Transformer
Engine's fused layers (``models.te_layers``). A model passes ``backend_for(cfg)`` to its
``TransformerStack``; ``Block`` and ``TransformerStack`` are otherwise the same code for both.

Both implementations hold the same logical tensors under the same names: a backend's
``parameter_map`` says which local parameters each of its parameters holds (stacked along dim 0),
and ``logical_parameters`` lists a model's parameters under those logical names. Initialisation
and checkpoints go through it, so one checkpoint loads under either implementation.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Dict, List, NamedTuple, Optional

import torch
from torch import nn

from megatron_hydra.config.transformer_config import TransformerConfig
from megatron_hydra.models import te_layers
from megatron_hydra.models.moe import build_moe, local_experts
from megatron_hydra.models.transformer import LOCAL, Backend

BACKENDS: Dict[str, Backend] = {
    "local": replace(LOCAL, moe=build_moe),
    "transformer_engine": Backend("transformer_engine", te_layers.build_norm, te_layers.fused_norm,
                                  te_layers.TEAttention, te_layers.TEMLP, te_layers.parameter_map,
                                  te_layers.SequenceFirst),
}


def backend_for(cfg: TransformerConfig) -> Backend:
    return BACKENDS[cfg.transformer_impl]


class LogicalParameter(NamedTuple):
    name: str  # the logical name (the local implementation's)
    tensor: torch.Tensor  # this rank's shard of the logical tensor: ``param`` itself, or rows of it
    param: nn.Parameter  # the parameter holding it (optimizer state, TP tags)
    rows: Optional[slice]  # where in ``param`` (dim 0); None: all of it
    tp_dim: Optional[int] = None  # the dim of ``tensor`` split over TP (None: replicated)


def logical_parameters(model: nn.Module) -> List[LogicalParameter]:
    """``model``'s parameters under their logical names, one entry per logical tensor. A
    parameter that holds several gives one row range each: a TE fc1 with SwiGLU's gate and up, or
    an MoE layer's stacked experts (one logical tensor per expert, named by its global index:
    ``models.moe.local_experts``). Views, so that writing them writes the parameter."""
    out = []
    for name, p in model.named_parameters():
        tag, tp_dim = getattr(p, "logical", None), getattr(p, "tp_partition_dim", None)
        if getattr(p, "expert_parallel", False):
            out += [LogicalParameter(logical, view, p, slice(i, i + 1), dim)
                    for i, (logical, view, dim) in enumerate(local_experts(name, p))]
            continue
        if tag is None:
            out.append(LogicalParameter(name, p, p, None, tp_dim))
            continue
        own, parts = tag
        prefix = name[: len(name) - len(own)]
        if len(parts) == 1:
            out.append(LogicalParameter(prefix + parts[0], p, p, None, tp_dim))
            continue
        rows = p.shape[0] // len(parts)
        for i, part in enumerate(parts):
            span = slice(i * rows, (i + 1) * rows)
            out.append(LogicalParameter(prefix + part, p.detach()[span], p, span, tp_dim))
    return out
