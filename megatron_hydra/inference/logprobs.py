"""Log-probabilities and greedy choices from the LM head's vocabulary-parallel logits.

Each TP rank holds the logits of its slice of the vocabulary (padded entries -inf). Scoring
never gathers them: the log-sum-exp, the target's logit and the argmax are each reduced over the
TP group from per-slice values, so a rank holds [tokens, vocab / tp] at most, and every rank of
the group ends with the same numbers. All of it in float64, whatever the model's dtype.
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.distributed as dist

from megatron_hydra.parallel import collectives as C


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, tp_group) -> Tuple[torch.Tensor, torch.Tensor]:
    """log p(target) and whether the target is the argmax (the first most likely token, as
    ``torch.argmax`` picks it), per row of this rank's ``logits`` [n, vocab / tp] and the global
    token ids ``targets`` [n]."""
    x = logits.double()
    width = x.shape[-1]
    start = C.group_rank(tp_group) * width
    local_max, local_arg = x.max(dim=-1)
    top = C.all_reduce(local_max.clone(), tp_group, dist.ReduceOp.MAX)
    local = targets - start
    inside = (local >= 0) & (local < width)
    target_logit = x.gather(-1, local.clamp(0, width - 1).unsqueeze(-1)).squeeze(-1)
    sums = torch.stack([(x - top.unsqueeze(-1)).exp().sum(dim=-1), torch.where(inside, target_logit, 0.0)])
    sum_exp, target_logit = C.all_reduce(sums, tp_group)
    never = torch.iinfo(torch.long).max
    first_top = C.all_reduce(torch.where(local_max == top, local_arg + start, never), tp_group, dist.ReduceOp.MIN)
    return target_logit - top - sum_exp.log(), first_top == targets


def gathered_logits(logits: torch.Tensor, tp_group) -> torch.Tensor:
    """Every TP rank's vocabulary slice side by side: [..., padded vocab] (sampling needs them all)."""
    return C.all_gather(logits, -1, tp_group)
