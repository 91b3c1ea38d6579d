"""Tokenizers behind one small interface: ``vocab_size``, ``eod``, ``encode``, ``decode``.

Six kinds, chosen by ``TokenizerConfig.type``:

- ``byte``: UTF-8 bytes plus one end-of-document id (vocabulary 257). Needs no file, so a run
  can never fail for want of one; a good default for tests and the smallest models.
- ``hf``: a Hugging Face ``tokenizers`` ``tokenizer.json`` from a local path.
- ``sentencepiece``: a SentencePiece ``.model`` file from a local path.
- ``bpe``: a byte-level BPE trained on the corpus itself (``tokenizers``' trainer) with
  ``vocab_size`` entries and saved next to the data, after which it is an ``hf`` tokenizer.
- ``gpt2_bpe``: GPT-2's ``vocab.json`` + ``merges.txt`` (Megatron's GPT2BPETokenizer).
- ``tiktoken``: a tiktoken rank file read as Llama 3 does (its ``tokenizer.model``).

The last two are read by ``bpe_files`` into the same ``tokenizers`` BPE that ``hf`` loads.

Nothing is ever fetched from the internet: a path is a path. The ``tokenizers`` and
``sentencepiece`` packages are imported only when such a tokenizer is built, so that commands
which never tokenize (plan mode, synthetic data) do not pay for them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import os
from typing import Callable, Iterable, List, Optional, Sequence

from megatron_hydra.config.schema import TokenizerConfig
from megatron_hydra.errors import ConfigError, DataError

TYPES = ("byte", "hf", "sentencepiece", "bpe", "gpt2_bpe", "tiktoken")
DEFAULT_BPE_VOCAB = 8192
# The end-of-document token of a trained BPE; GPT-2's spelling, so that tools recognise it.
BPE_EOD_TOKEN = "<|endoftext|>"
# Spellings of an end-of-document token in common tokenizer.json files, most specific first.
_EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]", "<EOD>")


class Tokenizer(ABC):
    """What the data pipeline needs from a tokenizer, and nothing more."""

    vocab_size: int
    eod: int

    @abstractmethod
    def encode(self, text: str) -> List[int]:
        """Token ids of ``text`` (no end-of-document token)."""

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``."""

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        """Encode many texts; tokenizers with a native batch path override this."""
        return [self.encode(t) for t in texts]

    def token_to_id(self, token: str) -> Optional[int]:
        """The id of a special token spelled ``token`` ([CLS], <extra_id_0>, ...), or None."""
        return None

    def id_to_token(self, i: int) -> Optional[str]:
        """The vocabulary entry of id ``i`` as the tokenizer spells it (e.g. "##ing"), or None."""
        return None


class ByteTokenizer(Tokenizer):
    """Ids 0..255 are UTF-8 bytes, 256 is end of document."""

    vocab_size = 257
    eod = 256

    def encode(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def id_to_token(self, i: int) -> Optional[str]:
        return bytes([i]).decode("latin-1") if 0 <= i < 256 else None

    def decode(self, ids: Sequence[int]) -> str:
        # Ids a model may sample beyond the bytes (eod, padding) are dropped, not fatal.
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class LibraryTokenizer(Tokenizer):
    """A tokenizer of the ``tokenizers`` library (Rust: fast, with a native batch path), read
    from ``path`` by whichever kind built it; ``eod`` is its end-of-document id."""

    def __init__(self, tok, path: str, eod: int):
        self._tok, self.path, self.eod = tok, path, eod
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> List[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return [e.ids for e in batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_to_id(self, token: str) -> Optional[int]:
        return self._tok.token_to_id(token)

    def id_to_token(self, i: int) -> Optional[str]:
        return self._tok.id_to_token(i)


class HFTokenizer(LibraryTokenizer):
    """A ``tokenizers`` tokenizer.json; the end-of-document id is its EOS-like special token."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer as _HF

        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(path):
            raise DataError(f"{path}: tokenizer file not found (data.tokenizer.path must be a local "
                            f"tokenizer.json; nothing is downloaded)")
        try:
            tok = _HF.from_file(path)
        except Exception as e:  # the library raises a bare Exception on a malformed file
            raise DataError(f"{path}: not a readable tokenizer.json ({e})") from None
        vocab = tok.get_vocab(with_added_tokens=True)
        found = [vocab[t] for t in _EOD_CANDIDATES if t in vocab]
        if not found:
            raise DataError(f"{path}: no end-of-document token (looked for {', '.join(_EOD_CANDIDATES)}); "
                            f"add one as a special token")
        super().__init__(tok, path, found[0])


def gpt2_bpe_tokenizer(path: str, merge_file: Optional[str] = None) -> LibraryTokenizer:
    """GPT-2's ``vocab.json`` + ``merges.txt``: ``path`` is the folder holding both or the
    vocab.json itself, ``merge_file`` the merges when they are elsewhere or named otherwise."""
    from megatron_hydra.data import bpe_files

    vocab, merges = bpe_files.gpt2_files(path, merge_file)
    tok, eod = bpe_files.gpt2_bpe(vocab, merges)
    return LibraryTokenizer(tok, vocab, eod)


def tiktoken_tokenizer(path: str) -> LibraryTokenizer:
    """A tiktoken rank file (or the folder holding ``tokenizer.model``) with Llama 3's regex and
    special tokens."""
    from megatron_hydra.data import bpe_files

    tok, eod = bpe_files.tiktoken_bpe(path)
    return LibraryTokenizer(tok, path, eod)


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model; end of document is its EOS id."""

    def __init__(self, path: str):
        import sentencepiece as spm

        if not os.path.isfile(path):
            raise DataError(f"{path}: SentencePiece model not found (data.tokenizer.path must be a "
                            f"local .model file; nothing is downloaded)")
        try:
            self._sp = spm.SentencePieceProcessor(model_file=path)
        except (OSError, RuntimeError) as e:
            raise DataError(f"{path}: not a readable SentencePiece model ({e})") from None
        self.path = path
        self.vocab_size = self._sp.get_piece_size()
        self.eod = self._sp.eos_id()
        if self.eod < 0:
            raise DataError(f"{path}: the SentencePiece model has no EOS piece; train it with eos_id >= 0")

    def encode(self, text: str) -> List[int]:
        return self._sp.encode(text, out_type=int)

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return self._sp.encode(list(texts), out_type=int)

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def token_to_id(self, token: str) -> Optional[int]:
        i = self._sp.piece_to_id(token)
        return None if i == self._sp.unk_id() and token != self._sp.id_to_piece(i) else i

    def id_to_token(self, i: int) -> Optional[str]:
        return self._sp.id_to_piece(i)


def train_bpe(texts: Iterable[str], vocab_size: int, path: str, length: Optional[int] = None) -> HFTokenizer:
    """Train a byte-level BPE on ``texts`` and save it as a tokenizer.json at ``path``.

    Byte-level means every string is encodable (no unknown token) and decoding is lossless.
    Training is deterministic for a given corpus; the file is renamed into place when complete,
    so a concurrent reader never loads half of it.
    """
    from tokenizers import Tokenizer as _HF, decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise ConfigError(f"data.tokenizer.vocab_size={vocab_size}: a byte-level BPE needs at least "
                          f"257 entries (256 bytes + end of document)")
    tok = _HF(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BPE_EOD_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer, length=length)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    tok.save(tmp)
    os.replace(tmp, path)
    return HFTokenizer(path)


def build_tokenizer(cfg: TokenizerConfig, *, corpus: Optional[Callable[[], Iterable[str]]] = None,
                    save_path: Optional[str] = None) -> Tokenizer:
    """The tokenizer ``cfg`` describes.

    For ``bpe``: an existing file at ``cfg.path`` (or ``save_path``) is loaded; otherwise, when
    ``corpus`` (a function returning an iterable of texts) is given, a BPE is trained on it and
    saved there. Without either it is an error, because training needs the corpus.
    """
    kind = cfg.type
    if kind not in TYPES:
        raise ConfigError(f"data.tokenizer.type={kind!r}: choose one of {', '.join(TYPES)}")
    if kind == "byte":
        return ByteTokenizer()
    if kind in ("hf", "sentencepiece", "gpt2_bpe", "tiktoken"):
        if not cfg.path:
            raise ConfigError(f"data.tokenizer.path is required for data.tokenizer.type={kind}")
        path = os.path.expanduser(cfg.path)
        if kind == "gpt2_bpe":
            return gpt2_bpe_tokenizer(path, cfg.merge_file)
        if kind == "tiktoken":
            return tiktoken_tokenizer(path)
        return HFTokenizer(path) if kind == "hf" else SentencePieceTokenizer(path)
    path = os.path.expanduser(cfg.path) if cfg.path else save_path
    if path and os.path.isfile(path):
        return HFTokenizer(path)
    if corpus is None or not path:
        raise DataError(f"{path or 'data.tokenizer.path'}: no trained BPE tokenizer there; run "
                        f"python -m megatron_hydra.data.preprocess with tokenizer.type=bpe first, "
                        f"or set data.tokenizer.path to its tokenizer.json")
    return train_bpe(corpus(), cfg.vocab_size or DEFAULT_BPE_VOCAB, path)
