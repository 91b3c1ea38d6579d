"""Collective matmuls: the sequence-parallel all-gather and reduce-scatter of the tensor-parallel
layers split into ring steps, each overlapped with the partial matmul of a chunk already present
(``parallel.tp_comm_overlap``; Wang et al. 2022, "Overlap communication with dependent
computation via decomposition", the scheme Megatron's userbuffers and torch's async-TP implement).

Under sequence parallelism a rank holds a slice [b, s/tp, h] of the activation. The plain layers
all-gather it whole and then multiply (column-parallel), or multiply and then reduce-scatter the
product (row-parallel): the collective waits for, or blocks, the matmul. Here each of the tp ring
steps posts the next chunk's transfer to the neighbours first (``collectives.ring_exchange``, one
batched isend/irecv) and multiplies the chunk already there while it travels:

- ``all_gather_linear`` (column-parallel): chunk j arriving from rank r - j is multiplied by every
  weight that reads the input (a gated MLP's gate and up projections share the ring) and written
  to its sequence positions. Backward: the input gradient's reduce-scatter is a ring too, each
  step adding this rank's partial product for the chunk passing through before sending it on.
- ``linear_reduce_scatter`` (row-parallel): the mirror, a ring reduce-scatter of the partial
  products of the sequence chunks forward, and a ring all-gather of the output gradient, each
  chunk's matmuls done while the next one travels, backward.

Values equal the plain layers' up to the order of the sums over TP ranks and sequence chunks.
The gathered input of a column-parallel layer is kept for its weight gradient, as the plain path
keeps the all-gathered input: re-gathering it in backward would save that memory only at the cost
of a second ring of transfers, and a recomputed layer does not keep it either way.

The same ring runs on every device; torch's async-TP (symmetric memory) is private torch API, left
until a GPU measurement shows a gain over this ring. A layer with a LoRA adapter takes the plain
path (``parallel.layers``): its adapter reads the whole gathered input.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, List, Sequence

import torch
import torch.nn.functional as F

from megatron_hydra.parallel import collectives as C
from megatron_hydra.parallel.mappings import SEQ_DIM

KIND = "tp_p2p"  # what ``collectives`` counts and records the ring transfers as


def _ring_all_gather(x: torch.Tensor, group, consume: Callable[[torch.Tensor, int], None]) -> None:
    """Hand every rank's ``x`` (this rank's own first) to ``consume(chunk, source_rank)``, each
    chunk's transfer to the next rank posted before the chunk already present is consumed."""
    tp, rank = C.group_size(group), C.group_rank(group)
    current = x.contiguous()
    for step in range(tp):
        works, incoming = [], None
        if step < tp - 1:
            incoming = torch.empty_like(current)
            works = C.ring_exchange([current], [incoming], group, KIND)
        consume(current, (rank - step) % tp)
        for work in works:
            work.wait()
        current = incoming


def _ring_reduce_scatter(partial: Callable[[int], torch.Tensor], group) -> torch.Tensor:
    """The sum over the group of ``partial(chunk)`` for this rank's chunk: at step j this rank adds
    its partial for chunk r - j - 1 to the sum arriving from the previous rank and sends it on, so
    that at the last step the sum of chunk r is complete here. The next partial is computed while
    the running sum travels."""
    tp, rank = C.group_size(group), C.group_rank(group)
    total = partial((rank - 1) % tp)
    for step in range(1, tp):
        incoming = torch.empty_like(total)
        works = C.ring_exchange([total.contiguous()], [incoming], group, KIND)
        mine = partial((rank - step - 1) % tp)
        for work in works:
            work.wait()
        total = incoming + mine
    return total


def _rows(t: torch.Tensor, chunk: int, size: int) -> torch.Tensor:
    return t.narrow(SEQ_DIM, chunk * size, size)


def _autocast_of(device: torch.device):
    """The autocast state of the forward, which backward re-enters (as ``torch.amp.custom_bwd``
    does), so that its matmuls run in the dtype of the forward's, as the plain layers' do. Not
    ``torch.amp.custom_fwd/custom_bwd`` themselves: they take one ``device_type`` when the class is
    defined, and these Functions serve every device (CPU, CUDA, the dry run's stand-in), known
    only from the input at the call."""
    if not torch.is_autocast_enabled(device.type):
        return None
    return device.type, torch.get_autocast_dtype(device.type)


def _autocast(state):
    return nullcontext() if state is None else torch.autocast(state[0], dtype=state[1])


class _AllGatherLinear(torch.autograd.Function):
    """``F.linear(all_gather_sequence(x), w_i, b_i)`` for every weight w_i, as a ring."""

    @staticmethod
    def forward(ctx, x, group, count, *params):
        weights, biases = params[:count], params[count:]
        tp, size = C.group_size(group), x.shape[SEQ_DIM]
        gathered = x.new_empty(x.shape[:SEQ_DIM] + (tp * size,) + x.shape[SEQ_DIM + 1:])
        outs: List[torch.Tensor] = [None] * count

        def consume(chunk, source):
            _rows(gathered, source, size).copy_(chunk)
            for i, (w, b) in enumerate(zip(weights, biases)):
                y = F.linear(chunk, w, b)
                if outs[i] is None:
                    outs[i] = y.new_empty(y.shape[:SEQ_DIM] + (tp * size,) + y.shape[SEQ_DIM + 1:])
                _rows(outs[i], source, size).copy_(y)

        _ring_all_gather(x, group, consume)
        ctx.group, ctx.count, ctx.size, ctx.amp = group, count, size, _autocast_of(x.device)
        ctx.has_bias = [b is not None for b in biases]
        ctx.save_for_backward(gathered, *weights)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        gathered, *weights = ctx.saved_tensors
        grads = [g.contiguous() for g in grads]
        wanted = ctx.needs_input_grad[3:]

        def partial(chunk):
            return sum(_rows(g, chunk, ctx.size) @ w for g, w in zip(grads, weights))

        with _autocast(ctx.amp):
            grad_x = _ring_reduce_scatter(partial, ctx.group)
            flat_x = gathered.reshape(-1, gathered.shape[-1])
            grad_w = [g.reshape(-1, g.shape[-1]).t() @ flat_x if want else None for g, want in zip(grads, wanted)]
        grad_b = [g.reshape(-1, g.shape[-1]).sum(0) if has and want else None
                  for g, has, want in zip(grads, ctx.has_bias, wanted[ctx.count:])]
        return (grad_x, None, None, *grad_w, *grad_b)


class _LinearReduceScatter(torch.autograd.Function):
    """``reduce_scatter_sequence(F.linear(x, w))`` as a ring."""

    @staticmethod
    def forward(ctx, x, weight, group):
        tp = C.group_size(group)
        size = x.shape[SEQ_DIM] // tp
        ctx.group, ctx.size, ctx.amp = group, size, _autocast_of(x.device)
        ctx.save_for_backward(x, weight)
        return _ring_reduce_scatter(lambda chunk: F.linear(_rows(x, chunk, size), weight), group)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        size = ctx.size
        grad_x = torch.empty_like(x)
        grad_w = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None

        def consume(chunk, source):
            _rows(grad_x, source, size).copy_(chunk @ weight)
            if grad_w is not None:
                grad_w.add_(chunk.reshape(-1, chunk.shape[-1]).t() @ _rows(x, source, size).reshape(-1, x.shape[-1]))

        with _autocast(ctx.amp):
            _ring_all_gather(grad, ctx.group, consume)
        return grad_x, grad_w, None


def all_gather_linear(x: torch.Tensor, group, weights: Sequence[torch.Tensor], biases: Sequence) -> tuple:
    """For each (weight, bias): ``F.linear`` of the sequence-gathered ``x`` (this rank's slice
    [b, s/tp, h] in, [b, s, out_i] out), the gather overlapped with the matmuls."""
    return _AllGatherLinear.apply(x, group, len(weights), *weights, *biases)


def linear_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, group) -> torch.Tensor:
    """``F.linear(x, weight)`` summed over the group and split along the sequence ([b, s, in/tp]
    in, this rank's [b, s/tp, out] out), the reduce-scatter overlapped with the matmuls."""
    return _LinearReduceScatter.apply(x, weight, group)
