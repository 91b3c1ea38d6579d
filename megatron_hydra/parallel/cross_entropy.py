"""Cross entropy over logits whose vocabulary is split across the tensor-parallel group.

Never gathers the full-vocabulary logits: each rank reduces its shard to three numbers per token
(the max, the sum of exponentials, the target's logit if it owns the target) and those are
all-reduced. The backward is softmax minus the one-hot target, on the local shard only.

fp32 and fp64 logits: the exponentials (of the logits less their max) are taken in one
[tokens, vocab / tp] tensor, the caller's logits themselves when it hands them over, and saved for
backward, where they become the gradient in place: one multiplication by grad / sum per token
(the softmax's division folded in), then the target's entry less grad.
16-bit logits: the exponentials are taken in fp32 in slices of the vocabulary (``CHUNK_ELEMENTS``
entries each, or 1/``MAX_SLICES`` of the shard where that is more, in one buffer). Handed-over bf16
logits are overwritten by their exponentials, which backward scales, slice by slice, in fp32;
otherwise backward recomputes them from the saved logits. Either way it writes the gradient in the
logits' dtype: over them when the caller handed them over (each slice is read before it is
written), else into a new tensor. So the loss keeps 2 bytes an entry instead of an fp32 softmax (4),
and never allocates an fp32 copy of the whole logits (on a CPU each such fresh allocation also
faults its pages in anew). The slices' sums add in another order than one sum over the shard: the
loss moves by an fp32 rounding. A stored bf16 exponential is rounded once more than a recomputed
one, so each gradient entry is within two bf16 roundings (2^-7 relative) instead of one (2^-8),
plus, in either form, fp32's absolute 2^-23 grad in p - 1 where a target's p is near 1. The stored
rounding never cancels in p - 1: the largest logit's exponential is exactly 1, so either the target
is that one (its exponential exact) or p <= 1/2.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_hydra.parallel import collectives as C

# Entries of the fp32 slice of 16-bit logits (16 MiB), one buffer per pass reused by every slice;
# wider where that would take more than MAX_SLICES slices (long micro-batches: each slice is a dozen
# kernel launches on a GPU).
CHUNK_ELEMENTS = 1 << 22
MAX_SLICES = 64


def vocab_chunks(local_vocab: int, tokens: int):
    """The [start, stop) vocabulary slices 16-bit logits of ``tokens`` tokens are processed in."""
    step = max(1, CHUNK_ELEMENTS // max(tokens, 1), -(-local_vocab // MAX_SLICES))
    return [(start, min(start + step, local_vocab)) for start in range(0, local_vocab, step)]


def _targets(target: torch.Tensor, group, local_vocab: int):
    local_target = target - C.group_rank(group) * local_vocab
    outside = (local_target < 0) | (local_target >= local_vocab)
    return local_target.masked_fill(outside, 0), outside


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group, inplace: bool):
        local_vocab = logits.shape[-1]
        local_target, outside = _targets(target, group, local_vocab)
        ctx.sixteen_bit = logits.dtype in (torch.float16, torch.bfloat16)
        ctx.inplace = inplace
        # Handed-over bf16 logits keep their exponentials (bf16 has fp32's exponent range, so none
        # underflows that the bf16 gradient would keep; fp16's would): backward need not recompute them.
        ctx.stored = inplace and logits.dtype == torch.bfloat16
        dtype = torch.float32 if ctx.sixteen_bit else logits.dtype  # of the loss's arithmetic
        logits_max = logits.amax(dim=-1).to(dtype)  # exact in any dtype
        C.all_reduce(logits_max, group, op=dist.ReduceOp.MAX)
        predicted = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).to(dtype) - logits_max
        predicted = predicted.masked_fill(outside, 0.0)
        C.all_reduce(predicted, group)
        if ctx.sixteen_bit:
            chunks = vocab_chunks(local_vocab, local_target.numel())
            buffer = _fp32_buffer(logits, chunks[0][1])
            sum_exp = torch.zeros_like(logits_max)
            for start, stop in chunks:
                exp = _exp_slice(buffer, logits, logits_max, start, stop)
                sum_exp += exp.sum(dim=-1)
                if ctx.stored:
                    logits[..., start:stop] = exp
        else:
            shifted = logits.sub_(logits_max.unsqueeze(-1)) if inplace else logits - logits_max.unsqueeze(-1)
            exp = shifted.exp_()  # in place: [tokens, vocab / tp] is the largest activation of the model
            sum_exp = exp.sum(dim=-1)
        C.all_reduce(sum_exp, group)
        loss = sum_exp.log() - predicted
        # Saved: the 16-bit logits (or their exponentials), or the fp32/fp64 exponentials
        # (unnormalised: backward folds the division by their sum into its one multiplication).
        ctx.save_for_backward(logits if ctx.sixteen_bit else exp, logits_max, sum_exp, local_target, outside)
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: torch.Tensor):
        # (softmax - one_hot) * grad_loss, as exp * (grad_loss / sum_exp) - one_hot * grad_loss.
        saved, logits_max, sum_exp, local_target, outside = ctx.saved_tensors
        scale = (grad_loss / sum_exp).unsqueeze(-1)
        minus_grad = (-grad_loss).masked_fill(outside, 0.0)
        if not ctx.sixteen_bit:
            # The saved exponentials become the gradient in place (backward runs once; Megatron
            # does the same with its softmax).
            grad = saved.mul_(scale)
            return grad.scatter_add_(-1, local_target.unsqueeze(-1), minus_grad.unsqueeze(-1)), None, None, None
        grad = saved if ctx.inplace else torch.empty_like(saved)
        chunks = vocab_chunks(saved.shape[-1], local_target.numel())
        buffer = _fp32_buffer(saved, chunks[0][1])
        for start, stop in chunks:
            if ctx.stored:
                grad_slice = buffer[..., :stop - start].copy_(saved[..., start:stop]).mul_(scale)
            else:
                grad_slice = _exp_slice(buffer, saved, logits_max, start, stop).mul_(scale)
            owned = (local_target >= start) & (local_target < stop)
            index = (local_target - start).clamp_(0, stop - start - 1).unsqueeze(-1)
            grad_slice.scatter_add_(-1, index, (minus_grad * owned).unsqueeze(-1))
            grad[..., start:stop] = grad_slice
        return grad, None, None, None


def _fp32_buffer(logits: torch.Tensor, width: int) -> torch.Tensor:
    """One fp32 slice's memory, laid out as the logits are (token-major from the head on an
    accelerator, vocabulary-major from the CPU head), allocated once per pass and reused by every slice."""
    return torch.empty_like(logits[..., :width], dtype=torch.float32)


def _exp_slice(buffer: torch.Tensor, logits: torch.Tensor, logits_max: torch.Tensor, start: int,
               stop: int) -> torch.Tensor:
    """exp(logits - max) in fp32 for the vocabulary entries [start, stop), in ``buffer``."""
    out = buffer[..., :stop - start]
    return out.copy_(logits[..., start:stop]).sub_(logits_max.unsqueeze(-1)).exp_()


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp_group=None, *,
                                 inplace: bool = False) -> torch.Tensor:
    """Per-token loss (no reduction), equal to ``F.cross_entropy(full_logits, target, reduction='none')``.

    ``inplace``: the caller hands its logits over and never reads them again, saving a
    [tokens, vocab / tp] tensor: fp32, fp64 and bf16 logits become their exponentials in forward
    (as Megatron's loss always makes them its softmax), and all become their own gradient in
    backward. The models' heads pass their logits this way. Logits autograd saved for another
    backward cannot be handed over (autograd refuses that backward), and the loss's backward runs
    once, without a graph of its own (``create_graph`` is refused)."""
    return _VocabParallelCrossEntropy.apply(logits, target, tp_group, inplace)
