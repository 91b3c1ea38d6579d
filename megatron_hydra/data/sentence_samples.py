"""Runs of consecutive sentences as samples: the samples mapping Megatron builds for BERT and T5.

The corpus holds one sentence per sequence and marks documents (``preprocess split_sentences=true``).
Each epoch walks the split's documents and cuts each into runs of consecutive sentences that reach
a target length (``max_num_tokens``, or with probability ``short_seq_prob`` a random length in
[2, that], so the model also sees short inputs), keeping at least ``min_sentences`` sentences per
run. A row is (first sentence, end sentence, target length); rows of all epochs are shuffled.
Epochs are added until there are ``num_samples`` rows.
"""

from __future__ import annotations

from typing import List

import numpy as np

from megatron_hydra.data.gpt_dataset import _rng
from megatron_hydra.data.indexed import IndexedDataset
from megatron_hydra.errors import DataError


def build_samples_mapping(indexed: IndexedDataset, documents: np.ndarray, num_samples: int, max_num_tokens: int,
                          short_seq_prob: float, min_sentences: int, seed: int) -> np.ndarray:
    """Rows (first sentence, end sentence, target length), shuffled; see the module docstring."""
    lengths = np.asarray(indexed.sequence_lengths, dtype=np.int64)
    doc_idx = np.asarray(indexed.document_indices, dtype=np.int64)
    epochs: List[np.ndarray] = []
    total, epoch = 0, 0
    while total < max(num_samples, 1):
        rows = _epoch_rows(lengths, doc_idx, documents, max_num_tokens, short_seq_prob, min_sentences,
                           _rng(seed, epoch, 2))
        if not len(rows):
            raise DataError(f"{indexed.prefix}: no document has {min_sentences} or more sentences; make the corpus "
                            "with preprocess split_sentences=true (or disable model.binary_head)")
        epochs.append(rows)
        total += len(rows)
        epoch += 1
    mapping = np.concatenate(epochs)
    return mapping[_rng(seed, 0, 3).permutation(len(mapping))]


def _epoch_rows(lengths, doc_idx, documents, max_num_tokens, short_seq_prob, min_sentences, rng) -> np.ndarray:
    def target() -> int:
        return int(rng.randint(2, max_num_tokens + 1)) if rng.random_sample() < short_seq_prob else max_num_tokens

    rows = []
    for d in documents:
        first, last = int(doc_idx[d]), int(doc_idx[d + 1])
        if last - first < min_sentences:
            continue
        start, size, goal = first, 0, target()
        for s in range(first, last):
            size += int(lengths[s])
            remaining, count = last - s - 1, s - start + 1
            if (size >= goal and remaining > 1 and count >= min_sentences) or remaining == 0:
                if size > 0 and count >= min_sentences:
                    rows.append((start, s + 1, goal))
                start, size, goal = s + 1, 0, target()
    return np.asarray(rows, dtype=np.int64).reshape(-1, 3)
