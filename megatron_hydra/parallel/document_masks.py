"""Attention within documents: each token attends causally to its own document only.

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
