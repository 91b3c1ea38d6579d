"""Batch sampler that makes the global batch identical for every parallel layout.

Step k consumes samples ``[k*G, (k+1)*G)`` of the dataset (G = global batch size), whatever the
number of data-parallel ranks; DP rank r takes the contiguous slice
``[k*G + r*G/dp, k*G + (r+1)*G/dp)``, which the training step cuts into micro-batches. Starting at
``consumed_samples`` resumes exactly where a previous run stopped (Megatron's pretraining sampler).
"""

from __future__ import annotations

from typing import Iterator, List

from torch.utils.data import Sampler


class GlobalBatchSampler(Sampler[List[int]]):
    def __init__(self, total_samples: int, global_batch_size: int, dp_rank: int, dp_size: int,
                 consumed_samples: int = 0):
        if global_batch_size % dp_size:
            raise ValueError(f"global batch {global_batch_size} not divisible by dp size {dp_size}")
        self.total, self.global_batch, self.consumed = total_samples, global_batch_size, consumed_samples
        self.share = global_batch_size // dp_size
        self.offset = dp_rank * self.share

    def __len__(self) -> int:
        return max(0, (self.total - self.consumed) // self.global_batch)

    def __iter__(self) -> Iterator[List[int]]:
        for start in range(self.consumed, self.total - self.global_batch + 1, self.global_batch):
            first = start + self.offset
            yield list(range(first, first + self.share))
