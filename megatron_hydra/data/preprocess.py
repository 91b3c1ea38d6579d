"""Tokenize jsonl / text into Megatron ``.bin``/``.idx`` files.

    python -m megatron_hydra.data.preprocess input=corpus.jsonl json_keys=[text] \\
        tokenizer.type=bpe tokenizer.vocab_size=8192 output_prefix=data/my_corpus workers=2

writes ``data/my_corpus_text_document.bin`` / ``.idx`` (one pair per json key), and with
``tokenizer.type=bpe`` also ``data/my_corpus_tokenizer.json``, trained on the input first.

``split_sentences=true`` writes one sequence per sentence and marks each document's end in the
index, as Megatron's ``--split-sentences`` (the input of BERT and T5 samples; pass
``append_eod=false`` with it).

``input`` is a ``.jsonl`` file (one JSON object per line), a ``.txt`` file (one document per
file) or a directory searched recursively for both, in sorted order. Arguments are Hydra-style
``key=value`` overrides of ``PreprocessConfig``; an unknown key or a wrong type is an error.

Why it is built this way:

- Streaming: the reader hands bounded batches (``chunk_bytes`` of text) to the workers and at
  most ``2 * workers`` batches are in flight, so memory does not grow with the input; text files
  larger than ``chunk_bytes`` are tokenized in line-aligned pieces, each a sequence of one
  document in the index.
- Determinism: batches are cut by the reader, independently of the worker count, and results
  are written in input order (``imap``), so the output is byte-identical for any ``workers``.
- Workers are spawned, not forked, and tokenize single-threaded: forking after the tokenizers
  library has started its thread pool can deadlock, and one thread per process makes
  ``workers`` the real degree of parallelism.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megatron_hydra.config.schema import TokenizerConfig
from megatron_hydra.data import indexed
from megatron_hydra.data.tokenizers import DEFAULT_BPE_VOCAB, Tokenizer, build_tokenizer, train_bpe
from megatron_hydra.errors import ConfigError, DataError, MegatronHydraError, one_line
from megatron_hydra.untrusted import parse_json, surrogate

INPUT_SUFFIXES = (".jsonl", ".txt")


@dataclass
class PreprocessConfig:
    input: str = MISSING
    output_prefix: str = MISSING
    json_keys: List[str] = field(default_factory=lambda: ["text"])
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    workers: int = 1
    # A line that is not UTF-8, or a jsonl line that is not a JSON object with a string under
    # every key: stop (error naming file:line) | skip (warn, count, leave the line out).
    on_bad_line: str = "stop"
    append_eod: bool = True
    # One sequence per sentence, documents marked in the index (Megatron's --split-sentences): the
    # input of BERT and T5 samples. Pass append_eod=false with it for BERT/T5 corpora.
    split_sentences: bool = False
    # Text per batch handed to a worker, and the largest piece of a .txt file tokenized at once.
    chunk_bytes: int = 1 << 20
    progress: bool = True


# ----------------------------------------------------------------------------- reading

def find_inputs(path: str) -> List[str]:
    """The input files: ``path`` itself, or its .jsonl/.txt files in sorted (deterministic) order."""
    if os.path.isfile(path):
        if not path.endswith(INPUT_SUFFIXES):
            raise DataError(f"{path}: unsupported input (expected {' or '.join(INPUT_SUFFIXES)})")
        return [path]
    if not os.path.isdir(path):
        raise DataError(f"{path}: input not found")
    files = sorted(os.path.join(root, name) for root, _, names in os.walk(path)
                   for name in names if name.endswith(INPUT_SUFFIXES))
    if not files:
        raise DataError(f"{path}: no {' or '.join(INPUT_SUFFIXES)} files in this directory")
    return files


# An item is (file index, line number, is_jsonl, payload bytes, ends its document, why the line
# is unusable: "" for a good one). The reader marks lines that are not UTF-8 as bad items rather
# than raising: they reach the main process in input order, through the same path as the
# workers' bad lines (``on_bad_line``), whichever thread or process read them.
Item = Tuple[int, int, bool, bytes, bool, str]


def read_items(files: List[str], chunk_bytes: int) -> Iterator[Item]:
    for fi, path in enumerate(files):
        with open(path, "rb") as f:
            if path.endswith(".jsonl"):
                for line_no, line, why in _utf8_lines(f):
                    if why or line.strip():
                        yield fi, line_no, True, line, True, why
            else:
                yield from _text_pieces(fi, _utf8_lines(f), chunk_bytes)


def _utf8_lines(f) -> Iterator[Tuple[int, bytes, str]]:
    """``(line number, line, why)`` for every line; ``why`` locates a line that is not UTF-8
    (decoding it with replacement characters would silently change the corpus)."""
    offset = 0
    for line_no, line in enumerate(f, 1):
        why = ""
        try:
            line.decode("utf-8")
        except UnicodeDecodeError as e:
            why = f"not UTF-8 text (byte {line[e.start]:#04x} at byte offset {offset + e.start} of the file)"
        yield line_no, line, why
        offset += len(line)


def _text_pieces(fi: int, lines: Iterator[Tuple[int, bytes, str]], chunk_bytes: int) -> Iterator[Item]:
    """A text file as line-aligned pieces of about ``chunk_bytes``; the last one ends the document.
    A line that is not UTF-8 becomes a bad item of its own, left out of the pieces."""
    pending: Optional[Tuple[int, bytes]] = None
    buf: List[bytes] = []
    size, start = 0, 1
    for line_no, line, why in lines:
        if why:
            yield fi, line_no, False, line, False, why
            continue
        if not buf:
            start = line_no
        buf.append(line)
        size += len(line)
        if size >= chunk_bytes:
            if pending:
                yield fi, pending[0], False, pending[1], False, ""
            pending, buf, size = (start, b"".join(buf)), [], 0
    if buf:
        if pending:
            yield fi, pending[0], False, pending[1], False, ""
        pending = (start, b"".join(buf))
    if pending:
        yield fi, pending[0], False, pending[1], True, ""


def batches(items: Iterator[Item], chunk_bytes: int, max_items: int = 4096) -> Iterator[List[Item]]:
    batch, size = [], 0
    for item in items:
        batch.append(item)
        size += len(item[3])
        if size >= chunk_bytes or len(batch) >= max_items:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def iter_texts(files: List[str], keys: List[str], chunk_bytes: int, on_bad_line: str = "skip") -> Iterator[str]:
    """Every text of the input under ``keys`` (for BPE training). Bad lines are skipped, or with
    ``on_bad_line=stop`` the first one stops here, before the training, with the error the
    conversion would give."""
    for item in read_items(files, chunk_bytes):
        texts, why = _parse(item, keys)
        if texts is None:
            if on_bad_line == "stop":
                _bad_line(on_bad_line, files[item[0]], item[1], why, 1)
            continue
        yield from texts


# ----------------------------------------------------------------------------- workers

_W: Dict[str, object] = {}


def _init_worker(tok_cfg: TokenizerConfig, keys: List[str], dtype: str, append_eod: bool,
                 single_thread: bool, split: bool = False) -> None:
    if single_thread:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _W.update(tok=build_tokenizer(tok_cfg), keys=keys, dtype=np.dtype(dtype), eod=append_eod, split=split)


# A sentence ends at . ! or ? (perhaps followed by a closing quote or bracket) before whitespace,
# or at a blank line. A rule rather than a trained splitter: no model to download, same output
# on every machine.
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|(?<=[.!?][\"')\]])\s+|\n\s*\n")


def split_sentences(text: str) -> List[str]:
    """The non-empty sentences of ``text``, stripped."""
    return [s for s in (p.strip() for p in _SENTENCE_END.split(text)) if s]


def _parse(item: Item, keys: List[str]) -> Tuple[Optional[List[str]], str]:
    """(texts per key, "") or (None, why the line is unusable). A line of the input is hostile
    until parsed: its nesting is bounded (a line of 100k brackets would exhaust the parser's
    stack), and a ``\\ud800`` escape, valid JSON but a lone surrogate rather than a character,
    makes the line bad (as bytes that are not UTF-8 do) rather than being replaced silently."""
    if item[5]:
        return None, item[5]
    if not item[2]:
        return [item[3].decode("utf-8")], ""
    try:
        obj = parse_json(item[3].decode("utf-8-sig"), "", DataError)
    except DataError as e:
        return None, str(e).removeprefix(": ")
    if not isinstance(obj, dict):
        return None, f"a JSON {type(obj).__name__}, not an object"
    missing = [k for k in keys if not isinstance(obj.get(k), str)]
    if missing:
        return None, f"no string field {missing[0]!r}"
    for k in keys:
        why = surrogate(obj[k])
        if why:
            return None, f"field {k!r}: {why}"
    return [obj[k] for k in keys], ""


def encode_batch(batch: List[Item]):
    """Worker task: per item ``(file index, line, sequences per key or None, ends_doc, why bad)``
    (one sequence per item, or one per sentence with ``split_sentences``), and the number of
    input bytes the batch covered."""
    tok: Tokenizer = _W["tok"]
    keys, dtype = _W["keys"], _W["dtype"]
    parsed = [_parse(item, keys) for item in batch]
    good = [texts for texts, _ in parsed if texts is not None]
    pieces = split_sentences if _W["split"] else (lambda text: [text])
    encoded = []  # per key, per good item: the ids of each of its pieces
    for k in range(len(keys)):
        split = [pieces(texts[k]) for texts in good]
        flat = iter(tok.encode_batch([p for ps in split for p in ps]) if any(split) else [])
        encoded.append([[next(flat) for _ in ps] for ps in split])
    out, g = [], 0
    for item, (texts, why) in zip(batch, parsed):
        fi, line_no, is_json, _, ends_doc, _ = item
        if texts is None:
            out.append((fi, line_no, None, ends_doc, why))
            continue
        arrays = []
        for ids_of_key in encoded[:len(texts)]:
            seqs = ids_of_key[g] or [[]]
            # An empty json text stays empty, so that the document is skipped altogether.
            if ends_doc and _W["eod"] and (any(seqs) or not is_json):
                seqs[-1] = seqs[-1] + [tok.eod]
            arrays.append([np.asarray(ids, dtype=dtype) for ids in seqs])
        g += 1
        out.append((fi, line_no, arrays, ends_doc, ""))
    return out, sum(len(item[3]) for item in batch)


def _bounded_imap(pool, fn, source, max_pending: int):
    """``pool.imap`` that reads ahead at most ``max_pending`` tasks (plain imap drains its whole
    input into the task queue, which would hold a large corpus in memory)."""
    slots, stop = threading.Semaphore(max_pending), threading.Event()

    def feed():
        for task in source:
            slots.acquire()
            if stop.is_set():
                return
            yield task

    try:
        for result in pool.imap(fn, feed()):
            slots.release()
            yield result
    finally:
        stop.set()
        for _ in range(max_pending + 1):
            slots.release()


# ----------------------------------------------------------------------------- main

def _prepare_tokenizer(cfg: PreprocessConfig, files: List[str],
                       tmp: str) -> Tuple[TokenizerConfig, List[Tuple[str, str]]]:
    """The tokenizer as the workers should load it, and the renames that publish it. For ``bpe``
    it is trained on the input first and saved under a temporary name (suffix ``tmp``): it
    replaces an older tokenizer only together with the corpus it tokenized."""
    tok = cfg.tokenizer
    if tok.type != "bpe" or (tok.path and os.path.isfile(os.path.expanduser(tok.path))):
        build_tokenizer(tok)  # fail here, once, on a bad path rather than in every worker
        return tok, []
    path = os.path.expanduser(tok.path) if tok.path else f"{cfg.output_prefix}_tokenizer.json"
    t0 = time.time()
    texts = iter_texts(files, list(cfg.json_keys), cfg.chunk_bytes, cfg.on_bad_line)
    train_bpe(texts, tok.vocab_size or DEFAULT_BPE_VOCAB, path + tmp)
    _log(cfg, f"trained a byte-level BPE ({tok.vocab_size or DEFAULT_BPE_VOCAB} entries) in "
              f"{time.time() - t0:.1f} s -> {path}")
    return TokenizerConfig(type="hf", path=path + tmp), [(path + tmp, path)]


def _log(cfg: PreprocessConfig, msg: str) -> None:
    if cfg.progress:
        print(msg, file=sys.stderr)


def preprocess(cfg: PreprocessConfig) -> Dict[str, str]:
    """Run the conversion; returns the output prefix of each json key."""
    if cfg.on_bad_line not in ("stop", "skip"):
        raise ConfigError(f"on_bad_line={cfg.on_bad_line!r}: choose stop or skip")
    if cfg.workers < 1 or not cfg.json_keys:
        raise ConfigError("workers must be >= 1 and json_keys must name at least one key")
    files = find_inputs(os.path.expanduser(cfg.input))
    keys = list(cfg.json_keys)
    if len(keys) > 1 and any(f.endswith(".txt") for f in files):
        raise ConfigError(f"json_keys={keys}: .txt inputs have a single text field; give one key")
    tmp = f".tmp{os.getpid()}"
    tok_cfg, renames = _prepare_tokenizer(cfg, files, tmp)
    writers: Dict[str, indexed.IndexedDatasetWriter] = {}
    # Every output is written under a temporary name and renamed only when all succeeded, so a
    # failed run leaves the previous tokenizer and corpus as they were, matching each other.
    try:
        dtype = np.dtype(indexed.token_dtype(build_tokenizer(tok_cfg).vocab_size))
        init = (tok_cfg, keys, dtype.str, cfg.append_eod, cfg.workers > 1, cfg.split_sentences)
        prefixes = {k: f"{cfg.output_prefix}_{k}_document" for k in keys}
        writers.update((k, indexed.IndexedDatasetWriter(p, dtype)) for k, p in prefixes.items())
        stats = _convert(cfg, files, keys, writers, init, sum(os.path.getsize(f) for f in files))
        for k, w in writers.items():
            if w.num_documents == 0:
                raise DataError(f"{cfg.input}: no documents with text under key {k!r} "
                                f"({stats['bad']} unusable lines): the corpus is empty")
        renames = [r for w in writers.values() for r in w.finish()] + renames
    except BaseException:
        for w in writers.values():
            w.discard()
        for temporary, _ in renames:
            if os.path.exists(temporary):
                os.remove(temporary)
        raise
    for temporary, final in renames:  # the tokenizer last
        os.replace(temporary, final)
    mb, secs = stats["bytes"] / 1e6, max(stats["seconds"], 1e-9)
    for k, w in writers.items():
        _log(cfg, f"{k}: {w.num_documents} documents, {w.num_tokens} tokens -> {prefixes[k]}.bin/.idx")
    _log(cfg, f"{mb:.1f} MB in {secs:.1f} s ({mb / secs:.1f} MB/s, {cfg.workers} worker{'s' if cfg.workers > 1 else ''})"
              + (f", {stats['bad']} bad lines skipped" if stats["bad"] else ""))
    return prefixes


def _convert(cfg, files, keys, writers, init, total) -> dict:
    from tqdm import tqdm

    source = batches(read_items(files, cfg.chunk_bytes), cfg.chunk_bytes)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing", disable=not cfg.progress,
               file=sys.stderr, smoothing=0.1)
    stats = {"bytes": 0, "bad": 0, "seconds": 0.0}
    t0 = time.time()
    pool = None
    try:
        if cfg.workers == 1:
            _init_worker(*init)
            results = map(encode_batch, source)
        else:
            pool = multiprocessing.get_context("spawn").Pool(cfg.workers, _init_worker, init)
            results = _bounded_imap(pool, encode_batch, source, 2 * cfg.workers)
        for out, nbytes in results:
            for fi, line_no, arrays, ends_doc, why in out:
                if arrays is None:
                    stats["bad"] += 1
                    _bad_line(cfg.on_bad_line, files[fi], line_no, why, stats["bad"])
                    continue
                for k, seqs in zip(keys, arrays):
                    for arr in seqs:
                        if len(arr):
                            writers[k].add_item(arr)
                    if ends_doc:
                        writers[k].end_document()
            stats["bytes"] += nbytes
            bar.update(nbytes)
    finally:
        bar.close()
        if pool is not None:
            results.close()  # unblocks the task feeder before the pool joins it
            pool.terminate()
            pool.join()
    stats["seconds"] = time.time() - t0
    return stats


def _bad_line(on_bad_line: str, path: str, line_no: int, why: str, count: int) -> None:
    if on_bad_line == "stop":
        raise DataError(f"{path}:{line_no}: {why}; fix the line or pass on_bad_line=skip")
    if count <= 10:
        print(f"warning: {path}:{line_no}: skipped: {why}", file=sys.stderr)
    elif count == 11:
        print("warning: more bad lines skipped; the count is reported at the end", file=sys.stderr)


def parse_args(argv: List[str]) -> PreprocessConfig:
    """Hydra-style ``key=value`` overrides on the typed ``PreprocessConfig``."""
    base = OmegaConf.structured(PreprocessConfig)
    try:
        bad = [a for a in argv if "=" not in a]
        if bad:
            raise ConfigError(f"{bad[0]!r}: arguments are key=value (see --help)")
        merged = OmegaConf.merge(base, OmegaConf.from_dotlist(argv))
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        raise ConfigError((f"{key}: " if key else "") + str(e).splitlines()[0]) from None
    missing = sorted(OmegaConf.missing_keys(merged))
    if missing:
        raise ConfigError(f"{missing[0]} is required, e.g. {missing[0]}=...")
    return OmegaConf.to_object(merged)


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help", "help") for a in argv):
        print(__doc__.split("Why it is")[0].rstrip())
        print("\nkeys and defaults:\n" + OmegaConf.to_yaml(OmegaConf.structured(PreprocessConfig)))
        return 0
    try:
        preprocess(parse_args(argv))
    except MegatronHydraError as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
