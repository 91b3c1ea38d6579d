"""Supervised fine-tuning samples (``data=sft``): conversations from a jsonl file, packed.

Each line of ``data.path`` is one sample, either ``{"messages": [{"role": "system" | "user" |
"assistant", "content": "..."}, ...]}`` (at least one assistant message) or ``{"prompt": "...",
"response": "..."}`` (a user message and the assistant's answer). Blank lines are skipped; any
other line that is not such an object stops the run with the file and line number.

A conversation becomes token ids and a learned flag per id (``chat_template``). As a training
sample of ``n`` ids it occupies ``n - 1`` positions: inputs ``ids[:-1]``, labels ``ids[1:]``, and
``loss_mask`` the flags of the labels, so the loss covers exactly the assistant's tokens. A
conversation longer than ``seq_length + 1`` ids is truncated to its first ``seq_length + 1`` (its
beginning is kept, the tail dropped); one whose assistant tokens all fall beyond that is left out,
and the count of those is logged.

Samples are packed (``packing``) into sequences of ``seq_length``: each sample keeps its own
positions (``position_ids`` restart at 0) and gets its own ``document_ids`` value (0, 1, ... along
the sequence); the padding at the end of a pack is one more document, with ``loss_mask`` 0. The
batch fields are ``tokens``, ``labels``, ``loss_mask``, ``position_ids`` and ``document_ids``, all
``[seq_length]`` per item. The GPT family reads ``document_ids`` (``models.archs``): attention is
block-diagonal per sample (``parallel.document_masks``), so the samples of a pack never see each
other, and every parallel layout keeps that (context parallelism included).

Epochs: each epoch is a permutation of the split's samples drawn from ``(seed, split, epoch)``,
packed on its own (``packing.best_fit_packs``) when first reached; the dataset is as many epochs
as the requested number of items needs, so item ``k`` depends only on the file, the tokenizer,
``seq_length``, the seed and ``k`` (a resumed run sees what an uninterrupted one would). Every rank builds the same
datasets; conversations are tokenized in memory at start-up, on every rank.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset

from megatron_hydra.data.chat_template import load_template
from megatron_hydra.data.conversations import check_token_ids, checked_messages, jsonl_rows, tokens_of
from megatron_hydra.data.packing import best_fit_packs, one_per_pack
from megatron_hydra.data.tokenizers import Tokenizer
from megatron_hydra.errors import DataError

log = logging.getLogger(__name__)
_FORMS = ('{"messages": [{"role": ..., "content": ...}, ...]}', '{"prompt": ..., "response": ...}')


def _messages(obj, where: str) -> List[Dict[str, str]]:
    """The conversation of one parsed jsonl line, checked."""
    expected = f"expected {_FORMS[0]} or {_FORMS[1]}"
    if not isinstance(obj, dict):
        raise DataError(f"{where}: a JSON {type(obj).__name__}, {expected}")
    if "messages" in obj:
        messages = obj["messages"]
        if not isinstance(messages, list) or not messages:
            raise DataError(f"{where}: 'messages' must be a non-empty list, {expected}")
        messages = checked_messages(messages, where)
        if not any(m["role"] == "assistant" for m in messages):
            raise DataError(f"{where}: no assistant message, so nothing to learn; add one or remove the line")
        return messages
    if isinstance(obj.get("prompt"), str) and isinstance(obj.get("response"), str):
        return checked_messages([{"role": "user", "content": obj["prompt"]},
                                 {"role": "assistant", "content": obj["response"]}], where)
    raise DataError(f"{where}: {expected}")


def read_conversations(path: str) -> List[List[Dict[str, str]]]:
    """Every conversation of the jsonl file ``path``; a bad line is a one-line DataError naming
    the file and line (``conversations``)."""
    out = [_messages(obj, where) for where, obj in jsonl_rows(path, "conversations")]
    if not out:
        raise DataError(f"data.path={path}: no conversations in the file")
    return out


@dataclass
class SFTSamples:
    """Tokenized documents, concatenated: document ``d`` is ``ids[starts[d]:starts[d+1]]`` with its
    learned flags in ``learned`` (already truncated). A sample, the unit that is split, shuffled
    and packed whole, is ``group`` consecutive documents: a conversation is one, a preference pair
    two (chosen, then rejected), which must share a sequence."""

    ids: np.ndarray
    learned: np.ndarray
    starts: np.ndarray
    group: int = 1

    def __len__(self) -> int:
        return (len(self.starts) - 1) // self.group

    @property
    def positions(self) -> np.ndarray:
        """Positions each sample occupies in a pack (each document's ids minus one, summed)."""
        return (np.diff(self.starts) - 1).reshape(-1, self.group).sum(axis=1)

    def document(self, d: int) -> Tuple[np.ndarray, np.ndarray]:
        return self.ids[self.starts[d]:self.starts[d + 1]], self.learned[self.starts[d]:self.starts[d + 1]]

    def documents(self, i: int) -> List[Tuple[np.ndarray, np.ndarray]]:
        """The documents of sample ``i``, in their order in the sequence."""
        return [self.document(d) for d in range(i * self.group, (i + 1) * self.group)]

    def sample(self, i: int) -> Tuple[np.ndarray, np.ndarray]:
        """Conversation ``i`` (a sample of one document)."""
        return self.document(i)


def concatenate(ids: List[np.ndarray], learned: List[np.ndarray], group: int = 1) -> SFTSamples:
    """``SFTSamples`` of the documents ``ids`` (with their flags ``learned``)."""
    starts = np.cumsum([0] + [len(x) for x in ids]).astype(np.int64)
    return SFTSamples(np.concatenate(ids), np.concatenate(learned), starts, group)


def tokenize_conversations(path: str, tokenizer: Tokenizer, seq_length: int, vocab_size: int) -> SFTSamples:
    """Read, render and tokenize ``path`` (see the module docstring for truncation)."""
    template = load_template(tokenizer)
    ids, flags, dropped = [], [], 0
    for number, messages in enumerate(read_conversations(path), start=1):
        tokens, learned = tokens_of(template, messages, f"{path}: conversation {number}")
        tokens, learned = tokens[: seq_length + 1], learned[: seq_length + 1]
        if len(tokens) < 2 or not learned[1:].any():
            dropped += 1
            continue
        ids.append(tokens)
        flags.append(learned)
    if dropped:
        log.warning("%s: %d conversation(s) left out: no assistant token within the first %d tokens "
                    "(raise model.seq_length to keep them)", path, dropped, seq_length + 1)
    if not ids:
        raise DataError(f"{path}: no conversation has an assistant token within model.seq_length={seq_length}")
    samples = concatenate(ids, flags)
    check_token_ids(samples.ids, path, tokenizer, template, vocab_size)
    log.info("%s: %d conversations, chat template: %s", path, len(samples), template.name)
    return samples


class SFTDataset(Dataset):
    """Packs of the samples ``indices`` of ``samples`` (see the module docstring); each document of
    a sample (two for a preference pair, ``preference_dataset``) is a document of the sequence, with
    its own positions and ``document_ids`` value. Epochs are
    packed when first reached and only the latest few are kept (an older one is packed again when
    asked for: it is a pure function of the seed), so a run of many epochs costs neither start-up
    time nor memory; ``len`` is ``num_items``, or one epoch when that is more."""

    _KEPT_EPOCHS = 2

    def __init__(self, samples: SFTSamples, indices: np.ndarray, num_items: int, seq_length: int, seed: int,
                 packing: bool, pad_id: int, split: int):
        if len(indices) == 0:
            raise ValueError("no samples")
        self.samples, self.indices, self.seq_length, self.pad_id = samples, indices, seq_length, pad_id
        self.seed, self.packing, self.split = seed, packing, split
        self._lengths = samples.positions[indices]
        self._kept: Dict[int, Tuple[np.ndarray, np.ndarray]] = {}
        self._ends: List[int] = []  # items before the end of each epoch packed so far
        self._length = max(num_items, self.epoch_size(0))

    def epoch(self, e: int) -> Tuple[np.ndarray, np.ndarray]:
        """Epoch ``e`` as (pack bounds, sample ids): pack ``p`` is ``ids[bounds[p]:bounds[p+1]]``."""
        if e not in self._kept:
            rng = np.random.RandomState([self.seed & 0xFFFFFFFF, self.split, e])
            order = rng.permutation(len(self.indices))
            packs = best_fit_packs(self._lengths[order], self.seq_length) if self.packing else one_per_pack(len(order))
            flat = self.indices[order[np.concatenate(packs)]].astype(np.int64)
            bounds = np.cumsum([0] + [len(p) for p in packs]).astype(np.int64)
            if len(self._kept) >= self._KEPT_EPOCHS:
                del self._kept[min(self._kept)]
            self._kept[e] = (bounds, flat)
            if e == len(self._ends):
                self._ends.append((self._ends[-1] if self._ends else 0) + len(packs))
        return self._kept[e]

    def epoch_size(self, e: int) -> int:
        """The number of packs (items) of epoch ``e``."""
        return len(self.epoch(e)[0]) - 1

    def __len__(self) -> int:
        return self._length

    def pack(self, idx: int) -> np.ndarray:
        """The sample ids of item ``idx``, in their order in the sequence."""
        if not 0 <= idx < self._length:
            raise IndexError(f"item {idx} of {self._length}")
        while self._ends[-1] <= idx:
            self.epoch(len(self._ends))
        e = int(np.searchsorted(self._ends, idx, side="right"))
        bounds, flat = self.epoch(e)
        local = idx - (self._ends[e - 1] if e else 0)
        return flat[bounds[local]:bounds[local + 1]]

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        s = self.seq_length
        tokens = np.full(s, self.pad_id, np.int64)
        labels = np.full(s, self.pad_id, np.int64)
        loss_mask = np.zeros(s, np.float32)
        position_ids = np.zeros(s, np.int64)
        document_ids = np.zeros(s, np.int64)
        at = doc = 0
        for i in self.pack(idx):
            for ids, learned in self.samples.documents(int(i)):
                n = len(ids) - 1
                tokens[at:at + n], labels[at:at + n] = ids[:-1], ids[1:]
                loss_mask[at:at + n] = learned[1:]
                position_ids[at:at + n] = np.arange(n)
                document_ids[at:at + n] = doc
                at, doc = at + n, doc + 1
        position_ids[at:] = np.arange(s - at)
        document_ids[at:] = doc
        return {"tokens": torch.from_numpy(tokens), "labels": torch.from_numpy(labels),
                "loss_mask": torch.from_numpy(loss_mask), "position_ids": torch.from_numpy(position_ids),
                "document_ids": torch.from_numpy(document_ids)}


def build_sft_datasets(samples: SFTSamples, splits: Sequence[np.ndarray], num_samples: Sequence[int],
                       seq_length: int, seed: int, packing: bool, pad_id: int, path: str, what: str = "conversations"):
    """Train, valid and test ``SFTDataset``s over the sample ranges ``splits`` (None where a split
    has no samples or none are requested); ``what`` names the samples in errors."""
    out = []
    for s, (n, part) in enumerate(zip(num_samples, splits)):
        if s == 0 and not len(part):
            raise DataError(f"{path}: the train split is empty ({len(samples)} usable {what}); "
                            f"give it a share in data.split or add {what}")
        out.append(SFTDataset(samples, part, n, seq_length, seed, packing, pad_id, s)
                   if len(part) and (n > 0 or s == 0) else None)
    return tuple(out)
