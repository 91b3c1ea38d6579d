"""Tokenizers: each kind against the library that defines it, built from local files only."""

import io
import json

import pytest

from megatron_hydra.config.schema import TokenizerConfig
from megatron_hydra.data.tokenizers import ByteTokenizer, build_tokenizer, train_bpe
from megatron_hydra.errors import ConfigError, DataError

TEXT = "Héllo wörld ✓ — tabs\tand\nnewlines"


def test_byte_tokenizer_is_utf8():
    tok = build_tokenizer(TokenizerConfig(type="byte"))
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 257 and tok.eod == 256
    assert tok.encode(TEXT) == list(TEXT.encode("utf-8"))
    assert tok.decode(tok.encode(TEXT) + [tok.eod]) == TEXT


def test_hf_tokenizer_json_from_a_local_file(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "</s>": 3}
    ref = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    ref.pre_tokenizer = pre_tokenizers.Whitespace()
    ref.save(str(tmp_path / "tokenizer.json"))
    for path in (tmp_path / "tokenizer.json", tmp_path):  # a file, or the folder holding it
        tok = build_tokenizer(TokenizerConfig(type="hf", path=str(path)))
        assert tok.vocab_size == 4 and tok.eod == 3
        assert tok.encode("hello world nope") == [1, 2, 0]
        assert tok.encode_batch(["world", "hello hello"]) == [[2], [1, 1]]


def test_trained_bpe_round_trips_and_is_deterministic(tmp_path):
    corpus = [TEXT, "the same words again and again", "def f(x):\n    return x + 1\n"] * 30
    a = train_bpe(corpus, 300, str(tmp_path / "a.json"))
    train_bpe(iter(corpus), 300, str(tmp_path / "b.json"))
    assert json.loads((tmp_path / "a.json").read_text()) == json.loads((tmp_path / "b.json").read_text())
    assert a.vocab_size <= 300 and a.eod == 0
    for text in corpus[:3] + ["unseen ☃ text"]:
        ids = a.encode(text)
        assert a.decode(ids) == text and max(ids) < a.vocab_size
    assert build_tokenizer(TokenizerConfig(type="bpe", path=str(tmp_path / "a.json"))).encode(TEXT) == a.encode(TEXT)


def test_sentencepiece_model_from_a_local_file(tmp_path):
    import sentencepiece as spm

    model = io.BytesIO()
    sentences = ["hello world this is a test", "the quick brown fox jumps over the lazy dog"] * 50
    spm.SentencePieceTrainer.train(sentence_iterator=iter(sentences), model_writer=model, vocab_size=40,
                                   model_type="bpe", minloglevel=2)
    (tmp_path / "m.model").write_bytes(model.getvalue())
    ref = spm.SentencePieceProcessor(model_file=str(tmp_path / "m.model"))
    tok = build_tokenizer(TokenizerConfig(type="sentencepiece", path=str(tmp_path / "m.model")))
    assert tok.vocab_size == 40 and tok.eod == ref.eos_id() >= 0
    assert tok.encode("hello lazy fox") == ref.encode("hello lazy fox")
    assert tok.decode(tok.encode("hello lazy fox")) == "hello lazy fox"


def test_errors_name_the_key_or_file(tmp_path):
    with pytest.raises(ConfigError, match="data.tokenizer.type='gpt2'"):
        build_tokenizer(TokenizerConfig(type="gpt2"))
    with pytest.raises(ConfigError, match="data.tokenizer.path is required"):
        build_tokenizer(TokenizerConfig(type="hf"))
    with pytest.raises(DataError, match="missing.json: tokenizer file not found"):
        build_tokenizer(TokenizerConfig(type="hf", path=str(tmp_path / "missing.json")))
    with pytest.raises(DataError, match="m.model: SentencePiece model not found"):
        build_tokenizer(TokenizerConfig(type="sentencepiece", path=str(tmp_path / "m.model")))
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(DataError, match="bad.json: not a readable tokenizer.json"):
        build_tokenizer(TokenizerConfig(type="hf", path=str(tmp_path / "bad.json")))
    with pytest.raises(DataError, match="no trained BPE tokenizer"):
        build_tokenizer(TokenizerConfig(type="bpe", path=str(tmp_path / "untrained.json")))
    with pytest.raises(ConfigError, match="at least 257"):
        train_bpe(["abc"], 100, str(tmp_path / "small.json"))
