"""Global gradient-norm clipping across a model split over TP and PP ranks.

The norm is over the logical model, each parameter counted once: TP-sharded parameters contribute
their shard on every TP rank; TP-replicated ones only on TP rank 0; a pipeline stage's duplicate of
the tied embedding (``shared_embedding_copy``) not at all. The partial sums of squares are then
added over the model-parallel (tp x pp) group. Data-parallel replicas hold identical reduced
grads, so they need no further reduction.

Expert parameters (``data_parallel.is_expert``) are the exception: each rank of an
expert-parallel group holds different experts, so their partial sum (by the same TP rule: a
TP-sharded expert tensor on every TP rank, a TP-replicated one on TP rank 0) is first added over
the ep group. With the distributed optimizer each rank holds a disjoint slice of the dense grads
(over dp x cp) and of its experts' (over the expert data-parallel group); since dp x cp is the
expert data-parallel group times the ep group, one sum over dp x cp covers both. Whole experts
(``expert_tensor_parallel_size=1``) are held by different TP ranks: each rank counts its own, the
ep group's sum (which then spans TP ranks) is added on TP rank 0 only, and under the distributed
optimizer the sums over tp and dp x cp cover every rank of the stage once.

Nothing here reads a value on the host: the clip coefficient stays on the device and every step
multiplies by it, clamped to at most 1 (``x * 1.0 == x`` exactly in IEEE arithmetic, NaN and inf
included), so a GPU run never waits here for the norm.
"""

from __future__ import annotations

from typing import Iterable, List, Optional

import torch

from megatron_hydra.parallel import collectives as C
from megatron_hydra.parallel.data_parallel import is_expert, main_grad
from megatron_hydra.parallel.state import ParallelState


def counted(p: torch.nn.Parameter, ps: ParallelState) -> bool:
    """Whether this rank's copy of ``p`` adds to the global norm (each logical element once).
    Whole experts (not split over TP) differ between TP ranks: every rank counts its own (their
    sum over the EP group is then added once per TP group, ``clip_grads``)."""
    if getattr(p, "shared_embedding_copy", False):
        return False
    if is_expert(p) and not ps.experts_split_over_tp:
        return True
    return getattr(p, "tp_partition_dim", None) is not None or ps.tp_rank == 0


@torch.no_grad()
def clip_grads(grads: List[torch.Tensor], counts: List[bool], max_norm: float, ps: ParallelState,
               sharded_over_dp: bool = False, experts: Optional[List[bool]] = None) -> torch.Tensor:
    """Return the global norm of ``grads`` (those with ``counts`` true contribute); scale all of
    them so it is at most ``max_norm`` (0: no clipping). ``sharded_over_dp``: each data-parallel
    rank holds a disjoint part of the grads (the distributed optimizer), so partial sums are added
    over the data-parallel group too. ``experts``: which grads are of expert parameters (their
    partial sum is added over the expert-parallel group; see the module docstring)."""
    acc_dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    sq = torch.zeros((), dtype=acc_dtype, device=grads[0].device)
    whole = not ps.experts_split_over_tp
    over_ep = (experts is not None and any(experts) and not sharded_over_dp
               and (C.group_size(ps.ep_group) > 1 or whole))
    expert_sq = torch.zeros_like(sq) if over_ep else sq
    for i, (g, c) in enumerate(zip(grads, counts)):
        if c:
            (expert_sq if over_ep and experts[i] else sq).add_(g.to(acc_dtype).pow(2).sum())
    if over_ep:
        C.all_reduce(expert_sq, ps.ep_group)
        if not whole or ps.tp_rank == 0:  # whole experts: the EP group's sum covers the TP group's
            sq += expert_sq
    C.all_reduce(sq, ps.group("model"))
    if sharded_over_dp:
        C.all_reduce(sq, ps.dp_cp_group)
    norm = sq.sqrt()
    if max_norm > 0:
        coef = max_norm / (norm + 1e-6)
        # Where coef < 1 this is coef; else (coef >= 1, or NaN from a NaN norm) exactly 1.
        coef = torch.where(coef < 1, coef, torch.ones_like(coef))
        by_dtype = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for dtype, same in by_dtype.items():
            torch._foreach_mul_(same, coef.to(dtype))
    return norm


def clip_grad_norm(params: Iterable[torch.nn.Parameter], max_norm: float, ps: ParallelState) -> torch.Tensor:
    """``clip_grads`` over the (buffered) gradients of ``params``."""
    params = [p for p in params if main_grad(p) is not None]
    return clip_grads([main_grad(p) for p in params], [counted(p, ps) for p in params], max_norm, ps,
                      experts=[is_expert(p) for p in params])
