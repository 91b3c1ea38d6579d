"""The data layer's single entry point: a ``DataConfig`` in, train/valid/test datasets out.

``build_datasets`` resolves the corpus (``demo``: built on first use; ``indexed``: the
``data.blend`` prefixes), checks it against the model before any step runs, splits each corpus
by documents, and wraps each split in a ``GPTDataset`` (blended when there are several corpora).
Everything here is deterministic from the arguments, so every rank builds the same datasets.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np
from torch.utils.data import Dataset

from megatron_hydra.data import demo
from megatron_hydra.data.blending import BlendedDataset
from megatron_hydra.data.gpt_dataset import GPTDataset, default_cache_dir
from megatron_hydra.data.indexed import IndexedDataset
from megatron_hydra.data.packed_documents import DocumentFlags
from megatron_hydra.data.preference_dataset import tokenize_pairs
from megatron_hydra.data.sft_dataset import build_sft_datasets, tokenize_conversations
from megatron_hydra.data.synthetic import SyntheticDataset
from megatron_hydra.data.token_range import token_range
from megatron_hydra.data.tokenizers import Tokenizer, build_tokenizer
from megatron_hydra.errors import ConfigError, DataError

log = logging.getLogger(__name__)
SPLIT_NAMES = ("train", "valid", "test")
# data.name values that read data.blend: the plain one and the BERT / T5 presets of conf/data/.
INDEXED = ("indexed", "indexed_bert", "indexed_t5")
# data.name values that read a jsonl file of chats (data.path): what it holds, how it is tokenized.
CHATS = {"sft": ("conversations", "chat.jsonl", tokenize_conversations),
         "preference": ("preference pairs", "pairs.jsonl", tokenize_pairs)}


def parse_blend(blend: Optional[Sequence[Any]]) -> List[Tuple[float, str]]:
    """``[prefix]`` or ``[w1, prefix1, w2, prefix2, ...]`` -> [(weight, prefix)], weights summing to 1."""
    example = "e.g. data.blend=[data/corpus_text_document] or [0.7,data/a_text_document,0.3,data/b_text_document]"
    items = list(blend) if blend is not None else []
    if not items:
        raise DataError(f"data.blend is empty: name the .bin/.idx prefixes to train on, {example}")
    if len(items) == 1:
        items = [1.0] + items
    if len(items) % 2:
        raise DataError(f"data.blend={items}: expected one prefix or weight/prefix pairs, {example}")
    pairs = []
    for w, p in zip(items[0::2], items[1::2]):
        try:
            weight = float(w)
        except (TypeError, ValueError):
            weight = float("nan")
        if isinstance(w, bool) or not np.isfinite(weight) or weight <= 0:
            raise DataError(f"data.blend: weight {w!r} (before {p!r}) is not a positive number, {example}")
        if not isinstance(p, str) or not p:
            raise DataError(f"data.blend: {p!r} (after weight {w!r}) is not a path prefix, {example}")
        pairs.append((weight, os.path.abspath(os.path.expanduser(re.sub(r"\.(bin|idx)$", "", p)))))
    total = sum(w for w, _ in pairs)
    return [(w / total, p) for w, p in pairs]


def parse_split(split) -> List[float]:
    """``"969,30,1"`` or ``[969, 30, 1]`` -> three proportions (missing ones are 0); ``/`` works
    as a separator too."""
    if not isinstance(split, str):
        split = ",".join(str(v) for v in split)
    parts = [s.strip() for s in re.split(r"[,/]", str(split)) if s.strip()]
    try:
        values = [float(s) for s in parts]
    except ValueError:
        values = []
    if not 1 <= len(values) <= 3 or any(v < 0 or not np.isfinite(v) for v in values) or sum(values) <= 0:
        raise ConfigError(f"data.split={split!r}: give up to three non-negative train,valid,test "
                          f"proportions with a positive sum, e.g. 969,30,1")
    values += [0.0] * (3 - len(values))
    return [v / sum(values) for v in values]


def split_documents(num_documents: int, proportions: Sequence[float]) -> List[np.ndarray]:
    """Contiguous, disjoint document ranges covering all documents, one per split."""
    bounds = np.round(np.cumsum([0.0] + list(proportions)) * num_documents).astype(np.int64)
    bounds[-1] = num_documents
    return [np.arange(bounds[i], bounds[i + 1], dtype=np.int64) for i in range(len(proportions))]


def check_vocab(ds: IndexedDataset, vocab_size: int, cache_dir: Optional[str] = None) -> None:
    """Token ids outside ``[0, vocab_size)`` would index past the embedding table mid-run (or
    silently on some devices); find them now, naming the file. Every token is checked (its range
    is cached per file, ``token_range``), and ``ds`` checks every later read too."""
    path = ds.prefix + ".bin"
    if ds.dtype.kind not in "iu":
        raise DataError(f"{path}: tokens are {ds.dtype}, not integers; re-create it with preprocess")
    if ds.num_tokens:
        lo, hi = token_range(ds, default_cache_dir(ds.prefix, cache_dir))
        if hi >= vocab_size:
            raise DataError(f"{path}: token id {hi} >= the model's vocabulary size {vocab_size}; set "
                            f"model.vocab_size > {hi} or re-tokenize with a smaller vocabulary")
        if lo < 0:
            raise DataError(f"{path}: negative token id {lo}; the file is corrupt, re-create it")
    ds.bound_tokens(vocab_size)


def _corpora(data_cfg) -> List[Tuple[float, str]]:
    if data_cfg.name == "demo":
        prefix, _ = demo.build_demo_corpus(data_cfg.tokenizer, data_cfg.cache_dir)
        return [(1.0, prefix)]
    if data_cfg.name in INDEXED:
        return parse_blend(data_cfg.blend)
    raise ConfigError(f"data.name={data_cfg.name!r}: build_datasets handles demo and indexed")


def build_datasets(data_cfg, *, seq_length: int, seed: int, num_samples: Tuple[int, int, int],
                   vocab_size: int, make_dataset: Optional[Callable] = None
                   ) -> Tuple[Dataset, Optional[Dataset], Optional[Dataset]]:
    """Train, valid and test datasets with at least ``num_samples[i]`` items each (None for a
    split with no documents or no samples requested). Call on every rank. ``make_dataset(indexed,
    documents, num_samples, split name)`` builds another kind of samples than GPT's
    (``arch_datasets.dataset_factory``)."""
    if data_cfg.name == "synthetic":
        return tuple(SyntheticDataset(max(n, 1), seq_length, vocab_size, seed + i) if n > 0 or i == 0 else None
                     for i, n in enumerate(num_samples))
    if data_cfg.name in CHATS:
        return _chat_datasets(data_cfg, seq_length, seed, num_samples, vocab_size)
    corpora = _corpora(data_cfg)
    opened = [(w, IndexedDataset(p)) for w, p in corpora]
    cache = data_cfg.cache_dir if data_cfg.name in INDEXED else None
    for _, ds in opened:
        if ds.num_documents == 0 or ds.num_tokens == 0:
            raise DataError(f"{ds.prefix}.bin: no tokens: the corpus is empty")
        check_vocab(ds, vocab_size, cache)
    proportions = parse_split(data_cfg.split)
    splits = [split_documents(ds.num_documents, proportions) for _, ds in opened]
    out: List[Optional[Dataset]] = []
    for s, name in enumerate(SPLIT_NAMES):
        parts = [(w, ds, docs[s]) for (w, ds), docs in zip(opened, splits) if len(docs[s])]
        if num_samples[s] <= 0 or not parts:
            if s == 0:
                raise DataError(f"{opened[0][1].prefix}: the train split is empty "
                                f"(data.split={data_cfg.split!r}, num_samples={num_samples[0]})")
            out.append(None)
            continue
        if len(parts) < len(opened):
            log.warning("%s split: %d of %d blended corpora have no documents in it and are left out",
                        name, len(opened) - len(parts), len(opened))
        weights = [w for w, _, _ in parts]
        sizes = [num_samples[s]] if len(parts) == 1 else BlendedDataset.required_sizes(weights, num_samples[s])
        if make_dataset is None:
            flags = document_flags(data_cfg)
            datasets = [GPTDataset(ds, docs, int(n), seq_length, seed, default_cache_dir(ds.prefix, cache), name, flags)
                        for (_, ds, docs), n in zip(parts, sizes)]
        else:
            datasets = [make_dataset(ds, docs, int(n), name) for (_, ds, docs), n in zip(parts, sizes)]
        out.append(datasets[0] if len(datasets) == 1 else BlendedDataset(datasets, weights, num_samples[s]))
    return out[0], out[1], out[2]


def _chat_datasets(data_cfg, seq_length: int, seed: int, num_samples: Tuple[int, int, int], vocab_size: int):
    """Fine-tuning conversations or preference pairs (``data_cfg.path``), split by samples
    (``sft_dataset``, ``preference_dataset``)."""
    what, example, tokenize = CHATS[data_cfg.name]
    if not data_cfg.path:
        raise ConfigError(f"data.path is not set: data={data_cfg.name} reads a jsonl file of {what}, "
                          f"e.g. data.path={example}")
    proportions = parse_split(data_cfg.split)
    tokenizer = build_tokenizer_for(data_cfg)
    samples = tokenize(data_cfg.path, tokenizer, seq_length, vocab_size)
    return build_sft_datasets(samples, split_documents(len(samples), proportions), num_samples, seq_length, seed,
                              data_cfg.packing, tokenizer.eod, data_cfg.path, what)


def document_flags(data_cfg) -> Optional[DocumentFlags]:
    """The EOD options of ``data_cfg`` (``data.eod_mask_loss``, ``data.reset_position_ids``,
    ``data.reset_attention_mask``) with the corpus tokenizer's EOD id; None when all are off."""
    flags = [bool(getattr(data_cfg, key, False)) for key in ("eod_mask_loss", "reset_position_ids",
                                                              "reset_attention_mask")]
    return DocumentFlags(build_tokenizer_for(data_cfg).eod, *flags) if any(flags) else None


def build_tokenizer_for(data_cfg) -> Tokenizer:
    """The tokenizer that produced the corpus of ``data_cfg``, e.g. to decode samples."""
    if data_cfg.name == "demo":
        _, tok_cfg = demo.build_demo_corpus(data_cfg.tokenizer, data_cfg.cache_dir)
        return build_tokenizer(tok_cfg)
    tok_cfg = data_cfg.tokenizer
    if data_cfg.name in CHATS and tok_cfg.type in ("hf", "sentencepiece") and not tok_cfg.path:
        raise DataError(f"data={data_cfg.name}: data.tokenizer.path is not set, nor checkpoint.load (whose "
                        "tokenizer.json it would be): set data.tokenizer.path to the model's tokenizer, or "
                        "data.tokenizer.type=byte")
    if data_cfg.name in INDEXED and tok_cfg.type == "bpe" and not tok_cfg.path:
        # preprocess saved it as OUTPUT_PREFIX_tokenizer.json beside OUTPUT_PREFIX_KEY_document.*
        prefix = parse_blend(data_cfg.blend)[0][1]
        guess = re.sub(r"_[^_/\\]+_document$", "", prefix) + "_tokenizer.json"
        return build_tokenizer(tok_cfg, save_path=guess)
    return build_tokenizer(tok_cfg)
