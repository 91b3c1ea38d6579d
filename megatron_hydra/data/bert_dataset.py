"""BERT samples from sentence-split indexed data, as Megatron builds them.

The corpus holds one sentence per sequence and marks documents (``preprocess split_sentences=true``).

Samples mapping (``sentence_samples.build_samples_mapping``): runs of consecutive sentences of
``seq_length - 3`` target tokens, at least two sentences per run when the sentence-order head
needs an A and a B segment.

A sample (``build_sample``), with its own random stream seeded by (seed + index) so it is a pure
function of the index: split the run at a random sentence into segments A and B and swap them with
probability 1/2 (the sentence-order label); truncate the longer segment, from a random end, until
both fit; lay out ``[CLS] A [SEP] B [SEP]`` with token types 0 / 1; mask
``round(masked_lm_prob * length)`` tokens (at most that fraction of the longest sample), never
[CLS] or [SEP], whole words together when ``whole_word_masking``: each masked token becomes [MASK]
with probability 0.8, stays itself with 0.1 and becomes a uniformly random token with 0.1; pad.

Special tokens are the tokenizer's own when its vocabulary has them ([CLS], [SEP], [MASK], [PAD]
of a WordPiece vocabulary), else new ids right after its vocabulary, which ``model.vocab_size``
must then cover (``special_tokens``).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from megatron_hydra.data.indexed import IndexedDataset
from megatron_hydra.data.sentence_samples import build_samples_mapping
from megatron_hydra.data.tokenizers import ByteTokenizer, Tokenizer
from megatron_hydra.errors import DataError

BERT_SPECIALS = ("[CLS]", "[SEP]", "[MASK]", "[PAD]")


def special_tokens(tok: Tokenizer, names: Sequence[str]) -> Dict[str, int]:
    """Ids of ``names``: the tokenizer's own where it has them, else new ids after its vocabulary."""
    ids, nxt = {}, tok.vocab_size
    for name in names:
        i = tok.token_to_id(name)
        if i is None:
            i, nxt = nxt, nxt + 1
        ids[name] = i
    return ids


def check_vocab_covers(ids: Dict[str, int], vocab_size: int, what: str) -> None:
    need = max(ids.values()) + 1
    if need > vocab_size:
        raise DataError(f"model.vocab_size={vocab_size} is too small for the {what} special tokens the tokenizer "
                        f"lacks (they take ids up to {need - 1}): set model.vocab_size >= {need}")


def word_starts(tok: Tokenizer, size: int) -> np.ndarray:
    """Whether each id begins a word, for whole-word masking: WordPiece marks continuations with
    "##"; byte-level BPE and SentencePiece mark word starts with "Ġ" / "▁"; bytes start a word
    at whitespace. Ids without a spelling (added specials) start words."""
    if isinstance(tok, ByteTokenizer):
        starts = np.ones(size, dtype=bool)
        starts[:256] = [chr(b).isspace() for b in range(256)]
        return starts
    pieces = [tok.id_to_token(i) if i < tok.vocab_size else None for i in range(size)]
    if not any(pieces):
        raise DataError("data.whole_word_masking=true needs a tokenizer whose vocabulary spells its pieces "
                        "(hf or sentencepiece); set it to false")
    if any(p is not None and p.startswith("##") for p in pieces):
        return np.array([p is None or not p.startswith("##") for p in pieces])
    return np.array([p is None or p.startswith(("Ġ", "▁")) for p in pieces])


def _segments(sentences: List[np.ndarray], binary_head: bool, rng: np.random.RandomState):
    """Segments A and B and whether they were swapped."""
    if not binary_head:
        return np.concatenate(sentences), np.zeros(0, np.int64), False
    a_end = int(rng.randint(1, len(sentences))) if len(sentences) >= 2 else 1
    a, b = np.concatenate(sentences[:a_end]), np.concatenate(sentences[a_end:])
    if rng.random_sample() < 0.5:
        return b, a, True
    return a, b, False


def _truncate(a: np.ndarray, b: np.ndarray, max_num_tokens: int, rng: np.random.RandomState):
    """Drop tokens of the longer segment, from a random end, until both fit."""
    a_lo, a_hi, b_lo, b_hi = 0, len(a), 0, len(b)
    while (a_hi - a_lo) + (b_hi - b_lo) > max_num_tokens:
        front = rng.random_sample() < 0.5
        if a_hi - a_lo > b_hi - b_lo:
            a_lo, a_hi = (a_lo + 1, a_hi) if front else (a_lo, a_hi - 1)
        else:
            b_lo, b_hi = (b_lo + 1, b_hi) if front else (b_lo, b_hi - 1)
    return a[a_lo:a_hi], b[b_lo:b_hi]


def mask_tokens(tokens: np.ndarray, candidates: np.ndarray, num_to_mask: int, ids: Dict[str, int],
                vocab_size: int, rng: np.random.RandomState, starts: Optional[np.ndarray] = None):
    """Masked copy of ``tokens`` and the masked positions (sorted). ``candidates``: maskable
    positions in order; with ``starts`` (word-start table) a word's pieces are masked together."""
    groups: List[List[int]] = []
    for i in candidates:
        if starts is not None and groups and not starts[tokens[i]] and groups[-1][-1] == i - 1:
            groups[-1].append(int(i))
        else:
            groups.append([int(i)])
    order = rng.permutation(len(groups))
    out, masked = tokens.copy(), []
    for g in order:
        if len(masked) >= num_to_mask:
            break
        if len(masked) + len(groups[g]) > num_to_mask:
            continue
        for i in groups[g]:
            if rng.random_sample() < 0.8:
                out[i] = ids["[MASK]"]
            elif rng.random_sample() >= 0.5:
                out[i] = rng.randint(0, vocab_size)
            masked.append(i)
    return out, np.sort(np.asarray(masked, dtype=np.int64))


def build_sample(sentences: List[np.ndarray], target_length: int, seq_length: int, ids: Dict[str, int],
                 vocab_size: int, masked_lm_prob: float, binary_head: bool, rng: np.random.RandomState,
                 starts: Optional[np.ndarray] = None) -> Dict[str, torch.Tensor]:
    """One training sample (see the module docstring); ``vocab_size``: the tokenizer's, from
    which random replacements are drawn."""
    specials = 3 if binary_head else 2
    max_num_tokens = seq_length - specials
    a, b, swapped = _segments(sentences, binary_head, rng)
    a, b = _truncate(a, b, min(target_length, max_num_tokens), rng)
    cls, sep = ids["[CLS]"], ids["[SEP]"]
    parts = [[cls], a, [sep]] + ([b, [sep]] if binary_head else [])
    tokens = np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])
    types = np.zeros(len(tokens), dtype=np.int64)
    types[len(a) + 2:] = 1
    n = len(tokens)
    candidates = np.flatnonzero((tokens != cls) & (tokens != sep))
    num_to_mask = min(max(1, int(round(masked_lm_prob * max_num_tokens))), max(1, int(round(n * masked_lm_prob))))
    masked_tokens, positions = mask_tokens(tokens, candidates, num_to_mask, ids, vocab_size, rng, starts)
    pad = ids["[PAD]"]
    out = {k: torch.full((seq_length,), v, dtype=torch.int64) for k, v in (("tokens", pad), ("labels", pad))}
    out["tokens"][:n] = torch.from_numpy(masked_tokens)
    out["labels"][positions] = torch.from_numpy(tokens[positions])
    out["loss_mask"] = torch.zeros(seq_length, dtype=torch.float32)
    out["loss_mask"][positions] = 1.0
    out["padding_mask"] = (torch.arange(seq_length) < n).long()
    out["token_types"] = torch.zeros(seq_length, dtype=torch.int64)
    out["token_types"][:n] = torch.from_numpy(types)
    out["sop_labels"] = torch.tensor(int(swapped))
    return out


class BertDataset(torch.utils.data.Dataset):
    """Items ``{tokens, labels, loss_mask, padding_mask, token_types, sop_labels}`` of length
    ``seq_length`` from ``documents`` of a sentence-split indexed corpus. Every rank builds the
    same mapping from the same seed."""

    def __init__(self, indexed: IndexedDataset, documents: np.ndarray, num_samples: int, seq_length: int,
                 seed: int, tokenizer: Tokenizer, ids: Dict[str, int], masked_lm_prob: float = 0.15,
                 short_seq_prob: float = 0.1, binary_head: bool = True, whole_word_masking: bool = False,
                 name: str = "train"):
        self.indexed, self.seq_length, self.seed, self.name = indexed, int(seq_length), int(seed), name
        self.ids, self.vocab_size = ids, tokenizer.vocab_size
        self.masked_lm_prob, self.binary_head = masked_lm_prob, binary_head
        self.starts = word_starts(tokenizer, max(tokenizer.vocab_size, max(ids.values()) + 1)) if whole_word_masking else None
        max_num_tokens = self.seq_length - (3 if binary_head else 2)
        if max_num_tokens < 2:
            raise DataError(f"model.seq_length={seq_length} leaves no room for a BERT sample: raise it")
        self.mapping = build_samples_mapping(indexed, np.asarray(documents, dtype=np.int64), int(num_samples),
                                             max_num_tokens, short_seq_prob, 2 if binary_head else 1, self.seed)

    def __len__(self) -> int:
        return len(self.mapping)

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        first, end, target = (int(v) for v in self.mapping[idx])
        rng = np.random.RandomState((self.seed + idx) % 2**32)
        sentences = [self.indexed.get(i).astype(np.int64) for i in range(first, end)]
        return build_sample(sentences, target, self.seq_length, self.ids, self.vocab_size, self.masked_lm_prob,
                            self.binary_head, rng, self.starts)
