"""Global gradient-norm clipping across a model split over TP and PP ranks.

The norm is over the logical model, each parameter counted once: TP-sharded parameters contribute
their shard on every TP rank; TP-replicated ones only on TP rank 0; a pipeline stage's duplicate of
the tied embedding (``shared_embedding_copy``) not at all. The partial sums of squares are then
added over the model-parallel (tp x pp) group. Data-parallel replicas hold identical reduced
grads, so they need no further reduction.
"""

from __future__ import annotations

from typing import Iterable

import torch

from megatron_hydra.parallel import collectives as C
from megatron_hydra.parallel.state import ParallelState


def _counted(p: torch.nn.Parameter, ps: ParallelState) -> bool:
    if getattr(p, "shared_embedding_copy", False):
        return False
    return getattr(p, "tp_partition_dim", None) is not None or ps.tp_rank == 0


@torch.no_grad()
def clip_grad_norm(params: Iterable[torch.nn.Parameter], max_norm: float, ps: ParallelState) -> torch.Tensor:
    """Return the global grad norm; scale grads so it is at most ``max_norm`` (0: no clipping)."""
    params = [p for p in params if p.grad is not None]
    acc_dtype = torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32
    device = params[0].grad.device
    sq = torch.zeros((), dtype=acc_dtype, device=device)
    for p in params:
        if _counted(p, ps):
            sq += p.grad.to(acc_dtype).pow(2).sum()
    C.all_reduce(sq, ps.group("model"))
    norm = sq.sqrt()
    if max_norm > 0:
        coef = max_norm / (norm + 1e-6)
        if coef < 1:
            for p in params:
                p.grad.mul_(coef.to(p.grad.dtype))
    return norm
