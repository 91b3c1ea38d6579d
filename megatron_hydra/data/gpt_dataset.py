"""GPT samples: fixed-length windows over a shuffled stream of documents.

A sample is ``seq_length + 1`` consecutive tokens of the stream (inputs plus the next-token
target), and consecutive samples share one token, so every token is an input exactly once per
epoch. Samples run across document boundaries, as in Megatron: nothing is padded, and the EOD
token the preprocessor appended marks where one document ends.

Three arrays turn a sample number into tokens, built once and cached as ``.npy`` under a hash of
everything they depend on:

- ``doc``: the stream, as sequence ids of the indexed file, epoch after epoch; each epoch is an
  independent permutation of the split's documents (a document's sequences stay in order);
- ``sample``: for sample ``i``, the position in ``doc`` and the token offset where it starts
  (entry ``i + 1`` is where it ends);
- ``shuffle``: the order in which samples are served; samples are shuffled within the epoch
  they start in, so the first ``k`` epochs' worth of items covers the split exactly ``k`` times
  (plus, at most, the few tokens the last sample reaches into the next epoch).

The number of epochs is the smallest that yields the requested number of samples (Megatron's
rule); ``len()`` is the number of samples in those epochs, which may exceed the request.
Each epoch's permutations come from their own random stream ``(seed, epoch)``, so asking for
more samples extends the stream without changing its beginning, and item ``k`` is a pure
function of (corpus, split, seq_length, seed, k): a run resumed at ``consumed_samples = k``
gets exactly the samples an uninterrupted run would have.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from typing import Dict, Optional

import numpy as np
import torch

from megatron_hydra.data.indexed import IndexedDataset
from megatron_hydra.data.packed_documents import DocumentFlags
from megatron_hydra.errors import DataError

log = logging.getLogger(__name__)
# Bump when the index construction changes, so old caches are not reused.
_INDEX_VERSION = 1
_ARRAYS = ("doc", "sample", "shuffle")


def _rng(seed: int, epoch: int, purpose: int) -> np.random.RandomState:
    """A stream per (seed, epoch, purpose). RandomState rather than Generator because numpy
    guarantees its output never changes across versions, and cached indices outlive installs."""
    return np.random.RandomState([seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF, epoch, purpose])


def num_epochs_for(num_samples: int, tokens_per_epoch: int, seq_length: int) -> int:
    """Smallest E such that at least ``num_samples`` samples start within the first E epochs."""
    return max(1, ((num_samples - 1) * seq_length) // tokens_per_epoch + 1)


def _expand(documents: np.ndarray, doc_idx: np.ndarray) -> np.ndarray:
    """Sequence ids of ``documents``, in that order (a document is doc_idx[d]:doc_idx[d+1])."""
    starts, ends = doc_idx[documents], doc_idx[documents + 1]
    counts = ends - starts
    if np.all(counts == 1):
        return starts
    firsts = np.cumsum(counts) - counts
    return np.repeat(starts - firsts, counts) + np.arange(counts.sum())


def build_indices(indexed: IndexedDataset, documents: np.ndarray, num_epochs: int,
                  seq_length: int, seed: int) -> Dict[str, np.ndarray]:
    """The three index arrays (see the module docstring), in memory."""
    doc_idx = np.asarray(indexed.document_indices)
    lengths = np.asarray(indexed.sequence_lengths)
    id_dtype = np.int32 if len(indexed) < 2**31 else np.int64
    epoch_seqs = [_expand(_rng(seed, e, 0).permutation(documents), doc_idx) for e in range(num_epochs)]
    tokens_per_epoch = int(lengths[epoch_seqs[0]].sum(dtype=np.int64))
    if tokens_per_epoch == 0:
        raise ValueError("the documents hold no tokens")
    # The first documents of the following epoch(s) complete the last sample that starts in the
    # last epoch; they are the same documents a longer run would see there.
    extra, extra_tokens, e = [], 0, num_epochs
    while extra_tokens < seq_length + 1:
        extra.append(_expand(_rng(seed, e, 0).permutation(documents), doc_idx))
        extra_tokens += tokens_per_epoch
        e += 1
    extra = np.concatenate(extra)
    need = np.searchsorted(np.cumsum(lengths[extra], dtype=np.int64), seq_length + 1) + 1
    doc = np.concatenate(epoch_seqs + [extra[:need]]).astype(id_dtype)
    cum = np.zeros(len(doc) + 1, dtype=np.int64)
    np.cumsum(lengths[doc], out=cum[1:])
    # Sample i starts at stream position i * seq_length; one block of samples per epoch.
    bounds = [-(-e * tokens_per_epoch // seq_length) for e in range(num_epochs + 1)]
    starts = np.arange(bounds[-1] + 1, dtype=np.int64) * seq_length
    where = np.searchsorted(cum, starts, side="right") - 1
    sample = np.stack([where, starts - cum[where]], axis=1)
    sample = sample.astype(id_dtype if len(doc) < 2**31 else np.int64)  # offsets are < 2**31
    shuffle = np.concatenate([
        bounds[e] + _rng(seed, e, 1).permutation(bounds[e + 1] - bounds[e]) for e in range(num_epochs)])
    shuffle = shuffle.astype(np.int32 if bounds[-1] < 2**31 else np.int64)
    return {"doc": doc, "sample": sample, "shuffle": shuffle}


def _save_atomic(path: str, arr: np.ndarray) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        np.save(f, arr, allow_pickle=False)
    os.replace(tmp, path)


def _save_json(path: str, obj) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


class GPTDataset(torch.utils.data.Dataset):
    """Items ``{"tokens", "labels", "loss_mask"}`` of length ``seq_length`` from ``documents``
    (ids of documents of ``indexed``, e.g. one split) of an indexed corpus; with ``flags``, the
    loss mask, ``position_ids`` and ``document_ids`` follow the sample's EOD tokens
    (``packed_documents``).

    Must be constructed on every rank when ``torch.distributed`` is initialised: global rank 0
    builds the cached indices while the others wait at a barrier, then all map them.
    """

    def __init__(self, indexed: IndexedDataset, documents: np.ndarray, num_samples: int,
                 seq_length: int, seed: int, cache_dir: str, name: str = "train",
                 flags: Optional[DocumentFlags] = None):
        documents = np.asarray(documents, dtype=np.int64)
        num_samples, seq_length, seed = int(num_samples), int(seq_length), int(seed)
        if len(documents) == 0:
            raise DataError(f"{indexed.prefix}: the {name} split has no documents; change data.split")
        lengths = np.asarray(indexed.sequence_lengths)
        tokens = int(lengths[_expand(documents, np.asarray(indexed.document_indices))].sum(dtype=np.int64))
        if tokens == 0:
            raise DataError(f"{indexed.prefix}.bin: the {name} split has no tokens: the corpus is empty")
        self.indexed, self.name, self.seq_length = indexed, name, seq_length
        self.flags = flags if flags is not None and flags.any else None
        self.num_epochs = num_epochs_for(max(num_samples, 1), tokens, seq_length)
        self.tokens_per_epoch = tokens
        desc = {"class": "GPTDataset", "version": _INDEX_VERSION, "prefix": os.path.abspath(indexed.prefix),
                "num_sequences": len(indexed), "num_tokens": indexed.num_tokens,
                "documents": hashlib.sha256(documents.tobytes()).hexdigest(),
                "num_epochs": self.num_epochs, "seq_length": seq_length, "seed": seed}
        key = hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:24]
        self.paths = {a: os.path.join(cache_dir, f"gpt_{key}_{a}.npy") for a in _ARRAYS}
        self._build_once(indexed, documents, seed, cache_dir, desc, key)
        self._load()

    def _build_once(self, indexed, documents, seed, cache_dir, desc, key) -> None:
        dist = torch.distributed
        distributed = dist.is_available() and dist.is_initialized()
        if not distributed or dist.get_rank() == 0:
            self._build_if_missing(indexed, documents, seed, cache_dir, desc, key)
        if distributed:
            dist.barrier()
            # A node whose cache directory is not shared with rank 0 builds its own copy.
            self._build_if_missing(indexed, documents, seed, cache_dir, desc, key)

    def _build_if_missing(self, indexed, documents, seed, cache_dir, desc, key) -> None:
        if all(map(os.path.isfile, self.paths.values())):
            return
        try:
            os.makedirs(cache_dir, exist_ok=True)
            if not os.access(cache_dir, os.W_OK):
                raise PermissionError
        except OSError:
            raise DataError(f"{cache_dir}: cannot write the dataset index cache here; "
                            f"set data.cache_dir to a writable directory") from None
        t0 = time.time()
        arrays = build_indices(indexed, documents, self.num_epochs, self.seq_length, seed)
        for a in _ARRAYS:
            _save_atomic(self.paths[a], arrays[a])
        _save_json(os.path.join(cache_dir, f"gpt_{key}.json"),
                   dict(desc, name=self.name, num_samples=len(arrays["shuffle"])))
        log.info("built %s indices: %d epochs, %d samples in %.1f s -> %s", self.name,
                 self.num_epochs, len(arrays["shuffle"]), time.time() - t0, cache_dir)

    def _load(self) -> None:
        self._doc, self._sample, self._shuffle = (np.load(self.paths[a], mmap_mode="r") for a in _ARRAYS)

    def __getstate__(self):
        """Pickle the paths, not the mapped arrays (a spawned DataLoader worker re-maps them)."""
        state = dict(self.__dict__)
        for a in ("_doc", "_sample", "_shuffle"):
            state.pop(a)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._load()

    def __len__(self) -> int:
        return len(self._shuffle)

    def sample_tokens(self, idx: int) -> np.ndarray:
        """The ``seq_length + 1`` tokens of item ``idx`` as int64."""
        if not -len(self) <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for the {len(self)} samples of {self.name}")
        i = int(self._shuffle[idx])
        (d0, o0), (d1, o1) = self._sample[i], self._sample[i + 1]
        d0, o0, d1, o1 = int(d0), int(o0), int(d1), int(o1)
        get, doc = self.indexed.get, self._doc
        if d0 == d1:
            parts = [get(int(doc[d0]), o0, o1 - o0 + 1)]
        else:
            parts = ([get(int(doc[d0]), o0)] + [get(int(doc[d])) for d in range(d0 + 1, d1)]
                     + [get(int(doc[d1]), 0, o1 + 1)])
        return np.concatenate(parts).astype(np.int64)

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        arr = torch.from_numpy(self.sample_tokens(idx))
        if self.flags is not None:
            return {"tokens": arr[:-1], "labels": arr[1:], **self.flags.fields(arr[:-1])}
        return {"tokens": arr[:-1], "labels": arr[1:],
                "loss_mask": torch.ones(self.seq_length, dtype=torch.float32)}


def default_cache_dir(prefix: str, cache_dir: Optional[str]) -> str:
    """``data.cache_dir`` if set, else an ``index_cache`` folder next to the data."""
    if cache_dir:
        return os.path.expanduser(cache_dir)
    return os.path.join(os.path.dirname(os.path.abspath(prefix)), "index_cache")
