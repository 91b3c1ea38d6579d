"""Layout-independent initialisation (Megatron's scheme).

Each parameter's full, logical tensor is drawn from a generator seeded by the run seed and the
parameter's logical name, then this rank keeps its TP shard. So the initial model is the same for
every tp, pp and dp, and adding a layer never changes the draws of the others. Rules:
weights normal(0, init_std); projections into the residual stream (attention.proj, mlp.fc2)
normal(0, init_std / sqrt(2 * num_layers)); biases zero; norm weights one. Vocabulary tables draw
only their ``vocab_size`` real rows; the padding rows (whose number depends on tp) are zero, so
the real rows are the same whatever the padding.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

from megatron_hydra.config.transformer_config import TransformerConfig
from megatron_hydra.models.backends import logical_parameters

OUTPUT_PROJECTIONS = ("attention.proj.weight", "mlp.fc2.weight")
# [padded_vocab, ...], vocab-parallel; BERT's masked-LM bias is one too (zero like every bias).
VOCAB_TABLES = ("embedding.weight", "output_weight", "lm_head.bias")


def _full_shape(local: torch.Tensor, dim, tp_size: int):
    shape = list(local.shape)
    if dim is not None:
        shape[dim] *= tp_size
    return shape


def logical_tensor(name: str, shape, cfg: TransformerConfig, seed: int) -> torch.Tensor:
    """The full initial value of parameter ``name`` (float32, on CPU)."""
    if name.endswith(".bias"):
        return torch.zeros(shape)
    if "norm" in name:
        return torch.ones(shape)
    std = cfg.output_init_std if name.endswith(OUTPUT_PROJECTIONS) else cfg.init_std
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    if name in VOCAB_TABLES:
        real = torch.randn([cfg.vocab_size, *shape[1:]], generator=gen) * std
        return torch.cat([real, real.new_zeros([shape[0] - cfg.vocab_size, *shape[1:]])])
    return torch.randn(shape, generator=gen) * std


@torch.no_grad()
def init_weights(model: nn.Module, cfg: TransformerConfig, seed: int, tp_rank: int, tp_size: int) -> None:
    for lp in logical_parameters(model):  # by logical name, whichever implementation holds them
        dim = getattr(lp.param, "tp_partition_dim", None)
        full = logical_tensor(lp.name, _full_shape(lp.tensor, dim, tp_size), cfg, seed)
        if dim is not None and tp_size > 1:
            full = full.chunk(tp_size, dim=dim)[tp_rank]
        lp.tensor.copy_(full.to(dtype=lp.tensor.dtype, device=lp.tensor.device))
