"""The data: ``--data-path`` blends, ``--split``, ``--mock-data``, the tokenizer and, from it, the
vocabulary the model is padded from.

Megatron-LM sizes the embedding from its tokenizer (``_vocab_size_with_padding`` of the
tokenizer's size), as ``model.vocab_size`` does here, so the size is read from the tokenizer file
where it exists on this machine. Otherwise it is the tokenizer's well-known size (GPT-2's 50257;
Llama 3's 128256), else ``--vocab-size``, else it is left to the user, said so. NullTokenizer's
size is ``--vocab-size`` + 1 (its end-of-document id follows the vocabulary).
"""

from __future__ import annotations

import os
import re
from typing import List, Optional

from megatron_hydra.config.schema import TokenizerConfig
from megatron_hydra.errors import MegatronHydraError
from megatron_hydra.migrate.model_flags import split_values
from megatron_hydra.migrate.translation import Translation

# Megatron-LM tokenizer type -> (ours, the flag holding its file)
TOKENIZERS = {
    "GPT2BPETokenizer": ("gpt2_bpe", "--vocab-file"),
    "HuggingFaceTokenizer": ("hf", "--tokenizer-model"),
    "GPTSentencePieceTokenizer": ("sentencepiece", "--tokenizer-model"),
    "Llama2Tokenizer": ("sentencepiece", "--tokenizer-model"),
    "SentencePieceTokenizer": ("sentencepiece", "--tokenizer-model"),
    "Llama3Tokenizer": ("tiktoken", "--tokenizer-model"),
}
KNOWN_SIZES = {"GPT2BPETokenizer": 50257, "Llama3Tokenizer": 128256}
GPT_DEFAULT_TOKENIZER = "GPT2BPETokenizer"  # pretrain_gpt.py's args_defaults


def translate_data(t: Translation) -> None:
    cl = t.cl
    if cl.get("--mock-data"):
        t.group("data", "synthetic", "--mock-data")
        for flag in ("--data-path", "--split", "--data-cache-path", "--eod-mask-loss", "--reset-position-ids",
                     "--reset-attention-mask"):
            t.ignore(flag, "--mock-data: generated samples (data=synthetic)")
    else:
        t.group("data", "indexed", "--data-path")
        if cl.given("--data-path"):
            _blend(t)
        else:
            t.notes.append("no --data-path (or --mock-data): give data.blend=[...] (Megatron .bin/.idx prefixes)")
        if cl.given("--split"):
            parts = [float(x) for x in re.findall(r"\d+(?:\.\d*)?|\.\d+", cl.get("--split"))]
            t.set("data.split", [int(x) if x == int(x) else x for x in parts], "--split")
        if cl.given("--data-cache-path"):
            t.set("data.cache_dir", cl.get("--data-cache-path"), "--data-cache-path")
        for flag in ("--eod-mask-loss", "--reset-position-ids", "--reset-attention-mask"):
            if cl.get(flag):
                t.set(f"data.{flag[2:].replace('-', '_')}", True, flag)
    if cl.given("--num-workers"):
        t.set("data.num_workers", cl.get("--num-workers"), "--num-workers")
    if cl.given("--seed"):
        t.set("seed", cl.get("--seed"), "--seed")
        t.set("data.seed", cl.get("--seed"), "--seed")
    if cl.get("--dataloader-type") == "single":
        t.ignore("--dataloader-type", "single: each sample once per epoch in order of the shuffled index, as here")
    else:
        t.refuse("--dataloader-type", "the sampler here is Megatron's 'single' one")
    _tokenizer(t)


def _blend(t: Translation) -> None:
    """``--data-path P`` or ``--data-path W1 P1 W2 P2 ...`` (also quoted as one word)."""
    words = split_values(t.cl.get("--data-path"))
    if len(words) == 1:
        t.set("data.blend", words, "--data-path")
        return
    weights = words[0::2]
    if len(words) % 2 or not all(re.fullmatch(r"[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?", w) for w in weights):
        t.refuse("--data-path", "several prefixes need a weight each here: W1 P1 W2 P2 ...")
        return
    blend: List = []
    for weight, prefix in zip(weights, words[1::2]):
        blend += [float(weight), prefix]
    t.set("data.blend", blend, "--data-path")


def _tokenizer(t: Translation) -> None:
    cl = t.cl
    kind = cl.get("--tokenizer-type") or GPT_DEFAULT_TOKENIZER
    if kind != "TikTokenizer":
        for flag in ("--tiktoken-pattern", "--tiktoken-num-special-tokens", "--tiktoken-special-tokens"):
            t.ignore(flag, f"Megatron-LM reads it with --tokenizer-type TikTokenizer only (here {kind})")
    if kind == "NullTokenizer":
        size = cl.get("--vocab-size")
        if size is None:
            t.refuse("--tokenizer-type", "NullTokenizer needs --vocab-size")
        else:
            t.set("model.vocab_size", size + 1, "--vocab-size", "--tokenizer-type")
        if not cl.get("--mock-data"):
            t.notes.append("NullTokenizer: the data holds token ids only; data.tokenizer is used to decode samples "
                           "for display here (set it to the tokenizer the ids came from)")
        return
    if kind not in TOKENIZERS:
        why = ("Megatron-LM's TikTokenizer reads a JSON rank file with its own special tokens; here tiktoken reads "
               "Llama 3's rank file" if kind == "TikTokenizer" else "no equivalent tokenizer here")
        t.refuse("--tokenizer-type", f"{why}: convert the tokenizer to a tokenizer.json (data.tokenizer.type=hf)")
        _fallback_size(t, kind)
        return
    ours, path_flag = TOKENIZERS[kind]
    for flag in ("--vocab-file", "--merge-file", "--tokenizer-model"):
        if flag != path_flag and not (flag == "--merge-file" and ours == "gpt2_bpe"):
            t.ignore(flag, f"not read by Megatron-LM's {kind}")
    path = cl.get(path_flag)
    if path is None:
        t.refuse(path_flag, f"Megatron-LM's {kind} needs it: add it")
        t.ignore("--merge-file", f"unused without {path_flag}")
        _fallback_size(t, kind)
        return
    if t.groups.get("data") == "indexed":
        t.set("data.tokenizer.type", ours, "--tokenizer-type", path_flag)
        t.set("data.tokenizer.path", path, path_flag)
        if ours == "gpt2_bpe" and cl.get("--merge-file"):
            t.set("data.tokenizer.merge_file", cl.get("--merge-file"), "--merge-file")
    if kind == "SentencePieceTokenizer":
        t.notes.append("Megatron-LM's SentencePieceTokenizer adds special tokens (<CLS>, <SEP>, <EOD>, <MASK>, ...) "
                       "that the .model lacks: its vocabulary, and the ids in the data, can exceed the file's; check "
                       "model.vocab_size")
    size = _file_size(t, ours, path, cl.get("--merge-file"))
    if size is not None:
        t.set("model.vocab_size", size, path_flag)
        t.ignore("--vocab-size", f"Megatron-LM takes the vocabulary from {kind}")
    else:
        _fallback_size(t, kind)


def _file_size(t: Translation, ours: str, path: str, merge: Optional[str]) -> Optional[int]:
    """The tokenizer's vocabulary when its file is on this machine (nothing is downloaded)."""
    from megatron_hydra.data.tokenizers import build_tokenizer

    path, merge = os.path.expanduser(path), merge and os.path.expanduser(merge)
    if not os.path.exists(path):
        return None
    try:
        return build_tokenizer(TokenizerConfig(type=ours, path=path, merge_file=merge)).vocab_size
    except MegatronHydraError as e:
        t.notes.append(f"the tokenizer at {path} could not be read ({e}): its vocabulary size is not known")
        return None


def _fallback_size(t: Translation, kind: str) -> None:
    cl = t.cl
    if kind in KNOWN_SIZES:
        t.set("model.vocab_size", KNOWN_SIZES[kind], "--tokenizer-type")
        t.notes.append(f"model.vocab_size={KNOWN_SIZES[kind]}: {kind}'s size (its file is not readable here)")
        t.ignore("--vocab-size", f"Megatron-LM takes the vocabulary from {kind}")
    elif cl.get("--vocab-size") is not None:
        t.set("model.vocab_size", cl.get("--vocab-size"), "--vocab-size")
        t.notes.append(f"model.vocab_size={cl.get('--vocab-size')} from --vocab-size: {kind}'s file is not readable "
                       "here, and Megatron-LM takes the size from the tokenizer: check it")
    else:
        t.notes.append(f"model.vocab_size: {kind}'s file is not readable here: set model.vocab_size to its size")
