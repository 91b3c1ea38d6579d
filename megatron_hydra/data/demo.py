"""The default corpus (``data=demo``): built on first use from text every Python install has.

``python launch.py`` must train on real text on a machine with no network and no dataset. The
standard library's sources and text files are such a corpus: a few MB of English comments,
docstrings and code, present wherever Python runs. They are read in sorted path order up to
``max_bytes`` (so the corpus is the same on every machine with the same Python), tokenized with
the configured tokenizer (by default a byte-level BPE trained on them), written as a Megatron
``.bin``/``.idx`` pair under the cache directory and reused from then on.

Concurrent builders (the ranks of one run, or two runs) take a file lock, and the corpus is
assembled in a temporary directory renamed into place when complete, so it is built once and a
reader never sees half of it. The directory name is a hash of the source listing and the
tokenizer settings: a different Python or tokenizer gets its own corpus.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sysconfig
import tempfile
import time
from typing import List, Optional, Tuple

import numpy as np

from megatron_hydra.config.schema import TokenizerConfig
from megatron_hydra.data import indexed
from megatron_hydra.data.tokenizers import DEFAULT_BPE_VOCAB, build_tokenizer, train_bpe
from megatron_hydra.errors import DataError

DEFAULT_CACHE_DIR = os.path.join("~", ".cache", "megatron_hydra", "demo")
DEFAULT_MAX_BYTES = 4_000_000
PREFIX_NAME = "demo_text_document"
_SUFFIXES = (".py", ".txt", ".rst")
# Third-party packages differ between installs; test data holds deliberately odd files.
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
_VERSION = 1


def source_files(max_bytes: Optional[int] = None) -> List[Tuple[str, str, int]]:
    """(relative path, path, size) of the stdlib text files making up the corpus, in order."""
    max_bytes = max_bytes or DEFAULT_MAX_BYTES
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for dirpath, dirnames, names in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        for name in names:
            if name.endswith(_SUFFIXES):
                path = os.path.join(dirpath, name)
                found.append((os.path.relpath(path, root).replace(os.sep, "/"), path))
    chosen, total = [], 0
    for rel, path in sorted(found):
        size = os.path.getsize(path)
        if total + size > max_bytes and chosen:
            break
        chosen.append((rel, path, size))
        total += size
    if not chosen:
        raise DataError(f"{root}: no standard-library text found to build the demo corpus; "
                        f"use data=indexed with your own corpus")
    return chosen


def _cache_key(files, tok: TokenizerConfig) -> str:
    tok_desc = {"type": tok.type, "vocab_size": tok.vocab_size or DEFAULT_BPE_VOCAB}
    if tok.type in ("hf", "sentencepiece", "gpt2_bpe", "tiktoken"):
        for key in ("path", "merge_file"):  # the tokenizer's files: another file is another corpus
            if getattr(tok, key):
                tok_desc[key] = _file_desc(os.path.abspath(os.path.expanduser(getattr(tok, key))))
    desc = {"version": _VERSION, "files": [(rel, size) for rel, _, size in files], "tokenizer": tok_desc}
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:16]


def _file_desc(path: str):
    """A file (or a folder's files, for a tokenizer given by its folder) by name and size."""
    if os.path.isdir(path):
        return [path, sorted((n, os.path.getsize(os.path.join(path, n))) for n in os.listdir(path)
                             if os.path.isfile(os.path.join(path, n)))]
    return [path, os.path.getsize(path) if os.path.isfile(path) else None]


def demo_tokenizer_config(directory: str, tok: TokenizerConfig) -> TokenizerConfig:
    """The tokenizer of a built demo corpus: a trained BPE is the tokenizer.json beside it."""
    if tok.type == "bpe":
        return TokenizerConfig(type="hf", path=os.path.join(directory, "tokenizer.json"))
    return tok


def build_demo_corpus(tokenizer: TokenizerConfig, cache_dir: Optional[str] = None,
                      max_bytes: Optional[int] = None) -> Tuple[str, TokenizerConfig]:
    """The demo corpus's ``.bin``/``.idx`` prefix and its tokenizer, building them if needed."""
    from filelock import FileLock

    cache_dir = os.path.abspath(os.path.expanduser(cache_dir or DEFAULT_CACHE_DIR))
    files = source_files(max_bytes)
    name = f"{tokenizer.type}-{_cache_key(files, tokenizer)}"
    final = os.path.join(cache_dir, name)
    prefix = os.path.join(final, PREFIX_NAME)
    if not indexed.exists(prefix):
        try:
            os.makedirs(cache_dir, exist_ok=True)
        except OSError as e:
            raise DataError(f"{cache_dir}: cannot create the demo cache ({e.strerror}); "
                            f"set data.cache_dir to a writable directory") from None
        with FileLock(os.path.join(cache_dir, name + ".lock")):
            if not indexed.exists(prefix):  # another process may have built it meanwhile
                _build(files, tokenizer, cache_dir, name)
    return prefix, demo_tokenizer_config(final, tokenizer)


def _build(files, tok_cfg: TokenizerConfig, cache_dir: str, name: str) -> None:
    t0 = time.time()
    texts, used = [], []
    for rel, path, _ in files:
        try:
            with open(path, encoding="utf-8") as f:
                texts.append(f.read())
            used.append(rel)
        except (UnicodeDecodeError, OSError):
            continue
    tmp = tempfile.mkdtemp(prefix=name + ".tmp", dir=cache_dir)
    try:
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide the corpus from other users
        if tok_cfg.type == "bpe":
            tok = train_bpe(texts, tok_cfg.vocab_size or DEFAULT_BPE_VOCAB,
                            os.path.join(tmp, "tokenizer.json"), length=len(texts))
        else:
            tok = build_tokenizer(tok_cfg)
        dtype = indexed.token_dtype(tok.vocab_size)
        with indexed.IndexedDatasetWriter(os.path.join(tmp, PREFIX_NAME), dtype) as writer:
            for ids in tok.encode_batch(texts):
                writer.add_document(np.asarray(ids + [tok.eod], dtype=dtype))
        with open(os.path.join(tmp, "sources.txt"), "w") as f:
            f.write(f"# standard library files in the demo corpus, built in {time.time() - t0:.1f} s\n")
            f.write("\n".join(used) + "\n")
        final = os.path.join(cache_dir, name)
        if os.path.isdir(final):  # an incomplete corpus (files deleted by hand): replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
