"""The two standard byte-level BPE file formats, read into a ``tokenizers`` BPE.

- GPT-2's ``vocab.json`` + ``merges.txt`` (Megatron's ``--vocab-file``/``--merge-file`` of its
  GPT2BPETokenizer): the vocabulary spells bytes with GPT-2's printable byte alphabet, and the
  merges are ranked by line. Pre-tokenisation is GPT-2's regex; ``<|endoftext|>`` ends a document.
- tiktoken rank files (Llama 3's ``tokenizer.model``): one ``base64(token bytes) rank`` per line;
  a token's rank is its id and also its merge priority. Pre-tokenisation is Llama 3's regex, and
  Llama 3's 256 special tokens take the ids after the ranks; ``<|end_of_text|>`` ends a document.

Both become the same Rust BPE that reads a ``tokenizer.json``, so encoding is as fast as for the
``hf`` kind, and neither tiktoken nor transformers is needed at run time. A tiktoken file has no
merge list, so one is derived: every split of a token into two tokens is a merge with the token's
rank, and a piece that is itself a token is taken whole, as tiktoken does.

Special tokens in the text (``<|endoftext|>``, ``<|begin_of_text|>``, ...) encode to their ids,
as a Hugging Face tokenizer does; the parsers here raise ``DataError`` naming the file.
"""

from __future__ import annotations

import base64
import binascii
import os
from typing import Dict, List, Optional, Tuple

from megatron_hydra.errors import DataError
from megatron_hydra.untrusted import MiB, load_json

GPT2_EOD_TOKEN = "<|endoftext|>"
# GPT-2's pre-tokenisation: contractions, letters, digits, other symbols (each with one optional
# leading space), then whitespace runs, the last space of a run left to the next word.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Llama 3's: case-insensitive contractions, digits in groups of at most three, newlines kept
# apart from other whitespace.
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_NUM_SPECIAL = 256
LLAMA3_EOD_TOKEN = "<|end_of_text|>"
# GPT-2's and Megatron's spellings of the two files in a folder, most common first.
VOCAB_NAMES = ("vocab.json", "gpt2-vocab.json")
MERGES_NAMES = ("merges.txt", "gpt2-merges.txt")
# GPT-2's vocab.json is about 1 MB; a file far larger is not a vocabulary.
_VOCAB_LIMIT = 256 * MiB


def llama3_special_tokens() -> List[str]:
    """Llama 3's special tokens in id order: they follow the last rank."""
    named = ["<|begin_of_text|>", LLAMA3_EOD_TOKEN, "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
             "<|reserved_special_token_2|>", "<|reserved_special_token_3|>", "<|start_header_id|>",
             "<|end_header_id|>", "<|reserved_special_token_4|>", "<|eot_id|>"]
    return named + [f"<|reserved_special_token_{i}|>" for i in range(5, LLAMA3_NUM_SPECIAL - 5)]


def byte_alphabet() -> Dict[int, str]:
    """GPT-2's byte -> character map: printable Latin-1 bytes stand for themselves, the others for
    the characters from U+0100 on, so every byte string is a printable string of the same length."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def gpt2_files(path: str, merge_file: Optional[str]) -> Tuple[str, str]:
    """The vocabulary and merges files of ``data.tokenizer.path`` (a folder holding both, or the
    vocab.json itself) and ``data.tokenizer.merge_file`` (default: the merges file beside it)."""
    if os.path.isdir(path):
        folder = path
        vocab = next((os.path.join(path, n) for n in VOCAB_NAMES if os.path.isfile(os.path.join(path, n))),
                     os.path.join(path, VOCAB_NAMES[0]))
    else:
        folder, vocab = os.path.dirname(path), path
    if not os.path.isfile(vocab):
        raise DataError(f"{vocab}: GPT-2 vocabulary not found (data.tokenizer.path must be a local vocab.json "
                        f"or the folder holding vocab.json and merges.txt; nothing is downloaded)")
    if merge_file:
        merges = os.path.expanduser(merge_file)
    else:
        merges = next((os.path.join(folder, n) for n in MERGES_NAMES if os.path.isfile(os.path.join(folder, n))),
                      os.path.join(folder, MERGES_NAMES[0]))
    if not os.path.isfile(merges):
        raise DataError(f"{merges}: GPT-2 merges file not found (put merges.txt beside {os.path.basename(vocab)} "
                        f"or set data.tokenizer.merge_file)")
    return vocab, merges


def _read_gpt2_vocab(path: str) -> Dict[str, int]:
    vocab = load_json(path, _VOCAB_LIMIT, "GPT-2 vocab.json", DataError)
    if not isinstance(vocab, dict) or not all(isinstance(v, int) for v in vocab.values()):
        raise DataError(f"{path}: not a GPT-2 vocab.json (expected a JSON object of token -> id)")
    return vocab


def _read_gpt2_merges(path: str) -> List[Tuple[str, str]]:
    merges = []
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                line = line.rstrip("\r\n")
                if not line or (n == 1 and line.startswith("#version")):
                    continue
                pair = line.split(" ")
                if len(pair) != 2:
                    raise DataError(f"{path}:{n}: not a merge (expected two tokens separated by one space)")
                merges.append((pair[0], pair[1]))
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not a readable GPT-2 merges.txt ({e})") from None
    return merges


def gpt2_bpe(vocab_path: str, merges_path: str):
    """GPT-2's tokenizer from its two files, and its end-of-document id. A vocabulary without
    ``<|endoftext|>`` gets it as the next id."""
    from tokenizers import Tokenizer, models

    vocab, merges = _read_gpt2_vocab(vocab_path), _read_gpt2_merges(merges_path)
    for n, (a, b) in enumerate(merges):
        if a not in vocab or b not in vocab or a + b not in vocab:
            raise DataError(f"{merges_path}: merge {n + 1} ({a} {b}) uses a token missing from {vocab_path}: "
                            f"the two files do not belong together")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    return _byte_level(tok, GPT2_PATTERN, [GPT2_EOD_TOKEN]), tok.token_to_id(GPT2_EOD_TOKEN)


def read_tiktoken_ranks(path: str) -> Dict[bytes, int]:
    """The token bytes -> rank table of a tiktoken file; the ranks must be 0..n-1, as the special
    tokens are numbered from n."""
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.model")
    if not os.path.isfile(path):
        raise DataError(f"{path}: tiktoken BPE file not found (data.tokenizer.path must be a local file of "
                        f"'base64 rank' lines, such as Llama 3's tokenizer.model; nothing is downloaded)")
    ranks: Dict[bytes, int] = {}
    try:
        with open(path, "rb") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    token, rank = line.split()
                    ranks[base64.b64decode(token, validate=True)] = int(rank)
                except (ValueError, binascii.Error):
                    raise DataError(f"{path}:{n}: not a tiktoken BPE line (expected 'base64 rank')") from None
    except OSError as e:
        raise DataError(f"{path}: not a readable tiktoken BPE file ({e})") from None
    if not ranks:
        raise DataError(f"{path}: an empty tiktoken BPE file")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise DataError(f"{path}: the ranks are not 0..{len(ranks) - 1}, each once, as a tiktoken BPE file's are")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise DataError(f"{path}: byte {missing[0]} has no rank; a byte-level BPE needs all 256 single bytes")
    return ranks


def tiktoken_bpe(path: str):
    """A tiktoken rank file as Llama 3 reads it (its regex and special tokens), and its
    end-of-document id. The merges are derived from the ranks (module docstring)."""
    from tokenizers import Tokenizer, models

    ranks = read_tiktoken_ranks(path)
    table = str.maketrans({chr(b): c for b, c in byte_alphabet().items()})
    spelled = {t: t.decode("latin-1").translate(table) for t in ranks}  # byte i -> chr(i) -> alphabet
    merges = []  # ranks are visited in order, so the merges come out sorted by rank
    for token in sorted(ranks, key=ranks.__getitem__):
        splits = [(token[:i], token[i:]) for i in range(1, len(token))]
        splits = sorted((ranks[a], ranks[b], a, b) for a, b in splits if a in ranks and b in ranks)
        merges.extend((spelled[a], spelled[b]) for _, _, a, b in splits)
    vocab = {spelled[t]: r for t, r in ranks.items()}
    specials = llama3_special_tokens()
    for i, name in enumerate(specials):  # ids after the ranks, whatever order they are added in
        if name in vocab:
            raise DataError(f"{path}: the rank table holds {name}, which Llama 3 keeps as a special token")
        vocab[name] = len(ranks) + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    return _byte_level(tok, LLAMA3_PATTERN, specials), tok.token_to_id(LLAMA3_EOD_TOKEN)


def _byte_level(tok, pattern: str, specials: List[str]):
    """``tok`` splitting text with ``pattern`` into byte-level pieces, with ``specials`` kept whole."""
    from tokenizers import AddedToken, Regex, decoders, pre_tokenizers

    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return tok
