"""Context parallelism: attention over a sequence split across the ranks of the cp group.

Layout (Megatron's load balancing for causal attention): the sequence is cut into 2*cp equal
chunks and cp rank i holds chunks i and 2*cp-1-i, in that order. Under a causal mask the early
chunks attend to little and the late ones to much, so pairing them gives every rank the same work.

Two ways to attend across ranks (``comm_type``):

- ``"p2p"``, ring attention (Liu et al. 2023; Megatron's default): K/V blocks travel around the
  ring; every step attends the local queries to the block at hand and merges the partial results
  by their log-sum-exp, while the next block is already on its way. A rank sends cp-1 K/V blocks
  in forward, and cp-1 K/V plus cp dK/dV blocks in backward; memory stays O(s/cp).
- ``"a2a"``, Ulysses (Jacobs et al. 2023): all-to-alls turn sequence shards into head shards, so
  each rank runs ordinary attention over the whole sequence for heads/cp heads, then turns back.
  Moves 4 activations of the local size per pass, independent of cp; needs heads % cp == 0.

Packed documents (``document_ids``, this rank's chunks of them: ``data.sequence_shards``): the
ids are all-gathered over the cp group once per call (one long per token). Ulysses masks its
whole, reordered sequence like the plain attention (``parallel.document_masks``); the ring masks
each (query block, key block) pair by the two blocks' ids, a block's causal order included.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from typing import Iterator, List, NamedTuple, Optional

import torch
import torch.nn.functional as F

from megatron_hydra.parallel import collectives as C
from megatron_hydra.parallel.block_attention import (accumulation_dtype, attention_with_lse,
                                                     attention_with_lse_backward, merge_into)
from megatron_hydra.parallel.document_masks import additive, allowed, document_attention


def balanced_positions(seq_length: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """The global positions cp rank ``cp_rank`` holds: chunk ``cp_rank``, then chunk
    ``2*cp_size-1-cp_rank``, of 2*cp_size equal chunks ([seq_length // cp_size] longs)."""
    if cp_size == 1:
        return torch.arange(seq_length, device=device)
    chunk = _chunk_length(seq_length, cp_size)
    first, second = cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([torch.arange(first, first + chunk, device=device),
                      torch.arange(second, second + chunk, device=device)])


def shard_sequence(t: torch.Tensor, dim: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """This rank's two chunks of ``t`` along ``dim`` (see ``balanced_positions``), contiguous."""
    if cp_size == 1:
        return t
    _chunk_length(t.shape[dim], cp_size)
    chunks = t.chunk(2 * cp_size, dim=dim)
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]], dim=dim)


def _chunk_length(seq_length: int, cp_size: int) -> int:
    if seq_length % (2 * cp_size):
        raise ValueError(f"sequence length {seq_length} is not divisible by 2 * context parallel size ({2 * cp_size})")
    return seq_length // (2 * cp_size)


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, comm_type: str,
                               causal: bool, scale: Optional[float] = None,
                               document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """softmax(q k^T * scale) v over the whole sequence, for this rank's queries.

    q: [b, heads, s_local, d]; k, v: [b, groups, s_local, d] (grouped-query attention: q head h
    uses kv head h // (heads/groups)), all in the balanced layout over ``group``. Returns
    [b, heads, s_local, d] in q's dtype. ``scale`` defaults to 1/sqrt(d). ``document_ids``
    ([b, s_local], causal only): each token attends within its own document."""
    gqa = q.shape[1] != k.shape[1]
    if document_ids is not None and not causal:
        raise ValueError("document_ids: documents mask a causal attention only")
    if C.group_size(group) == 1:
        if document_ids is not None:
            return document_attention(q, k, v, document_ids, scale)
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=gqa)
    all_ids = None if document_ids is None else C.all_gather(document_ids.contiguous(), 1, group)  # rank by rank
    if comm_type == "p2p":
        return _RingAttention.apply(q, k, v, group, causal, q.shape[-1] ** -0.5 if scale is None else scale, all_ids)
    if comm_type == "a2a":
        return _ulysses_attention(q, k, v, group, causal, scale, all_ids)
    raise ValueError(f"unknown context parallel comm_type {comm_type!r}: p2p or a2a")


# ---- ring attention (p2p) ----------------------------------------------------------------------

class RingEvent(NamedTuple):
    """One interval of a ring step on this rank: ``phase`` is "compute" (the block's attention)
    or "wait" (blocked on the exchange); ``direction`` is "forward" or "backward". Step ``cp`` of
    the backward is the final hop that takes dK/dV home (a wait only)."""
    direction: str
    step: int
    phase: str
    start: float
    end: float


_timeline: Optional[List[RingEvent]] = None


@contextmanager
def record_ring_timeline() -> Iterator[List[RingEvent]]:
    """Collect a ``RingEvent`` per phase of every ring step run inside the block (host clock:
    on a GPU the kernels run asynchronously, so only on CPU do the intervals mean compute)."""
    global _timeline
    previous, _timeline = _timeline, []
    try:
        yield _timeline
    finally:
        _timeline = previous


def _tick() -> Optional[float]:
    return None if _timeline is None else time.perf_counter()


def _tock(start: Optional[float], direction: str, step: int, phase: str) -> None:
    if start is not None and _timeline is not None:
        _timeline.append(RingEvent(direction, step, phase, start, time.perf_counter()))


def _wait(works, direction: str, step: int) -> None:
    start = _tick()
    for work in works:
        work.wait()
    _tock(start, direction, step, "wait")


def _block(source: int, rank: int, causal: bool, s_local: int):
    """(query rows, key columns, causal) of the block rank ``rank`` computes with the K/V of rank
    ``source``, in the balanced layout. Own block: causal over both chunks (chunk r precedes
    chunk 2cp-1-r). An earlier rank's block: every query sees its first chunk, none its second.
    A later rank's block: only the second local chunk comes after it, and sees all of it."""
    everything, half = slice(None), s_local // 2
    if not causal:
        return everything, everything, False
    if source == rank:
        return everything, everything, True
    if source < rank:
        return everything, slice(0, half), False
    return slice(half, None), everything, False


def _block_mask(all_ids: Optional[torch.Tensor], cp: int, source: int, rank: int, rows, cols,
                block_causal: bool, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """The additive document mask of the block (``rows`` of this rank's queries, ``cols`` of rank
    ``source``'s keys), its causal order included; None without documents. ``all_ids``: every
    rank's [b, s_local] ids, concatenated in rank order."""
    if all_ids is None:
        return None
    ids = all_ids.chunk(cp, dim=1)
    return additive(allowed(ids[rank][:, rows], ids[source][:, cols], block_causal), dtype)


def _expand(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """[2, b, groups, s, d] -> [2, b, heads, s, d]: each kv head repeated for its query heads."""
    return kv if kv.shape[2] == heads else kv.repeat_interleave(heads // kv.shape[2], dim=2)


def _sum_group(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """[b, heads, s, d] -> [b, groups, s, d]: the adjoint of ``_expand``."""
    return grad if grad.shape[1] == groups else grad.unflatten(1, (groups, -1)).sum(2)


class _RingAttention(torch.autograd.Function):
    """Ring attention. Forward: cp steps; step i computes with the K/V of rank (r - i) mod cp
    while receiving the next. Backward (Megatron's scheme, nothing kept from forward but q, k,
    v, out and lse): the K/V travel the ring again and each block's dK/dV accumulator travels
    one step behind it, collecting every rank's share; after the last step one more hop takes
    every accumulator home. K/V travel with their kv heads only (expanded just before use)."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, all_ids):
        cp, rank = C.group_size(group), C.group_rank(group)
        heads, acc = q.shape[1], accumulation_dtype(q.dtype)
        kv = torch.stack([k, v])
        out = lse = None
        for step in range(cp):
            works, incoming = [], None
            if step < cp - 1:
                incoming = torch.empty_like(kv)
                works = C.ring_exchange([kv], [incoming], group)
            start = _tick()
            source = (rank - step) % cp
            rows, cols, block_causal = _block(source, rank, causal, q.shape[2])
            mask = _block_mask(all_ids, cp, source, rank, rows, cols, block_causal, q.dtype)
            block_kv = _expand(kv[:, :, :, cols], heads)
            block_out, block_lse = attention_with_lse(q[:, :, rows], block_kv[0], block_kv[1], block_causal, scale,
                                                      mask)
            if out is None:  # step 0, the own block, covers every row
                out, lse = block_out.to(acc), block_lse.to(acc).contiguous()
            else:
                merge_into(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
            _tock(start, "forward", step, "compute")
            _wait(works, "forward", step)
            kv = incoming
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.scale, ctx.all_ids = group, causal, scale, all_ids
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, scale = ctx.group, ctx.causal, ctx.scale
        cp, rank = C.group_size(group), C.group_rank(group)
        heads, groups = q.shape[1], k.shape[1]
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=accumulation_dtype(q.dtype), device=q.device)
        kv, finished = torch.stack([k, v]), None  # finished: the previous block's dK/dV, this rank's share added
        for step in range(cp):
            sends, recvs, incoming, dkv = [], [], None, None
            if step < cp - 1:  # the next block
                incoming = torch.empty_like(kv)
                sends, recvs = [kv], [incoming]
            if step > 0:  # this block's dK/dV so far, from the rank that used it one step earlier
                dkv = torch.empty_like(kv)
                sends, recvs = sends + [finished], recvs + [dkv]
            works = C.ring_exchange(sends, recvs, group)
            start = _tick()
            source = (rank - step) % cp
            rows, cols, block_causal = _block(source, rank, causal, q.shape[2])
            mask = _block_mask(ctx.all_ids, cp, source, rank, rows, cols, block_causal, q.dtype)
            block_kv = _expand(kv[:, :, :, cols], heads)
            dq_block, dk_block, dv_block = attention_with_lse_backward(
                dout[:, :, rows], q[:, :, rows], block_kv[0], block_kv[1], out[:, :, rows], lse[:, :, rows],
                block_causal, scale, mask)
            dq[:, :, rows] += dq_block
            _tock(start, "backward", step, "compute")
            _wait(works, "backward", step)
            if dkv is None:
                dkv = torch.zeros_like(kv)
            dkv[0][:, :, cols] += _sum_group(dk_block, groups)
            dkv[1][:, :, cols] += _sum_group(dv_block, groups)
            kv, finished = incoming, dkv
        home = torch.empty_like(finished)
        _wait(C.ring_exchange([finished], [home], group), "backward", cp)
        return dq.to(q.dtype), home[0], home[1], None, None, None, None


# ---- Ulysses (a2a) -----------------------------------------------------------------------------

def _ulysses_attention(q, k, v, group, causal, scale, all_ids=None):
    """All-to-all to head shards over the whole sequence, in natural order; attention; back.
    Kv heads are repeated up to a multiple of cp when too few to split (heads % cp == 0 makes
    lcm(groups, cp) a divisor of heads, so q head h still meets kv head h // (heads/groups))."""
    cp, groups = C.group_size(group), k.shape[1]
    if q.shape[1] % cp:
        raise ValueError(f"a2a context parallelism splits heads: {q.shape[1]} heads over {cp} ranks")
    if groups % cp:
        repeat = math.lcm(groups, cp) // groups
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    seq = q.shape[2] * cp
    order = torch.cat([balanced_positions(seq, cp, j, device=q.device) for j in range(cp)])
    inverse = torch.argsort(order)
    q, k, v = (_SeqToHeads.apply(t, group, order, inverse) for t in (q, k, v))
    if all_ids is not None:
        out = document_attention(q, k, v, all_ids.index_select(1, inverse), scale)
    else:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return _HeadsToSeq.apply(out, group, order, inverse)


def _seq_to_heads(x: torch.Tensor, group, inverse: torch.Tensor) -> torch.Tensor:
    """[b, H, s/cp, d] (sequence shard, all heads) -> [b, H/cp, s, d] (all positions in natural
    order, this rank's heads). The received shards arrive rank by rank, each in its balanced
    layout: ``inverse`` (argsort of the concatenated layouts) puts positions back in order."""
    cp = C.group_size(group)
    b, heads, s_local, d = x.shape
    received = C.all_to_all(x.reshape(b, cp, heads // cp, s_local, d).transpose(0, 1), group)
    return received.permute(1, 2, 0, 3, 4).reshape(b, heads // cp, cp * s_local, d).index_select(2, inverse)


def _heads_to_seq(x: torch.Tensor, group, order: torch.Tensor) -> torch.Tensor:
    """The inverse of ``_seq_to_heads``: [b, H/cp, s, d] -> [b, H, s/cp, d]."""
    cp = C.group_size(group)
    b, local_heads, seq, d = x.shape
    shards = x.index_select(2, order).view(b, local_heads, cp, seq // cp, d).permute(2, 0, 1, 3, 4)
    return C.all_to_all(shards, group).transpose(0, 1).reshape(b, cp * local_heads, seq // cp, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, order, inverse):
        ctx.group, ctx.order = group, order
        return _seq_to_heads(x, group, inverse)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad, ctx.group, ctx.order), None, None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, order, inverse):
        ctx.group, ctx.inverse = group, inverse
        return _heads_to_seq(x, group, order)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad, ctx.group, ctx.inverse), None, None, None
