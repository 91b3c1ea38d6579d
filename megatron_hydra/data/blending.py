"""Blending several datasets into one stream with exact proportions.

Sampling each item's source at random only matches the weights on average: over a run's first
thousand batches a small dataset can be over- or under-represented by several percent. Megatron
instead interleaves deterministically so that every prefix of the stream is within a constant
of the weights. It uses a greedy rule (take the dataset furthest below its share), which is
sequential and needs a compiled helper to be fast.

We use the sequential Sainte-Laguë order instead: dataset ``d``'s ``k``-th item is due at time
``(k + 1/2) / w_d`` and the stream is all items sorted by due time (ties to the lower dataset
index). It is one numpy sort, and its bound is proven rather than measured: after any ``n``
items, dataset ``d`` has contributed ``c_d`` with ``|c_d - w_d * n| <= (1 + K * w_d) / 2``
(K datasets), never worse than the greedy rule's ``max(1, K - 1)``.

Proof sketch: let ``t`` be the due time of item ``n``. Every item due before ``t`` is in the
prefix and none due after, so ``w_d t - 1/2 <= c_d <= w_d t + 1/2``; summing over ``d`` gives
``|n - t| <= K / 2``, and substituting ``t`` gives the bound.
"""

from __future__ import annotations

from typing import Dict, Sequence, Tuple

import numpy as np
import torch


def deviation_bound(weights: Sequence[float]) -> np.ndarray:
    """Largest ``|count_d - w_d * n|`` any prefix of the blend can show, per dataset."""
    w = normalize(weights)
    return (1.0 + len(w) * w) / 2.0


def normalize(weights: Sequence[float]) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise ValueError(f"blend weights must be positive finite numbers, got {list(weights)}")
    return w / w.sum()


def blending_indices(weights: Sequence[float], size: int) -> Tuple[np.ndarray, np.ndarray]:
    """For each of ``size`` items: which dataset it comes from, and its index in that dataset."""
    w = normalize(weights)
    # Enough candidates per dataset to cover the bound, so the sort never runs short.
    counts = np.floor(w * size + deviation_bound(w)).astype(np.int64) + 1
    ks = [np.arange(c, dtype=np.int64) for c in counts]
    due = np.concatenate([(k + 0.5) / wd for k, wd in zip(ks, w)])
    source = np.concatenate([np.full(c, d, dtype=np.int64) for d, c in enumerate(counts)])
    order = np.lexsort((source, due))[:size]
    dataset_index = source[order].astype(np.uint8 if len(w) < 256 else np.int32)
    return dataset_index, np.concatenate(ks)[order]


class BlendedDataset(torch.utils.data.Dataset):
    """``size`` items drawn from ``datasets`` in the proportions ``weights``, deterministically.

    Item ``i`` is ``datasets[dataset_index[i]][dataset_sample_index[i]]``; each dataset must
    have at least as many items as the blend takes from it (``required_sizes``).
    """

    def __init__(self, datasets: Sequence[torch.utils.data.Dataset], weights: Sequence[float], size: int):
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        self.datasets = list(datasets)
        self.weights = normalize(weights)
        self.dataset_index, self.dataset_sample_index = blending_indices(self.weights, size)
        for d, ds in enumerate(self.datasets):
            taken = int(np.count_nonzero(self.dataset_index == d))
            if taken > len(ds):
                raise ValueError(f"the blend takes {taken} items from dataset {d}, which has {len(ds)}")

    @staticmethod
    def required_sizes(weights: Sequence[float], size: int) -> np.ndarray:
        """How many items each dataset must provide for a blend of ``size`` items."""
        w = normalize(weights)
        return np.ceil(w * size + deviation_bound(w)).astype(np.int64)

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        if not -len(self) <= idx < len(self):
            raise IndexError(f"item {idx} out of range for a blend of {len(self)}")
        d = int(self.dataset_index[idx])
        return self.datasets[d][int(self.dataset_sample_index[idx])]
