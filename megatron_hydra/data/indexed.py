"""Megatron-Core's IndexedDataset format (``.bin`` + ``.idx``), read and written byte for byte.

Why this format: every Megatron-derived trainer (Megatron-LM, NeMo, GPT-NeoX) reads it, so a
corpus tokenized here trains there and the other way round; and it is a flat array of tokens
plus three small index arrays, so it memory-maps: a sample is a view into the page cache, not a
copy, and opening a 100 GB corpus costs nothing.

Layout of ``PREFIX.idx`` (all little-endian)::

    9 bytes   magic  b"MMIDIDX\\x00\\x00"
    uint64    version (1)
    uint8     dtype code of the tokens (see DTYPE_CODES)
    uint64    S: number of sequences
    uint64    D: number of document boundaries (documents + 1)
    int32[S]  length of each sequence, in tokens
    int64[S]  byte offset of each sequence in PREFIX.bin
    int64[D]  document boundaries: sequence index where each document starts, then S

``PREFIX.bin`` holds the token arrays of the sequences back to back. A document is one or more
consecutive sequences; ``preprocess`` writes one sequence per document, except for text files
too large to tokenize in one piece.
"""

from __future__ import annotations

import os
import struct
from array import array
from typing import Iterable, List, Optional, Tuple, Type, Union

import numpy as np

from megatron_hydra.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
# Codes fixed by Megatron-Core; the numbers are part of the file format.
DTYPE_CODES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, S, D


def dtype_code(dtype) -> int:
    """The format's code for a numpy dtype (ValueError for a dtype the format cannot hold)."""
    dtype = np.dtype(dtype)
    for code, candidate in DTYPE_CODES.items():
        if np.dtype(candidate) == dtype:
            return code
    raise ValueError(f"dtype {dtype} has no code in the IndexedDataset format")


def token_dtype(vocab_size: int) -> Type[np.integer]:
    """uint16 halves the disk and page-cache footprint of every vocabulary that fits in it.

    The threshold is Megatron's (65,500, not 65,536), so files we write have the dtype Megatron
    would have chosen for the same tokenizer."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def index_file(prefix: str) -> str:
    return prefix + ".idx"


def data_file(prefix: str) -> str:
    return prefix + ".bin"


def exists(prefix: str) -> bool:
    return os.path.isfile(index_file(prefix)) and os.path.isfile(data_file(prefix))


class IndexedDataset:
    """Read-only, memory-mapped view of ``PREFIX.bin`` / ``PREFIX.idx``.

    ``ds[i]`` is sequence ``i`` as a numpy view into the mapped ``.bin`` (no copy);
    ``ds.get(i, offset, length)`` reads part of it. Every inconsistency between the header, the
    index arrays and the file sizes is a ``DataError`` naming the file, raised here at open time
    rather than as a garbage sample or a segfault deep in training.

    With ``vocab_size`` set (``bound_tokens``), every read checks its tokens against it: the whole
    file is checked before training starts (``builders.check_vocab``), but a file replaced since
    then would otherwise index past the embedding table with a traceback instead of one line.
    """

    def __init__(self, prefix: str, vocab_size: Optional[int] = None):
        self.prefix = prefix
        self.vocab_size = vocab_size
        idx_path, bin_path = index_file(prefix), data_file(prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise DataError(f"{path}: file not found (a corpus is a .bin and an .idx with the same "
                                f"prefix; create them with python -m megatron_hydra.data.preprocess)")
        self._read_index(idx_path)
        self._map_data(bin_path)

    def _read_index(self, path: str) -> None:
        idx_size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(_HEADER.size)
        if head[:len(MAGIC)] != MAGIC:
            raise DataError(f"{path}: not a Megatron index file (magic {head[:len(MAGIC)]!r}, "
                            f"expected {MAGIC!r})")
        if len(head) < _HEADER.size:
            raise DataError(f"{path}: truncated header ({idx_size} bytes); re-create the file")
        _, version, code, num_seqs, num_docs = _HEADER.unpack(head)
        if version != VERSION:
            raise DataError(f"{path}: index version {version} is not supported (only {VERSION})")
        if code not in DTYPE_CODES:
            raise DataError(f"{path}: unknown token dtype code {code} (known: {sorted(DTYPE_CODES)})")
        self.dtype = np.dtype(DTYPE_CODES[code])
        expected = _HEADER.size + 4 * num_seqs + 8 * num_seqs + 8 * num_docs
        if idx_size != expected:
            raise DataError(f"{path}: {idx_size} bytes, but its header ({num_seqs} sequences, "
                            f"{num_docs} document boundaries) needs {expected}: the file is "
                            f"{'truncated' if idx_size < expected else 'corrupt'}; re-create it")
        if num_docs < 1:
            raise DataError(f"{path}: no document boundaries (needs at least [0]); re-create the file")
        # np.memmap refuses empty files, and an index of an empty corpus is tiny anyway.
        buf = np.memmap(path, dtype=np.uint8, mode="r") if num_seqs else np.fromfile(path, np.uint8)
        off = _HEADER.size
        self._lengths = buf[off:off + 4 * num_seqs].view("<i4")
        off += 4 * num_seqs
        self._pointers = buf[off:off + 8 * num_seqs].view("<i8")
        off += 8 * num_seqs
        self._doc_idx = buf[off:off + 8 * num_docs].view("<i8")
        if self._doc_idx[0] != 0 or self._doc_idx[-1] != num_seqs:
            raise DataError(f"{path}: document boundaries run from {self._doc_idx[0]} to "
                            f"{self._doc_idx[-1]}, expected 0 to {num_seqs}; the index is corrupt")
        if num_docs > 1 and (np.diff(self._doc_idx) < 0).any():
            raise DataError(f"{path}: document boundaries are not in increasing order; the index is corrupt")
        self._idx_path = path

    def _map_data(self, path: str) -> None:
        bin_size = os.path.getsize(path)
        expected = self._check_pointers(path)
        if bin_size != expected:
            raise DataError(f"{path}: {bin_size} bytes, but {self._idx_path} describes {expected}: "
                            f"{'truncated' if bin_size < expected else 'does not match its index'}; "
                            f"re-create both files")
        self._bin = np.memmap(path, dtype=self.dtype, mode="r") if bin_size else np.empty(0, self.dtype)
        self._bin_path = path

    def _check_pointers(self, bin_path: str, chunk: int = 1 << 22) -> int:
        """Check that the sequences lie back to back from byte 0, each where the lengths before it
        place it (as every Megatron writer lays them out), and return the bytes they cover. A
        negative or inflated length or a stray pointer would otherwise read another sequence's
        tokens or past the end of the file. Vectorised, in chunks: memory stays bounded and 20M
        sequences take under a second."""
        item, start = self.dtype.itemsize, 0
        for lo in range(0, len(self._lengths), chunk):
            lengths = self._lengths[lo:lo + chunk].astype(np.int64)
            negative = np.flatnonzero(lengths < 0)
            if negative.size:
                i = lo + int(negative[0])
                raise DataError(f"{self._idx_path}: sequence {i} has length {int(self._lengths[i])}: the index "
                                f"is corrupt; re-create both files")
            ends = start + np.cumsum(lengths * item)
            starts = np.concatenate(([start], ends[:-1]))
            wrong = np.flatnonzero(self._pointers[lo:lo + chunk] != starts)
            if wrong.size:
                i = lo + int(wrong[0])
                raise DataError(f"{self._idx_path}: sequence {i} points to byte {int(self._pointers[i])} of "
                                f"{bin_path}, but the lengths before it place it at byte {int(starts[wrong[0]])}: "
                                f"the index is corrupt; re-create both files")
            start = int(ends[-1])
        return start

    def bound_tokens(self, vocab_size: int) -> None:
        """From now on, a read holding a token id outside ``[0, vocab_size)`` is a DataError."""
        self.vocab_size = int(vocab_size)

    def _check_tokens(self, tokens: np.ndarray, idx: int) -> None:
        hi = int(tokens.max())
        lo = int(tokens.min()) if self.dtype.kind == "i" else 0
        where = f"{self._bin_path}: sequence {idx % len(self)} holds token id"
        if lo < 0:
            raise DataError(f"{where} {lo}, and ids are never negative: the file is corrupt; re-create it")
        if hi >= self.vocab_size:
            raise DataError(f"{where} {hi} >= the model's vocabulary size {self.vocab_size} (the file changed after "
                            f"the check at start-up?): set model.vocab_size > {hi} or re-tokenize the corpus")

    def __getstate__(self):
        """Pickle the prefix, not the mapped files (a spawned DataLoader worker re-opens them)."""
        return {"prefix": self.prefix, "vocab_size": self.vocab_size}

    def __setstate__(self, state):
        self.__init__(state["prefix"], state.get("vocab_size"))

    def __len__(self) -> int:
        """Number of sequences."""
        return len(self._lengths)

    def __getitem__(self, idx: int) -> np.ndarray:
        return self.get(idx)

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens ``offset:offset+length`` of sequence ``idx`` (to its end when ``length`` is None)."""
        if not -len(self) <= idx < len(self):
            raise IndexError(f"sequence {idx} out of range for {len(self)} sequences in {self.prefix}")
        size = int(self._lengths[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens {offset}:{offset + length} out of range for sequence {idx} "
                             f"of length {size} in {self.prefix}")
        start = int(self._pointers[idx]) // self.dtype.itemsize + offset
        tokens = np.asarray(self._bin[start:start + length])
        if self.vocab_size is not None and tokens.size:
            self._check_tokens(tokens, idx)
        return tokens

    @property
    def sequence_lengths(self) -> np.ndarray:
        return self._lengths

    @property
    def sequence_pointers(self) -> np.ndarray:
        return self._pointers

    @property
    def document_indices(self) -> np.ndarray:
        return self._doc_idx

    @property
    def num_documents(self) -> int:
        return len(self._doc_idx) - 1

    @property
    def num_tokens(self) -> int:
        return len(self._bin)

    @property
    def tokens(self) -> np.ndarray:
        """All tokens of the file, as one memory-mapped array."""
        return self._bin


class IndexedDatasetWriter:
    """Streams sequences to ``PREFIX.bin`` and writes ``PREFIX.idx`` at the end.

    Memory is bounded by the index (12 bytes per sequence, 8 per document), never by the
    tokens. Both files are written under temporary names and renamed when complete, so a
    reader never sees a half-written corpus and a crash leaves no file that looks valid.
    Use as a context manager: leaving the block normally finalizes, an exception discards.
    """

    def __init__(self, prefix: str, dtype=np.uint16):
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        self._code = dtype_code(self.dtype)
        directory = os.path.dirname(os.path.abspath(prefix))
        os.makedirs(directory, exist_ok=True)
        self._tmp = f".tmp{os.getpid()}"
        self._bin = open(data_file(prefix) + self._tmp, "wb")
        self._lengths = array("i")
        self._doc_idx = array("q", [0])
        self.num_tokens = 0

    def add_item(self, tokens: Union[np.ndarray, Iterable[int]]) -> None:
        """Append one sequence to the current document."""
        arr = np.asarray(tokens)
        if arr.dtype != self.dtype and arr.size and self.dtype.kind in "iu":
            info = np.iinfo(self.dtype)
            if arr.min() < info.min or arr.max() > info.max:
                raise ValueError(f"{self.prefix}: token ids {arr.min()}..{arr.max()} do not fit in "
                                 f"{self.dtype}; write with a wider dtype")
        self._bin.write(arr.astype(self.dtype.newbyteorder("<"), copy=False).tobytes())
        self._lengths.append(len(arr))
        self.num_tokens += len(arr)

    def end_document(self) -> None:
        """Close the current document (a no-op if it has no sequence)."""
        if self._doc_idx[-1] != len(self._lengths):
            self._doc_idx.append(len(self._lengths))

    def add_document(self, tokens: Union[np.ndarray, Iterable[int]]) -> None:
        """Append a document made of one sequence."""
        self.add_item(tokens)
        self.end_document()

    @property
    def num_documents(self) -> int:
        return len(self._doc_idx) - 1

    def finalize(self) -> None:
        """Write the index and rename both files into place."""
        for temporary, final in self.finish():
            os.replace(temporary, final)

    def finish(self) -> List[Tuple[str, str]]:
        """Complete both files under their temporary names and return the ``(temporary, final)``
        renames that publish them, ``.bin`` first: an ``.idx`` in place means its ``.bin`` is
        complete. A caller writing several files renames them all once every one is complete."""
        self.end_document()
        self._bin.close()
        lengths = np.frombuffer(self._lengths, dtype=np.int32) if self._lengths else np.zeros(0, np.int32)
        pointers = np.zeros(len(lengths), dtype="<i8")
        if len(lengths) > 1:
            np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        idx_tmp = index_file(self.prefix) + self._tmp
        with open(idx_tmp, "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, self._code, len(lengths), len(self._doc_idx)))
            f.write(lengths.astype("<i4").tobytes())
            f.write(pointers.tobytes())
            f.write(np.asarray(self._doc_idx, dtype="<i8").tobytes())
        return [(data_file(self.prefix) + self._tmp, data_file(self.prefix)), (idx_tmp, index_file(self.prefix))]

    def discard(self) -> None:
        self._bin.close()
        for path in (data_file(self.prefix) + self._tmp, index_file(self.prefix) + self._tmp):
            if os.path.exists(path):
                os.remove(path)

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finalize()
        else:
            self.discard()
