"""Keys and values of the tokens seen so far, so that generation runs each new token alone.

Without a cache, producing token t recomputes attention over all t tokens of every layer:
quadratic work per token. With it, a forward pass takes only the new tokens; each ``Attention``
appends their (rotated) keys and values to its entry and attends over the whole history. The
cache is keyed by the attention module itself, so no layer index travels through the model, and
the model's forward is unchanged when no cache is given (training never passes one).

A cache holds one batch of sequences that advance together (the same length for every row).
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch
import torch.nn.functional as F
from torch import nn


class KVCache:
    def __init__(self) -> None:
        self._entries: Dict[nn.Module, Tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def offset(self) -> int:
        """Tokens already cached: the position of the next token fed to the model."""
        for k, _ in self._entries.values():
            return k.shape[-2]
        return 0

    def length(self, attention: nn.Module) -> int:
        entry = self._entries.get(attention)
        return 0 if entry is None else entry[0].shape[-2]

    def reset(self) -> None:
        self._entries.clear()

    def attend(self, attention: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Append this step's keys/values ([b, groups, s, d]) to ``attention``'s entry and attend
        with the new queries ([b, heads, s, d]) over the whole sequence, causally."""
        entry = self._entries.get(attention)
        if entry is not None:
            k, v = torch.cat([entry[0], k], dim=-2), torch.cat([entry[1], v], dim=-2)
        self._entries[attention] = (k, v)
        new, total = q.shape[-2], k.shape[-2]
        if new == total:  # the prompt: ordinary causal self-attention, the training path's kernel
            return attention.core_attention(q, k, v)
        gqa = q.shape[1] != k.shape[1]
        if new == 1:  # one new token sees every cached one
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
        # Several new tokens after a history: query i sits at position total - new + i
        # (SDPA's is_causal aligns the mask top-left, which is wrong when new < total).
        rows = torch.arange(total - new, total, device=q.device).unsqueeze(1)
        mask = torch.arange(total, device=q.device).unsqueeze(0) <= rows
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
