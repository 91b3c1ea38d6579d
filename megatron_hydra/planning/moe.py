"""The memory plan's Mixture-of-Experts arithmetic (``planning.memory`` calls it for ``model.moe``).

Parameters (exact). A pipeline rank's chunks are built on the meta device with their global layer
indices (``TransformerConfig.moe_layers`` names global layers) and this rank's E / ep experts per
MoE layer. Expert parameters (``parallel.data_parallel.is_expert``) sit in buckets of their own,
after the dense ones in the same flat buffer, reduced over the expert data-parallel group of
dp x cp / ep ranks; under the distributed optimizer each of those buckets is padded to a multiple
of that group's size and its shard is 1/(dp x cp / ep) of it. The plan lays the buffer out with
``parallel.data_parallel.split_layout``, the function the run's ``GradBuffer`` calls, so padding and
shards are the run's.
"""

from __future__ import annotations

from functools import lru_cache
from typing import List, Tuple

from megatron_hydra.config.derive import Derived
from megatron_hydra.config.schema import RunConfig
from megatron_hydra.config.transformer_config import TransformerConfig
from megatron_hydra.parallel.pipeline import stage_indices, stage_layers


class _Numel:
    """A parameter as ``split_layout`` sees it: its element count."""

    def __init__(self, n: int):
        self.n = n

    def numel(self) -> int:
        return self.n


def chunk_ranges(cfg: RunConfig, derived: Derived, pp_rank: int) -> List[range]:
    """Global layer indices of each model chunk of pipeline rank ``pp_rank`` (``rank_chunks``' order)."""
    per_stage = derived.layers_per_stage
    if derived.pp == 1:
        return [range(sum(per_stage))]
    stages = stage_indices(pp_rank, derived.pp, derived.vpp, cfg.parallel.pipeline_schedule)
    return [stage_layers(per_stage, s) for s in stages]


@lru_cache(maxsize=None)
def _chunk_params(tcfg: TransformerConfig, first: int, last: int, pre: bool, post: bool,
                  ep: int) -> Tuple[Tuple[int, bool, bool], ...]:
    from megatron_hydra.models.gpt import GPTModel
    from megatron_hydra.parallel.data_parallel import is_expert
    from megatron_hydra.parallel.state import AXES, ParallelState

    ps = ParallelState(sizes={**{a: 1 for a in AXES}, "dp": ep}, ep=ep)  # EP rank 0: E / ep experts
    model = GPTModel(tcfg, ps, layers=range(first, last), pre_process=pre, post_process=post, device="meta")
    return tuple((p.numel(), getattr(p, "tp_partition_dim", None) is not None, is_expert(p))
                 for p in model.parameters())


def chunk_params(tcfg: TransformerConfig, layers: range, pre: bool, post: bool, tp: int,
                 ep: int) -> List[Tuple[int, bool]]:
    """(elements on one TP rank, is an expert parameter) of a chunk's parameters, in model order."""
    from megatron_hydra.planning.memory import shape_only

    held = _chunk_params(shape_only(tcfg), layers.start, layers.stop, pre, post, ep)
    return [(n // tp if sharded else n, expert) for n, sharded, expert in held]


def flat_buffer(params: List[Tuple[int, bool]], bucket_size: int, dp: int, ep: int,
                distributed_optimizer: bool) -> Tuple[int, int]:
    """(padded length, this rank's shard) of the flat buffers, laid out as ``GradBuffer`` does:
    dense parameters reduced over ``dp`` (dp x cp) ranks, experts over dp / ep when ep > 1."""
    from megatron_hydra.parallel.data_parallel import split_layout

    ordered = list(reversed(params))  # the buffer runs in reverse order
    split = ep > 1
    dense = [_Numel(n) for n, expert in ordered if not (split and expert)]
    experts = [_Numel(n) for n, expert in ordered if split and expert]
    sizes = (dp, dp // ep)
    parts = [(members, size, size if distributed_optimizer else 1) for members, size in zip((dense, experts), sizes)]
    layout = split_layout(parts, bucket_size)
    if not distributed_optimizer:
        return layout[-1][2], layout[-1][2]
    return layout[-1][2], sum((end - start) // size for _, start, end, size in layout)


def rank_state(cfg: RunConfig, derived: Derived, pp_rank: int, chunks) -> Tuple[int, Tuple[int, int, int, int]]:
    """(parameters, (weights, grads, main weights, optimizer) bytes) of one rank of an MoE run."""
    from megatron_hydra.planning.memory import state_bytes

    tc = derived.transformer
    params = [p for (_, pre, post), layers in zip(chunks, chunk_ranges(cfg, derived, pp_rank))
              for p in chunk_params(tc, layers, pre, post, derived.tp, derived.ep)]
    numel = sum(n for n, _ in params)
    padded, shard = flat_buffer(params, cfg.parallel.grad_bucket_size, derived.dp * derived.cp, derived.ep,
                                cfg.optim.distributed_optimizer)
    return numel, state_bytes(numel, tc.params_dtype, shard, padded)
