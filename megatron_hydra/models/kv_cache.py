"""Keys and values of the tokens seen so far, so that generation runs each new token alone.

Without a cache, producing token t recomputes attention over all t tokens of every layer:
quadratic work per token. With it, a forward pass takes only the new tokens; each ``Attention``
appends their (rotated) keys and values to its entry and attends over the history. The cache is
keyed by the attention module itself, so no layer index travels through the model, and the
model's forward is unchanged when no cache is given (training never passes one).

A sliding-window layer (``attention.window`` w) never looks further back than w - 1 tokens, so
its entry keeps only those after each step: its memory is bounded by the window however long the
generation runs. Positions therefore count separately from what an entry holds.

A cache holds one batch of sequences that advance together (the same length for every row).
"""

from __future__ import annotations

from typing import Dict, NamedTuple

import torch
from torch import nn

from megatron_hydra.parallel.document_masks import masked_attention


class _Entry(NamedTuple):
    keys: torch.Tensor  # [b, groups, held, d]: the last ``held`` of the ``seen`` tokens
    values: torch.Tensor
    seen: int  # tokens this attention has seen: the position of its next one


class KVCache:
    def __init__(self) -> None:
        self._entries: Dict[nn.Module, _Entry] = {}

    @property
    def offset(self) -> int:
        """Tokens already seen: the position of the next token fed to the model."""
        for entry in self._entries.values():
            return entry.seen
        return 0

    def length(self, attention: nn.Module) -> int:
        """Tokens ``attention`` has seen (the position of its next one), cached or trimmed away."""
        entry = self._entries.get(attention)
        return 0 if entry is None else entry.seen

    def held(self, attention: nn.Module) -> int:
        """Tokens whose keys and values ``attention``'s entry holds."""
        entry = self._entries.get(attention)
        return 0 if entry is None else entry.keys.shape[-2]

    def reset(self) -> None:
        self._entries.clear()

    def attend(self, attention: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Append this step's keys/values ([b, groups, s, d]) to ``attention``'s entry and attend
        with the new queries ([b, heads, s, d]) over what it holds, causally, within the layer's
        window and with its score cap; then trim the entry to what later tokens can still see."""
        entry = self._entries.get(attention)
        seen = k.shape[-2] if entry is None else entry.seen + k.shape[-2]
        if entry is not None:
            k, v = torch.cat([entry.keys, k], dim=-2), torch.cat([entry.values, v], dim=-2)
        window = getattr(attention, "window", None)
        if q.shape[-2] == seen:  # the prompt: the training path's kernel
            out = attention.core_attention(q, k, v)
        else:  # the new queries are the last positions held
            out = masked_attention(q, k, v, scale=attention.cfg.softmax_scale, window=window,
                                   softcap=getattr(attention, "softcap", None))
        if window is not None and k.shape[-2] > window - 1:
            k, v = k[..., k.shape[-2] - (window - 1):, :], v[..., v.shape[-2] - (window - 1):, :]
        self._entries[attention] = _Entry(k, v, seen)
        return out
