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
Prompts of different lengths share one by left padding: ``pads`` says how many pad tokens open
each row. A pad key is then seen by no real query (every row's real tokens form one document
after its pads, ``parallel.document_masks``), so a row's result is the one it would have alone,
given its real positions (``position_ids`` counting from its first real token).
"""

from __future__ import annotations

from typing import Dict, NamedTuple, Optional

import torch
from torch import nn

from megatron_hydra.parallel.document_masks import masked_attention


class _Entry(NamedTuple):
    keys: torch.Tensor  # [b, groups, held, d]: the last ``held`` of the ``seen`` tokens
    values: torch.Tensor
    seen: int  # tokens this attention has seen: the position of its next one


class KVCache:
    def __init__(self, pads: Optional[torch.Tensor] = None) -> None:
        """``pads`` ([batch] ints): the pad tokens that open each row (left padding); None or all
        zero: no row is padded, and attention keeps its unmasked kernels."""
        self._entries: Dict[nn.Module, _Entry] = {}
        self.pads = pads if pads is not None and bool(pads.any()) else None

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
        documents = self._documents(seen, k.shape[-2])
        if q.shape[-2] == seen:  # the prompt: the training path's kernel
            out = attention.core_attention(q, k, v, **({} if documents is None else {"document_ids": documents}))
        else:  # the new queries are the last positions held
            out = masked_attention(q, k, v, scale=attention.cfg.softmax_scale, window=window,
                                   softcap=getattr(attention, "softcap", None), document_ids=documents)
        if window is not None and k.shape[-2] > window - 1:
            k, v = k[..., k.shape[-2] - (window - 1):, :], v[..., v.shape[-2] - (window - 1):, :]
        self._entries[attention] = _Entry(k, v, seen)
        return out

    def _documents(self, seen: int, held: int) -> Optional[torch.Tensor]:
        """[b, held] document ids of the keys held (the last ``held`` of ``seen``): 0 for a row's
        pads, 1 for its tokens; None without padding."""
        if self.pads is None:
            return None
        index = torch.arange(seen - held, seen, device=self.pads.device)
        return (index.unsqueeze(0) >= self.pads.unsqueeze(1)).long()
