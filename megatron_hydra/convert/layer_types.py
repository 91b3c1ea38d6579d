"""Which layers attend through the sliding window: a Hugging Face ``layer_types`` list
(``sliding_attention`` / ``full_attention`` per layer) <-> ``model.sliding_window_pattern``.

The pattern is written as the int n that gives the same layers where one does (1: every layer;
Gemma 2's alternation is 2, Gemma 3's five local layers to one global are 6), so that a preset
built from an import keeps its meaning when ``model.num_layers`` changes; any other pattern is
one 0/1 per layer.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Union

from megatron_hydra.config.architecture import window_layers
from megatron_hydra.config.transformer_config import TransformerConfig
from megatron_hydra.convert.mapping import HFConfig

SLIDING, FULL = "sliding_attention", "full_attention"


def read(hf: HFConfig, num_layers: int) -> Optional[List[bool]]:
    """Per layer, whether it is windowed, from the file's ``layer_types``; None when it has none."""
    types = hf.value("layer_types", list, None)
    if types is None:
        return None
    if len(types) != num_layers or any(t not in (SLIDING, FULL) for t in types):
        raise hf.unsupported("layer_types", types, f"one {SLIDING!r} or {FULL!r} per layer (num_hidden_layers="
                             f"{num_layers}) is")
    return [t == SLIDING for t in types]


def pattern(windowed: Sequence[bool], declared: Optional[int] = None) -> Union[int, List[int]]:
    """``model.sliding_window_pattern`` for these per-layer flags: ``declared`` (the file's own
    sliding_window_pattern) or else the smallest int n that yields them, else the 0/1 list.

    Only one n can be the smallest: n windows every layer but the n-th, 2n-th, ..., so its first
    full layer is layer n - 1, and with none full n = 1 is the smallest. Each candidate costs one
    pass over the layers: a ``layer_types`` list of a million entries is read at once."""
    flags = [int(w) for w in windowed]
    wanted = tuple(i for i, f in enumerate(flags) if f)
    smallest = flags.index(0) + 1 if 0 in flags else 1
    for n in ([declared] if declared else []) + [smallest]:
        if n >= 1 and window_layers(n, len(flags)) == wanted:
            return n
    return flags


def write(cfg: TransformerConfig) -> List[str]:
    """``layer_types`` of our model."""
    return [SLIDING if cfg.windowed(i) is not None else FULL for i in range(cfg.num_layers)]
