"""Synthetic token sequences that a model can learn, with no files and no tokenizer.

Sample i is fully determined by (seed, i): its first half is drawn from a Zipf distribution over
the vocabulary (a unigram the model picks up in a few steps), its second half repeats the first
(a copy task that attention learns later). So the loss falls quickly from log(vocab), and keeps
falling. The default for tests and smoke runs.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


class SyntheticDataset(Dataset):
    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int):
        self.num_samples, self.seq_length, self.seed = num_samples, seq_length, seed
        self.probs = 1.0 / torch.arange(1, vocab_size + 1, dtype=torch.float64)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int):
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + idx)
        half = (self.seq_length + 2) // 2
        first = torch.multinomial(self.probs, half, replacement=True, generator=gen)
        seq = torch.cat([first, first])[: self.seq_length + 1]
        return {"tokens": seq[:-1], "labels": seq[1:], "loss_mask": torch.ones(self.seq_length)}
