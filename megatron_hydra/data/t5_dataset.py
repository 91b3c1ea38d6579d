"""T5 span-corruption samples from sentence-split indexed data (Raffel et al. 2020, section 3.1.4).

Raw text: the same samples mapping as BERT (``sentence_samples.build_samples_mapping``, one sentence
at least), its sentences concatenated and cut to the longest raw length ``L`` whose corrupted
form fits ``seq_length`` (encoder) and ``decoder_seq_length`` (decoder).

Noise (``random_spans_noise_mask``, T5's): of a raw length n, ``round(n * density)`` tokens are
noise, in ``round(noise / mean_span_length)`` spans; the noise tokens and the kept tokens are each
cut into that many non-empty runs uniformly at random, and the runs alternate, kept first. So the
noise fraction is exactly the density (up to rounding) and the mean span length the requested one.

Encoder input: the kept tokens, each noise span replaced by one sentinel (the i-th span by the
i-th sentinel), then end-of-document. Decoder labels: each sentinel followed by the span it
replaced, then end-of-document; decoder input: the labels shifted right behind a start token
(the pad id, as T5). Both are padded; a padding mask and a loss mask mark the real tokens.
Sentinels are ``<extra_id_i>`` of the tokenizer when it has them (T5's SentencePiece), else
new ids after its vocabulary (``bert_dataset.special_tokens``).
"""

from __future__ import annotations

from typing import Dict, List

import numpy as np
import torch

from megatron_hydra.data.indexed import IndexedDataset
from megatron_hydra.data.sentence_samples import build_samples_mapping
from megatron_hydra.errors import DataError

NUM_SENTINELS = 100
T5_SPECIALS = ("<pad>",) + tuple(f"<extra_id_{i}>" for i in range(NUM_SENTINELS))


def noise_counts(length: int, density: float, mean_span: float):
    """(noise tokens, noise spans) of a raw length."""
    noise = min(max(int(round(length * density)), 1), length - 1)
    return noise, max(int(round(noise / mean_span)), 1)


def raw_length(seq_length: int, decoder_seq_length: int, density: float, mean_span: float) -> int:
    """The longest raw length such that it and every shorter one fit both sides once corrupted
    (encoder: kept tokens + one sentinel per span + EOS; decoder: noise + sentinels + EOS)."""
    best = 0
    for n in range(2, 4 * seq_length):
        noise, spans = noise_counts(n, density, mean_span)
        if n - noise + spans + 1 > seq_length or noise + spans + 1 > decoder_seq_length or spans > NUM_SENTINELS:
            break
        best = n
    if best < 2:
        raise DataError(f"model.seq_length={seq_length} / model.decoder_seq_length={decoder_seq_length} are too "
                        "short for a T5 sample: raise them")
    return best


def _segmentation(items: int, segments: int, rng: np.random.RandomState) -> np.ndarray:
    """Lengths of ``segments`` non-empty runs summing to ``items``, uniformly at random."""
    first = np.zeros(items, dtype=bool)
    cuts = np.arange(items - 1) < segments - 1
    rng.shuffle(cuts)
    first[1:] = cuts
    return np.bincount(np.cumsum(first), minlength=segments)


def random_spans_noise_mask(length: int, density: float, mean_span: float, rng: np.random.RandomState) -> np.ndarray:
    """Boolean noise mask of ``length`` tokens (True = noise); see the module docstring."""
    noise, spans = noise_counts(length, density, mean_span)
    runs = np.stack([_segmentation(length - noise, spans, rng), _segmentation(noise, spans, rng)], 1).reshape(-1)
    return np.repeat(np.tile([False, True], spans), runs)


def build_sample(raw: np.ndarray, seq_length: int, decoder_seq_length: int, sentinels: List[int], pad: int,
                 eod: int, density: float, mean_span: float, rng: np.random.RandomState) -> Dict[str, torch.Tensor]:
    noise = random_spans_noise_mask(len(raw), density, mean_span, rng)
    span_start = noise & ~np.concatenate([[False], noise[:-1]])
    span_id = np.cumsum(span_start) - 1  # index of the span each noise token belongs to
    encoder = np.where(span_start, np.asarray(sentinels)[np.maximum(span_id, 0)], raw)[~noise | span_start]
    encoder = np.append(encoder, eod)
    labels: List[int] = []
    for s in range(int(span_start.sum())):
        labels.append(sentinels[s])
        labels.extend(raw[noise & (span_id == s)].tolist())
    labels.append(eod)
    out = {}
    out["tokens"] = torch.full((seq_length,), pad, dtype=torch.int64)
    out["tokens"][:len(encoder)] = torch.from_numpy(encoder)
    out["padding_mask"] = (torch.arange(seq_length) < len(encoder)).long()
    out["labels"] = torch.full((decoder_seq_length,), pad, dtype=torch.int64)
    out["labels"][:len(labels)] = torch.tensor(labels)
    out["decoder_tokens"] = torch.full((decoder_seq_length,), pad, dtype=torch.int64)
    out["decoder_tokens"][1:len(labels)] = out["labels"][:len(labels) - 1]
    out["loss_mask"] = (torch.arange(decoder_seq_length) < len(labels)).float()
    return out


class T5Dataset(torch.utils.data.Dataset):
    """Items ``{tokens, padding_mask, decoder_tokens, labels, loss_mask}`` from ``documents`` of a
    sentence-split indexed corpus."""

    def __init__(self, indexed: IndexedDataset, documents: np.ndarray, num_samples: int, seq_length: int,
                 decoder_seq_length: int, seed: int, ids: Dict[str, int], eod: int, masked_lm_prob: float = 0.15,
                 mean_noise_span_length: float = 3.0, short_seq_prob: float = 0.1, name: str = "train"):
        self.indexed, self.seed, self.name = indexed, int(seed), name
        self.seq_length, self.decoder_seq_length = int(seq_length), int(decoder_seq_length)
        self.density, self.mean_span = masked_lm_prob, mean_noise_span_length
        self.sentinels = [ids[f"<extra_id_{i}>"] for i in range(NUM_SENTINELS)]
        self.pad, self.eod = ids["<pad>"], eod
        self.max_raw = raw_length(self.seq_length, self.decoder_seq_length, self.density, self.mean_span)
        self.mapping = build_samples_mapping(indexed, np.asarray(documents, dtype=np.int64), int(num_samples),
                                             self.max_raw, short_seq_prob, 1, self.seed)

    def __len__(self) -> int:
        return len(self.mapping)

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        first, end, target = (int(v) for v in self.mapping[idx])
        rng = np.random.RandomState((self.seed + idx) % 2**32)
        raw = np.concatenate([self.indexed.get(i) for i in range(first, end)]).astype(np.int64)[:target]
        if len(raw) < 2:
            raw = np.concatenate([raw, [self.eod] * (2 - len(raw))]).astype(np.int64)
        return build_sample(raw, self.seq_length, self.decoder_seq_length, self.sentinels, self.pad, self.eod,
                            self.density, self.mean_span, rng)
