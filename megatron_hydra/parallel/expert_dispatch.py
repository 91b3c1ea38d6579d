"""Moving token copies to their experts and back: permute, exchange over expert parallelism, combine.

A rank's tokens ``x`` [T, h] with their routing (``indices``, ``weights``: [T, k]) make T*k
assignments (token t's j-th choice is assignment ``t * k + j``). ``plan`` sorts the kept
assignments by expert; the experts of EP rank ``r`` are ``[r * E_local, (r + 1) * E_local)``, so
that order is also by destination rank. ``dispatch`` gathers the token rows in that order and
sends each EP rank its part in one all-to-all with uneven splits (the counts are exchanged first,
so that each rank knows what it receives); the received rows (by source rank, then local expert)
are reordered by local expert, so each local expert's tokens are one contiguous slice.
``combine`` undoes both moves and adds ``weight * expert output`` into each token's row. Every
step is differentiable: gathers backward into scatter-adds and the exchange's backward is the
reverse exchange.

Balanced routing (``balanced_counts``) is the memory plan's assumption: each expert receives
``T * k / E`` of a rank's ``T * k`` assignments (the first ``T * k mod E`` experts one more; at most
``capacity`` each). The dry run, whose tensors hold no values, plans with it (``training.fake_gpu``).

Capacity (``capacity_factor``): each expert takes at most ``capacity`` of one rank's assignments;
among those routed to it, the ones with the highest routing weight are kept (ties: the earlier
token), the rest are dropped: they add nothing to their token's output (the other choices keep
their weights, not renormalised). Dropping is decided on each rank from its own tokens before
the exchange, so it needs no communication.
"""

from __future__ import annotations

import math
from typing import List, NamedTuple, Optional

import torch

from megatron_hydra.parallel import collectives as C


def capacity(num_tokens: int, top_k: int, num_experts: int, factor: float) -> int:
    """Assignments one expert takes from one rank: ``ceil(factor * tokens * top_k / experts)``."""
    return math.ceil(factor * num_tokens * top_k / num_experts)


class Plan(NamedTuple):
    """How this rank's kept assignments travel (all index tensors on the tokens' device)."""

    assignments: torch.Tensor  # [N] kept assignment ids (t * k + j), sorted by expert
    tokens: torch.Tensor  # [N] their token ids
    send_splits: List[int]  # rows sent to each EP rank
    recv_splits: List[int]  # rows received from each EP rank
    expert_counts: List[int]  # rows each local expert computes (all sources)
    to_expert_order: Optional[torch.Tensor]  # received rows (by source) -> by local expert; None at ep 1
    to_source_order: Optional[torch.Tensor]  # its inverse
    dropped: int  # assignments dropped by capacity


def balanced_counts(num_assignments: int, num_experts: int, cap: Optional[int] = None) -> List[int]:
    """Assignments per expert under balanced routing (the dry run's and the memory plan's assumption)."""
    base, extra = divmod(num_assignments, num_experts)
    counts = [base + (e < extra) for e in range(num_experts)]
    return counts if cap is None else [min(n, cap) for n in counts]


def expert_counts(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``bincount(experts, minlength=num_experts)``."""
    return torch.bincount(experts.reshape(-1), minlength=num_experts)


def _within_capacity(experts: torch.Tensor, weights: torch.Tensor, num_experts: int, cap: int) -> torch.Tensor:
    """Assignment ids sorted by expert, each expert's cut to its ``cap`` highest weights."""
    by_weight = torch.argsort(weights, descending=True, stable=True)
    order = by_weight[torch.argsort(experts[by_weight], stable=True)]
    counts = torch.bincount(experts, minlength=num_experts)
    starts = torch.cumsum(counts, 0) - counts
    place = torch.arange(order.numel(), device=order.device) - starts[experts[order]]
    return order[place < cap]


def plan(indices: torch.Tensor, weights: torch.Tensor, num_experts: int, group,
         cap: Optional[int] = None) -> Plan:
    """The plan for routing ``indices`` / ``weights`` ([T, k]) over EP ``group`` (None or size 1:
    every expert is local). Collective over the group (the count exchange) and one host sync."""
    k = indices.shape[1]
    experts = indices.reshape(-1)
    if cap is None:
        kept = torch.argsort(experts, stable=True)
        counts = torch.bincount(experts, minlength=num_experts)
    else:
        kept = _within_capacity(experts, weights.detach().reshape(-1), num_experts, cap)
        counts = torch.bincount(experts[kept], minlength=num_experts)
    ep = C.group_size(group)
    local = num_experts // ep
    received = C.all_to_all(counts, group, kind="ep_a2a").view(ep, local)  # [source, local expert]
    sent_host, received_host = torch.stack([counts.view(ep, local), received]).tolist()
    to_expert = to_source = None
    if ep > 1:
        block = torch.arange(ep * local, device=indices.device).repeat_interleave(received.reshape(-1))
        to_expert = torch.argsort((block % local) * ep + block // local, stable=True)
        to_source = torch.empty_like(to_expert)
        to_source[to_expert] = torch.arange(to_expert.numel(), device=indices.device)
    return Plan(kept, kept // k, [sum(r) for r in sent_host], [sum(r) for r in received_host],
                [sum(r[e] for r in received_host) for e in range(local)], to_expert, to_source,
                experts.numel() - kept.numel())


class _AllToAll(torch.autograd.Function):
    """Uneven all-to-all; its adjoint is the same exchange with the splits swapped."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return C.all_to_all_uneven(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return C.all_to_all_uneven(grad, input_splits, output_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, output_splits: List[int], input_splits: List[int], group) -> torch.Tensor:
    return x if C.group_size(group) == 1 else _AllToAll.apply(x, output_splits, input_splits, group)


def dispatch(x: torch.Tensor, p: Plan, group) -> torch.Tensor:
    """This EP rank's expert inputs [sum(p.expert_counts), h], local expert by local expert."""
    received = all_to_all(x.index_select(0, p.tokens), p.recv_splits, p.send_splits, group)
    return received if p.to_expert_order is None else received.index_select(0, p.to_expert_order)


def combine(y: torch.Tensor, p: Plan, weights: torch.Tensor, num_tokens: int, group) -> torch.Tensor:
    """``out[t] = sum_j weights[t, j] * y(assignment t*k+j)`` over the kept assignments, [T, h],
    from the expert outputs ``y`` (``dispatch``'s order). Weighted and summed in the wider of
    y's and the weights' dtypes (the router's fp32 with bf16 experts), as Megatron does."""
    if p.to_source_order is not None:
        y = y.index_select(0, p.to_source_order)
    back = all_to_all(y, p.send_splits, p.recv_splits, group)
    back = back * weights.reshape(-1).index_select(0, p.assignments).unsqueeze(-1)
    return back.new_zeros(num_tokens, back.shape[-1]).index_add(0, p.tokens, back)
