"""The smallest and largest token id of an indexed corpus, over every token, computed once per file.

Why every token: a single id past the vocabulary indexes past the embedding table when the
sample holding it comes up, hours into a run; a sample of the file cannot promise there is none.
Why it is affordable: the ``.bin`` is memory-mapped and scanned in chunks small enough to stay in
the CPU cache between the min and the max, so the cost is one sequential read of the file (the
page cache usually holds it already), and memory stays bounded by one chunk.

The result is cached as a small JSON file in the corpus's index cache directory (beside the data
by default), keyed by the ``.bin``'s path, size, modification time and inode: every rank and
every later run of the same file reads it instead of scanning again. A cache file that is
unreadable, crafted or stale is ignored and rewritten.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Optional, Tuple

import numpy as np

from megatron_hydra.data.indexed import IndexedDataset
from megatron_hydra.errors import DataError
from megatron_hydra.untrusted import load_json

log = logging.getLogger(__name__)
CHUNK_TOKENS = 1 << 20
_CACHE_LIMIT = 4096  # bytes: the cache holds a handful of numbers


def scan(tokens: np.ndarray, chunk: int = CHUNK_TOKENS) -> Tuple[int, int]:
    """``(min, max)`` of a non-empty token array, read ``chunk`` tokens at a time; the min of an
    unsigned array is reported as 0 without reading it (no id of it can be negative)."""
    lo, hi = None, None
    signed = tokens.dtype.kind == "i"
    for start in range(0, len(tokens), chunk):
        part = tokens[start:start + chunk]
        top = int(part.max())
        hi = top if hi is None else max(hi, top)
        if signed:
            low = int(part.min())
            lo = low if lo is None else min(lo, low)
    return (0 if lo is None else lo), hi


def _key(ds: IndexedDataset) -> dict:
    st = os.stat(ds.prefix + ".bin")
    return {"bin": os.path.abspath(ds.prefix + ".bin"), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "inode": st.st_ino, "dtype": ds.dtype.str}


def _cache_path(ds: IndexedDataset, cache_dir: str) -> str:
    name = hashlib.sha256(os.path.abspath(ds.prefix).encode()).hexdigest()[:24]
    return os.path.join(cache_dir, f"tokens_{name}.json")


def _cached(path: str, key: dict) -> Optional[Tuple[int, int]]:
    if not os.path.lexists(path):
        return None
    try:
        entry = load_json(path, _CACHE_LIMIT, "token range cache", DataError)
    except DataError as e:
        log.warning("%s; scanning the corpus again", e)
        return None
    if not isinstance(entry, dict) or {k: entry.get(k) for k in key} != key:
        return None
    lo, hi = entry.get("min"), entry.get("max")
    if type(lo) is not int or type(hi) is not int or lo > hi:
        return None
    return lo, hi


def _store(path: str, key: dict, lo: int, hi: int) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(dict(key, min=lo, max=hi), f)
        os.replace(tmp, path)
    except OSError as e:  # a read-only data directory: the scan is simply repeated next time
        log.info("%s: cannot cache the token range (%s)", path, e.strerror or e)
        if os.path.exists(tmp):
            os.remove(tmp)


def token_range(ds: IndexedDataset, cache_dir: str) -> Tuple[int, int]:
    """``(min, max)`` token id of the non-empty corpus ``ds``, from the cache in ``cache_dir`` when
    it describes this very file, else scanned (and cached)."""
    key, path = _key(ds), _cache_path(ds, cache_dir)
    found = _cached(path, key)
    if found is not None:
        return found
    lo, hi = scan(ds.tokens)
    _store(path, key, lo, hi)
    return lo, hi
