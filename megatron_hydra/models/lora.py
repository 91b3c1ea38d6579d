"""LoRA on a model (``peft=lora``): which layers get adapters, the frozen base, adapters off.

Targets are our layers' logical names: ``qkv`` (the fused projection: q, k and v each get their own
adapter, as ``peft`` adapts q_proj, k_proj and v_proj), ``proj`` (attention's output), and the dense
MLP's ``fc1``, ``gate`` and ``fc2``. A block gets its adapters when it is built (``add_adapters``),
so they exist on every backend row that has these layers, at any layout, on the meta device like
the rest, and are initialised by ``models.init`` from their logical names
(``layers.3.attention.qkv.lora.a_q``, ``layers.3.mlp.fc2.lora.b``): A Kaiming-uniform, B zero.

``freeze_base`` turns off the gradient of every other parameter: the gradient buffer, the
optimizer, clipping and checkpoints then hold the adapters alone.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, List

from torch import nn

from megatron_hydra.config.transformer_config import TransformerConfig
from megatron_hydra.parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron_hydra.parallel.lora import ColumnLoRA, RowLoRA, is_adapter
from megatron_hydra.parallel.state import ParallelState

def _column(layer: ColumnParallelLinear, cfg: TransformerConfig, ps: ParallelState, segments, groups: int,
            device) -> ColumnLoRA:
    spec = cfg.lora
    return ColumnLoRA(layer.in_features, segments, groups, spec.rank, spec.scale, spec.dropout, ps.tp_group,
                      cfg.params_dtype, device)


def add_adapters(block: nn.Module, cfg: TransformerConfig, ps: ParallelState, device=None) -> None:
    """Give the target layers of ``block`` (a ``models.transformer.Block``) their adapters. A
    Mixture-of-Experts block has no dense MLP: only its attention is adapted."""
    spec = cfg.lora
    d = cfg.kv_channels
    layers = {"qkv": getattr(block.attention, "qkv", None), "proj": getattr(block.attention, "proj", None),
              "fc1": getattr(block.mlp, "fc1", None), "gate": getattr(block.mlp, "gate", None),
              "fc2": getattr(block.mlp, "fc2", None)}
    for target in spec.targets:
        layer = layers[target]
        if isinstance(layer, RowParallelLinear):
            layer.lora = RowLoRA(layer.in_features, layer.out_features, spec.rank, spec.scale, spec.dropout,
                                 ps.tp_group, cfg.params_dtype, device)
        elif isinstance(layer, ColumnParallelLinear) and target == "qkv":
            per_group = cfg.num_attention_heads // cfg.num_query_groups * d
            layer.lora = _column(layer, cfg, ps, (("q", per_group), ("k", d), ("v", d)), cfg.num_query_groups, device)
        elif isinstance(layer, ColumnParallelLinear):
            layer.lora = _column(layer, cfg, ps, (("", 1),), layer.out_features, device)


def adapters(model: nn.Module) -> List[nn.Module]:
    """Every adapter module of ``model``."""
    return [m for m in model.modules() if isinstance(m, (ColumnLoRA, RowLoRA))]


def freeze_base(model: nn.Module) -> nn.Module:
    """Every parameter of ``model`` but the adapters' stops requiring a gradient."""
    for p in model.parameters():
        if not is_adapter(p):
            p.requires_grad_(False)
    return model


@contextmanager
def adapters_off(models) -> Iterator[None]:
    """The base model: every adapter of ``models`` (a module or a list of them) off inside."""
    found = [a for m in (models if isinstance(models, (list, tuple)) else [models]) for a in adapters(m)]
    for a in found:
        a.enabled = False
    try:
        yield
    finally:
        for a in found:
            a.enabled = True
