"""Cross entropy over logits whose vocabulary is split across the tensor-parallel group.

Never gathers the full-vocabulary logits: each rank reduces its shard to three numbers per token
(the max, the sum of exponentials, the target's logit if it owns the target) and those are
all-reduced. The backward is softmax minus the one-hot target, on the local shard only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_hydra.parallel import collectives as C


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group, inplace: bool):
        copied = logits.dtype in (torch.float16, torch.bfloat16)
        logits = logits.float() if copied else logits
        local_vocab = logits.shape[-1]
        start = C.group_rank(group) * local_vocab
        logits_max = logits.amax(dim=-1)
        C.all_reduce(logits_max, group, op=dist.ReduceOp.MAX)
        # The softmax is built in place in this function's own fp32 copy of 16-bit logits, or in the
        # caller's logits when it hands them over (``inplace``); else in one new tensor.
        shifted = logits.sub_(logits_max.unsqueeze(-1)) if copied or inplace else logits - logits_max.unsqueeze(-1)

        local_target = target - start
        outside = (local_target < 0) | (local_target >= local_vocab)
        local_target = local_target.masked_fill(outside, 0)
        predicted = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        C.all_reduce(predicted, group)

        exp = shifted.exp_()  # in place: [tokens, vocab / tp] is the largest activation of the model
        sum_exp = exp.sum(dim=-1)
        C.all_reduce(sum_exp, group)
        loss = sum_exp.log() - predicted

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        # The saved softmax becomes the gradient in place (backward runs once; Megatron does the same).
        grad, local_target, outside = ctx.saved_tensors
        onehot = (~outside).to(grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -onehot)
        return grad.mul_(grad_loss.unsqueeze(-1)), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp_group=None, *,
                                 inplace: bool = False) -> torch.Tensor:
    """Per-token loss (no reduction), equal to ``F.cross_entropy(full_logits, target, reduction='none')``.

    ``inplace``: the caller hands its fp32 (or fp64) logits over and never reads them again; they
    become the softmax, saving a [tokens, vocab / tp] tensor (Megatron's loss always does this).
    The models' heads pass their logits this way. Logits autograd saved for a backward cannot be
    handed over (autograd refuses that backward). 16-bit logits are never written: the loss works
    in its own fp32 copy of them either way."""
    return _VocabParallelCrossEntropy.apply(logits, target, tp_group, inplace)
