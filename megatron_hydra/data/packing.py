"""Greedy best-fit packing of variable-length samples into fixed-length sequences.

Fine-tuning samples (one conversation each) are far shorter than ``seq_length`` and vary a lot in
length; padding every one of them to ``seq_length`` would spend most of each step on padding.
Packing puts several whole samples into one sequence instead, and pads only its tail.

The algorithm is best-fit in the given order (the order is the epoch's shuffle, so the result is
deterministic under the data seed): each sample goes into the open pack whose free space is the
smallest that still holds it; when none holds it, it opens a new pack. Ties go to the pack that
reached that free space first. Packs are returned in the order they were opened. Best-fit was
chosen over next-fit (close a pack as soon as a sample does not fit) because it fills the gaps
next-fit leaves behind with the short samples that come later, which is most of the padding
next-fit pays.

Open packs are kept in buckets by free space, and the non-empty free-space values (c of them, at
most seq_length + 1) in a sorted list: O(n log c) comparisons for n samples, and list insertions
and removals that move up to c entries each (O(n c) at worst, small for c <= seq_length + 1).
"""

from __future__ import annotations

import bisect
from collections import deque
from typing import Dict, List, Sequence

import numpy as np


def best_fit_packs(lengths: Sequence[int], capacity: int) -> List[List[int]]:
    """Indices into ``lengths``, grouped into packs of total length at most ``capacity``. Every
    index appears in exactly one pack, in the order the samples were placed. A length above
    ``capacity`` is a caller's error (truncate first)."""
    packs: List[List[int]] = []
    buckets: Dict[int, deque] = {}  # free space -> open packs with exactly that much, oldest first
    free_values: List[int] = []  # the keys of ``buckets``, sorted
    for i, n in enumerate(lengths):
        n = int(n)
        if not 0 < n <= capacity:
            raise ValueError(f"sample {i} has length {n}, outside (0, {capacity}]")
        at = bisect.bisect_left(free_values, n)
        if at < len(free_values):
            free = free_values[at]
            pack = buckets[free].popleft()
            if not buckets[free]:
                del buckets[free]
                free_values.pop(at)
        else:
            free, pack = capacity, len(packs)
            packs.append([])
        packs[pack].append(i)
        left = free - n
        if left > 0:  # a full pack is closed
            if left not in buckets:
                buckets[left] = deque()
                bisect.insort(free_values, left)
            buckets[left].append(pack)
    return packs


def one_per_pack(count: int) -> List[List[int]]:
    """No packing (``data.packing=false``): every sample alone in its own, padded sequence."""
    return [[i] for i in range(count)]


def padding_fraction(packs: Sequence[Sequence[int]], lengths: np.ndarray, capacity: int) -> float:
    """The share of the packs' positions that are padding."""
    if not packs:
        return 0.0
    used = sum(int(lengths[i]) for pack in packs for i in pack)
    return 1.0 - used / (len(packs) * capacity)
