"""Masked attention: within documents, within a sliding window, with soft-capped scores.

Documents: each token attends causally to its own document only.

A packed sequence holds several documents (``data.reset_attention_mask``, or SFT packing); the
batch names each token's document in ``document_ids`` ([b, s] longs, increasing along the
sequence). Query i may attend to key j iff both carry the same id and j <= i.

The mask is additive (0 where allowed, -inf elsewhere) in the scores' dtype. Plain SDPA with a
mask computes every block of the score matrix, twice the work of causal SDPA, which skips the
blocks above the diagonal. On CPU, torch's flash kernel takes the causal flag and a mask together
(the public SDPA call refuses the pair), skips those blocks and applies the mask to the rest,
which is cheaper than SDPA with the mask alone, and FlexAttention has no CPU backward at all
(``benchmarks/document_attention.py`` measures both; docs/data.md). Elsewhere (GPU, attention dropout) SDPA
takes the mask. Every row keeps its diagonal under a causal mask over whole sequences, so no
softmax row is empty there; context-parallel ring blocks can have empty rows
(``parallel.block_attention`` handles them).

``masked_attention`` is the one kernel for every other mask a layer asks for: a sliding window
(Mistral, Gemma), soft-capped scores (Gemma 2), queries that continue a cached prefix (generation),
each alone or together. Positions, not indices, decide the mask, so the same call serves a whole
sequence, a KV cache trimmed to its window and a context-parallel rank's block. Without a cap it
is SDPA with a boolean mask (a GPU's memory-efficient kernel, given keys and values repeated per
query head, which it needs with a mask); a cap must act on the scores before the
softmax, which no fused kernel offers, so that path spells the attention out in plain torch ops.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def allowed(q_ids: torch.Tensor, k_ids: torch.Tensor, causal: bool) -> torch.Tensor:
    """[b, 1, s_q, s_k] booleans: True where query i may attend to key j. ``q_ids`` [b, s_q] and
    ``k_ids`` [b, s_k] are the document ids of the queries and keys; ``causal`` adds j <= i
    (top-left aligned: query i and key i are the same position)."""
    same = q_ids.unsqueeze(-1) == k_ids.unsqueeze(-2)
    if causal:
        same &= torch.ones(same.shape[-2:], dtype=torch.bool, device=same.device).tril()
    return same.unsqueeze(1)


def additive(permitted: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive form of a boolean mask: 0 where permitted, -inf elsewhere, in ``dtype``."""
    return torch.zeros((), dtype=dtype, device=permitted.device).masked_fill(~permitted, float("-inf"))


def document_mask(document_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive block-diagonal causal mask of a whole sequence, [b, 1, s, s] in ``dtype``,
    for ``scaled_dot_product_attention(attn_mask=...)`` (broadcast over heads)."""
    return additive(allowed(document_ids, document_ids, causal=True), dtype)


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, document_ids: torch.Tensor,
                       scale: Optional[float] = None, dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention within each document: q [b, heads, s, d], k and v [b, groups, s, d]
    (grouped-query attention when groups < heads), ``document_ids`` [b, s]; [b, heads, s, d] out.
    The mask is built here, so a recomputed attention rebuilds it rather than keeping it."""
    mask = document_mask(document_ids, q.dtype)
    gqa = q.shape[1] != k.shape[1]
    if q.device.type == "cpu" and dropout_p == 0:
        if gqa:  # the kernel takes as many kv heads as query heads
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, True, attn_mask=mask, scale=scale)[0]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale, enable_gqa=gqa)


def window_mask(sq: int, sk: int, causal: bool, window: Optional[int], q_offset: int, device=None
                ) -> Optional[torch.Tensor]:
    """[sq, sk] booleans (True: attend) for queries at positions q_offset .. q_offset + sq - 1 and
    keys at 0 .. sk - 1: causal keeps j <= i, a window keeps i - j < window. None: no mask."""
    if not causal and window is None:
        return None
    gap = (torch.arange(q_offset, q_offset + sq, device=device).unsqueeze(-1)
           - torch.arange(sk, device=device).unsqueeze(0))  # query position - key position
    permitted = gap >= 0 if causal else torch.ones_like(gap, dtype=torch.bool)
    if window is not None:
        permitted &= gap < window
    return permitted


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: Optional[float] = None,
                     causal: bool = True, window: Optional[int] = None, softcap: Optional[float] = None,
                     q_offset: Optional[int] = None, document_ids: Optional[torch.Tensor] = None,
                     dropout_p: float = 0.0) -> torch.Tensor:
    """softmax(mask(cap(q k^T * scale))) v: q [b, heads, sq, d]; k, v [b, groups, sk, d] (query head
    h reads group h // (heads / groups)); [b, heads, sq, d] out, in q's dtype.

    Query i sits at position ``q_offset`` + i (default sk - sq: the last sq positions), key j at
    position j. ``causal``: j <= pos(i); ``window`` w: pos(i) - j < w; ``softcap`` c: scores become
    c * tanh(scores * scale / c) before the mask; ``document_ids`` ([b, sk]): within each document
    (the queries carry the ids of their positions). ``scale``: default 1/sqrt(d). Every query must
    keep at least one key (an empty row has no softmax)."""
    sq, sk = q.shape[-2], k.shape[-2]
    offset = sk - sq if q_offset is None else q_offset
    if window is not None and window > offset + sq - 1:
        window = None  # it reaches key 0 from the last query: no key falls outside it
    if causal and document_ids is None and offset >= sk - 1:
        causal = False  # no key lies after the first query (a cached prefix's next token)
    gqa = q.shape[1] != k.shape[1]
    if window is None and softcap is None:
        if document_ids is None and (not causal or (sq == sk and offset == 0)):
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal, scale=scale,
                                                  enable_gqa=gqa)
        if document_ids is not None and causal and sq == sk and offset == 0:
            return document_attention(q, k, v, document_ids, scale, dropout_p)
    permitted = window_mask(sq, sk, causal, window, offset, q.device)
    if permitted is not None:
        permitted = permitted.view(1, 1, sq, sk)
    if document_ids is not None:
        same = allowed(document_ids[:, offset:offset + sq], document_ids, causal=False)  # [b, 1, sq, sk]
        permitted = same if permitted is None else permitted & same
    if softcap is None:
        if gqa and q.device.type != "cpu":  # a GPU's memory-efficient kernel takes a mask but not GQA
            k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
            gqa = False
        return F.scaled_dot_product_attention(q, k, v, attn_mask=permitted, dropout_p=dropout_p, scale=scale,
                                              enable_gqa=gqa)
    return _capped_attention(q, k, v, scale, softcap, permitted, dropout_p)


def _capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float], softcap: float,
                      permitted: Optional[torch.Tensor], dropout_p: float) -> torch.Tensor:
    """The attention with soft-capped scores, in plain torch ops. A query group's heads are
    stacked along the rows ([b, groups, heads_per_group * sq, d]), so keys and values are read
    per group, never repeated per head. The softmax runs in at least float32."""
    b, heads, sq, d = q.shape
    groups, sk = k.shape[1], k.shape[2]
    per_group = heads // groups
    scores = torch.matmul(q.reshape(b, groups, per_group * sq, d), k.transpose(-1, -2))
    capped = scores.mul_(d ** -0.5 if scale is None else scale).div_(softcap).tanh()
    scores = capped.view(b, groups, per_group, sq, sk).mul(softcap)  # a tensor of its own: masked in place
    if permitted is not None:
        scores = scores.masked_fill_(~permitted.unsqueeze(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype)
    if dropout_p > 0:
        probs = F.dropout(probs, dropout_p)
    out = torch.matmul(probs.view(b, groups, per_group * sq, sk), v)
    return out.view(b, heads, sq, d)
