"""Attention masks from document ids: each token attends (causally) to its own document only.

A packed sequence holds several documents (``data.reset_attention_mask``, or SFT packing); the
batch names each token's document in ``document_ids`` ([b, s] longs, increasing along the
sequence). Query i may attend to key j iff both carry the same id (and j <= i when causal).

The mask is additive (0 where allowed, -inf elsewhere) in the scores' dtype: on CPU, SDPA with an
additive mask measured as fast as plain causal SDPA at sequence 2048, a boolean mask 1.7x slower
(it is converted on every call), and FlexAttention has no CPU backward
(``benchmarks/document_attention.py``; docs/data.md). Every row keeps at least its diagonal under
a causal mask over whole sequences, so no softmax row is empty there; a context-parallel block
(``parallel.context_parallel``) may have empty rows, which ``empty_rows`` finds.
"""

from __future__ import annotations

import torch


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


def empty_rows(permitted: torch.Tensor) -> torch.Tensor:
    """[b, 1, s_q] booleans: the query rows of ``permitted`` that may attend to no key."""
    return ~permitted.any(-1)
