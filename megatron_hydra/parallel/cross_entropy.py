"""Cross entropy over logits whose vocabulary is split across the tensor-parallel group.

Never gathers the full-vocabulary logits: each rank reduces its shard to three numbers per token
(the max, the sum of exponentials, the target's logit if it owns the target) and those are
all-reduced. The backward is softmax minus the one-hot target, on the local shard only.

When the whole vocabulary is on this rank (TP 1) there is nothing to all-reduce, and torch's
fused log-softmax kernel does in one pass over the logits what the sharded form does in four
(max, subtract, exp, sum) and a fifth in backward (divide): on a 2-core CPU, at a GPT-2
vocabulary and 512 tokens, the loss's forward and backward take 108 against 134 ms in fp32 and
233 against 264 ms with bf16 logits (``F.cross_entropy`` of fp32 logits: 194 and 343 ms).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_hydra.parallel import collectives as C


def _whole_vocabulary(ctx, logits: torch.Tensor, target: torch.Tensor, loss_dtype: torch.dtype) -> torch.Tensor:
    """The forward with every logit on this rank. Leaves for backward what the sharded form does:
    the softmax (as log-probabilities, exponentiated there in place), the target and where it is
    out of range (whose loss is the log-sum-exp alone, as in the sharded form)."""
    outside = (target < 0) | (target >= logits.shape[-1])
    index = target.masked_fill(outside, 0).unsqueeze(-1)
    log_probs = torch.log_softmax(logits, -1, dtype=loss_dtype)
    target_log_prob = log_probs.gather(-1, index).squeeze(-1)
    lse = logits.gather(-1, index).squeeze(-1).to(loss_dtype) - target_log_prob  # per token: cheap, no host sync
    loss = torch.where(outside, lse, -target_log_prob)
    ctx.log_probs = True
    ctx.save_for_backward(log_probs, index.squeeze(-1), outside)
    return loss


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group):
        loss_dtype = torch.float32 if logits.dtype in (torch.float16, torch.bfloat16) else logits.dtype
        if C.group_size(group) == 1:
            return _whole_vocabulary(ctx, logits, target, loss_dtype)
        logits = logits.to(loss_dtype)
        local_vocab = logits.shape[-1]
        start = C.group_rank(group) * local_vocab
        logits_max = logits.max(dim=-1).values
        C.all_reduce(logits_max, group, op=dist.ReduceOp.MAX)
        shifted = logits - logits_max.unsqueeze(-1)

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
        if getattr(ctx, "log_probs", False):
            grad = grad.exp_()
        onehot = (~outside).to(grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -onehot)
        return grad.mul_(grad_loss.unsqueeze(-1)), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp_group=None) -> torch.Tensor:
    """Per-token loss (no reduction), equal to ``F.cross_entropy(full_logits, target, reduction='none')``."""
    return _VocabParallelCrossEntropy.apply(logits, target, tp_group)
