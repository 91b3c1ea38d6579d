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

A sliding window (``window`` w: query position i sees key j only if i - j < w; Mistral, Gemma)
and soft-capped scores (``softcap``, Gemma 2) follow the same split. Ulysses hands them to the
plain masked attention over its whole sequence. The ring cuts each step's block into its pairs of
chunks (a rank holds two): from the chunks' global positions a pair is either outside the window
(with causality, entirely masked: skipped, no attention, nothing merged, no backward), inside it
(the fused kernels, as without a window) or cut by it (one more additive mask, next to the
documents'). The K/V still travel the whole ring: every rank's window reaches some other rank in
a late step (chunk 2cp-1-r needs chunk 2cp-2-r, one rank further on). A capped block runs the
plain-torch kernels (``parallel.block_attention``).
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from typing import Iterator, List, NamedTuple, Optional

import torch

from megatron_hydra.parallel import collectives as C
from megatron_hydra.parallel.block_attention import (accumulation_dtype, attention_with_lse,
                                                     attention_with_lse_backward, merge_into)
from megatron_hydra.parallel.document_masks import additive, allowed, masked_attention, window_mask


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
                               document_ids: Optional[torch.Tensor] = None, *, window: Optional[int] = None,
                               softcap: Optional[float] = None) -> torch.Tensor:
    """softmax(q k^T * scale) v over the whole sequence, for this rank's queries.

    q: [b, heads, s_local, d]; k, v: [b, groups, s_local, d] (grouped-query attention: q head h
    uses kv head h // (heads/groups)), all in the balanced layout over ``group``. Returns
    [b, heads, s_local, d] in q's dtype. ``scale`` defaults to 1/sqrt(d). ``document_ids``
    ([b, s_local], causal only): each token attends within its own document. ``window``: query
    position i sees key position j only if i - j < window (global positions). ``softcap`` c:
    scores c tanh(q k^T scale / c), before any mask."""
    if document_ids is not None and not causal:
        raise ValueError("document_ids: documents mask a causal attention only")
    if window is not None and window < 1:
        raise ValueError(f"sliding window {window}: a query must see at least its own position")
    if window is not None and window >= q.shape[2] * C.group_size(group):
        window = None  # it reaches every key: no window
    if C.group_size(group) == 1:  # plain SDPA when nothing masks or caps
        return masked_attention(q, k, v, scale=scale, causal=causal, window=window, softcap=softcap,
                                document_ids=document_ids)
    all_ids = None if document_ids is None else C.all_gather(document_ids.contiguous(), 1, group)  # rank by rank
    if comm_type == "p2p":
        return _RingAttention.apply(q, k, v, group, _RingSpec(causal, q.shape[-1] ** -0.5 if scale is None else scale,
                                                              all_ids, window, softcap))
    if comm_type == "a2a":
        return _ulysses_attention(q, k, v, group, causal, scale, all_ids, window, softcap)
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


class _RingSpec(NamedTuple):
    """What masks the ring's blocks: causality, the scale, every rank's document ids ([b, s_local]
    each, concatenated in rank order; or None), the window and the cap (or None)."""
    causal: bool
    scale: float
    all_ids: Optional[torch.Tensor]
    window: Optional[int]
    softcap: Optional[float]


class _Tile(NamedTuple):
    """A piece of a ring step's block: ``rows`` of this rank's queries, ``cols`` of the source
    rank's keys, ``causal`` (top-left, for a square tile on the diagonal), ``banded`` (the
    window cuts through it, so it needs the window's mask) and ``offset``: the position of its
    first query less that of its first key (banded tiles only: their rows and columns are each
    one chunk, so contiguous)."""
    rows: slice
    cols: slice
    causal: bool
    banded: bool
    offset: int = 0


def _tiles(source: int, rank: int, cp: int, s_local: int, causal: bool, window: Optional[int]) -> List[_Tile]:
    """The tiles rank ``rank`` computes with the K/V of rank ``source``. Without a window, one
    block (``_block``); with one, each pair of a local query chunk and a source key chunk that the
    window and causality do not mask entirely."""
    if window is None:
        return [_Tile(*_block(source, rank, causal, s_local), banded=False)]
    half, tiles = s_local // 2, []
    for q_half, q_chunk in enumerate((rank, 2 * cp - 1 - rank)):
        for k_half, k_chunk in enumerate((source, 2 * cp - 1 - source)):
            if causal and k_chunk > q_chunk:
                continue
            diagonal = causal and k_chunk == q_chunk
            offset = (q_chunk - k_chunk) * half  # query position - key position, at the tiles' starts
            nearest, farthest = (0 if diagonal else offset - half + 1), offset + half - 1
            if nearest >= window:
                continue
            tiles.append(_Tile(slice(q_half * half, (q_half + 1) * half), slice(k_half * half, (k_half + 1) * half),
                               diagonal, farthest >= window, offset))
    return tiles


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


def _tile_mask(spec: _RingSpec, cp: int, source: int, rank: int, tile: _Tile, q: torch.Tensor
               ) -> Optional[torch.Tensor]:
    """The tile's additive mask ([b or 1, 1, rows, cols]): the documents, the tile's causal order
    and the window; None where neither documents nor the window mask the tile."""
    permitted = None
    if spec.all_ids is not None:
        ids = spec.all_ids.chunk(cp, dim=1)
        permitted = allowed(ids[rank][:, tile.rows], ids[source][:, tile.cols], tile.causal)
    if tile.banded:
        half = q.shape[2] // 2
        band = window_mask(half, half, spec.causal, spec.window, tile.offset, q.device).view(1, 1, half, half)
        permitted = band if permitted is None else permitted & band
    return None if permitted is None else additive(permitted, q.dtype)


def _expand(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """[2, b, groups, s, d] -> [2, b, heads, s, d]: each kv head repeated for its query heads."""
    return kv if kv.shape[2] == heads else kv.repeat_interleave(heads // kv.shape[2], dim=2)


def _sum_group(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """[b, heads, s, d] -> [b, groups, s, d]: the adjoint of ``_expand``."""
    return grad if grad.shape[1] == groups else grad.unflatten(1, (groups, -1)).sum(2)


def _fold(running, q: torch.Tensor, rows: slice, block_out: torch.Tensor, block_lse: torch.Tensor):
    """(out, lse) of the rows so far, with one tile's folded in. The first tile to cover every row
    starts them; a first tile covering fewer starts them empty (out 0, lse -inf)."""
    acc = accumulation_dtype(q.dtype)
    if running is None:
        if rows == slice(None):
            return block_out.to(acc), block_lse.to(acc).contiguous()
        running = (torch.zeros(q.shape, dtype=acc, device=q.device),
                   torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device))
    merge_into(running[0][:, :, rows], running[1][:, :, rows], block_out, block_lse)
    return running


class _RingAttention(torch.autograd.Function):
    """Ring attention. Forward: cp steps; step i computes with the K/V of rank (r - i) mod cp
    while receiving the next. Backward (Megatron's scheme, nothing kept from forward but q, k,
    v, out and lse): the K/V travel the ring again and each block's dK/dV accumulator travels
    one step behind it, collecting every rank's share; after the last step one more hop takes
    every accumulator home. K/V travel with their kv heads only (expanded just before use)."""

    @staticmethod
    def forward(ctx, q, k, v, group, spec: _RingSpec):
        cp, rank = C.group_size(group), C.group_rank(group)
        heads, s_local = q.shape[1], q.shape[2]
        kv, running = torch.stack([k, v]), None
        for step in range(cp):
            works, incoming = [], None
            if step < cp - 1:
                incoming = torch.empty_like(kv)
                works = C.ring_exchange([kv], [incoming], group)
            start = _tick()
            source = (rank - step) % cp
            for tile in _tiles(source, rank, cp, s_local, spec.causal, spec.window):
                mask = _tile_mask(spec, cp, source, rank, tile, q)
                block_kv = _expand(kv[:, :, :, tile.cols], heads)
                block_out, block_lse = attention_with_lse(q[:, :, tile.rows], block_kv[0], block_kv[1], tile.causal,
                                                          spec.scale, mask, spec.softcap)
                running = _fold(running, q, tile.rows, block_out, block_lse)
            _tock(start, "forward", step, "compute")
            _wait(works, "forward", step)
            kv = incoming
        out, lse = running
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.spec = group, spec
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, spec = ctx.group, ctx.spec
        cp, rank = C.group_size(group), C.group_rank(group)
        heads, groups, s_local = q.shape[1], k.shape[1], q.shape[2]
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
            grads = []
            for tile in _tiles(source, rank, cp, s_local, spec.causal, spec.window):
                mask = _tile_mask(spec, cp, source, rank, tile, q)
                block_kv = _expand(kv[:, :, :, tile.cols], heads)
                rows = tile.rows
                dq_block, dk_block, dv_block = attention_with_lse_backward(
                    dout[:, :, rows], q[:, :, rows], block_kv[0], block_kv[1], out[:, :, rows], lse[:, :, rows],
                    tile.causal, spec.scale, mask, spec.softcap)
                dq[:, :, rows] += dq_block
                grads.append((tile.cols, _sum_group(dk_block, groups), _sum_group(dv_block, groups)))
            _tock(start, "backward", step, "compute")
            _wait(works, "backward", step)
            if dkv is None:
                dkv = torch.zeros_like(kv)
            for cols, dk_block, dv_block in grads:
                dkv[0][:, :, cols] += dk_block
                dkv[1][:, :, cols] += dv_block
            kv, finished = incoming, dkv
        home = torch.empty_like(finished)
        _wait(C.ring_exchange([finished], [home], group), "backward", cp)
        return dq.to(q.dtype), home[0], home[1], None, None


# ---- Ulysses (a2a) -----------------------------------------------------------------------------

def _ulysses_attention(q, k, v, group, causal, scale, all_ids=None, window=None, softcap=None):
    """All-to-all to head shards over the whole sequence, in natural order; attention (masked by
    documents and the window, capped, as the plain attention of one process); back.
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
    ids = None if all_ids is None else all_ids.index_select(1, inverse)
    out = masked_attention(q, k, v, scale=scale, causal=causal, window=window, softcap=softcap, document_ids=ids)
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
