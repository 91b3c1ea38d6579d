"""gpt2_bpe and tiktoken tokenizers against the libraries that define the formats: transformers'
slow (pure Python) GPT2Tokenizer and tiktoken itself. The files are made here from a small BPE
trained on a fixed text; nothing is downloaded."""

import base64
import json

import numpy as np
import pytest

from megatron_hydra.config.schema import TokenizerConfig
from megatron_hydra.data import preprocess as pp
from megatron_hydra.data.indexed import IndexedDataset
from megatron_hydra.data.tokenizers import build_tokenizer
from megatron_hydra.errors import DataError

TEXT = ("Hello world! It's a test; we'll see: they're 12345 apples, 3.14159 pies & 1,000,000 ants.\n\n"
        "Héllo wörld, café naïve façade — Ærø ÅÉÎÕÜ.\n"
        "日本語のテキスト、中文文本，한국어 텍스트.\n"
        "Emoji: 👋🏽 🎉🚀 👨‍👩‍👧 ✓\n"
        "    indented   spaces\t\ttabs  \n\n\n  trailing   \r\n"
        "DON'T I'M IT'S DON'Tcha O'Neill's 2024-12-03 0xDEADBEEF end")
CORPUS = [TEXT, "the quick brown fox jumps over the lazy dog " * 3, "def f(x):\n    return x + 1\n"] * 20
# Llama 3's pre-tokenisation, as its tokenizer source spells it.
LLAMA3_PAT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _trained_bpe(vocab_size, special_tokens):
    """A BPE whose merges cross every pre-tokenisation boundary (its words are all the 6-character
    windows of the texts), so that a tokenizer splitting text unlike the reference gets other ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([t[i:i + 6] for t in CORPUS[:3] for i in range(len(t))], trainer)
    return tok


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt2")
    _trained_bpe(600, ["<|endoftext|>"]).model.save(str(folder))  # vocab.json, merges.txt
    return folder


def _byte_of_char():
    """GPT-2's printable spelling of bytes, inverted (its published byte table)."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = {b: chr(b) for b in keep}
    chars.update({b: chr(256 + n) for n, b in enumerate(b for b in range(256) if b not in chars)})
    return {c: b for b, c in chars.items()}


def _llama3_specials(n):
    names = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
             "<|reserved_special_token_2|>", "<|reserved_special_token_3|>", "<|start_header_id|>",
             "<|end_header_id|>", "<|reserved_special_token_4|>", "<|eot_id|>"]
    names += [f"<|reserved_special_token_{i}|>" for i in range(5, 251)]
    return {name: n + i for i, name in enumerate(names)}


def test_gpt2_bpe_matches_gpt2_tokenizer(gpt2_dir, tmp_path):
    from transformers import GPT2Tokenizer

    ref = GPT2Tokenizer(str(gpt2_dir / "vocab.json"), str(gpt2_dir / "merges.txt"))
    text = TEXT + " <|endoftext|> after"
    # The folder, or Megatron's two files under their own names (--vocab-file/--merge-file).
    (tmp_path / "gpt2-vocab.json").write_bytes((gpt2_dir / "vocab.json").read_bytes())
    (tmp_path / "elsewhere.txt").write_bytes((gpt2_dir / "merges.txt").read_bytes())
    for cfg in (TokenizerConfig(type="gpt2_bpe", path=str(gpt2_dir)),
                TokenizerConfig(type="gpt2_bpe", path=str(tmp_path / "gpt2-vocab.json"),
                                merge_file=str(tmp_path / "elsewhere.txt"))):
        tok = build_tokenizer(cfg)
        assert tok.vocab_size == len(ref) and tok.eod == ref.eos_token_id == json.loads(
            (gpt2_dir / "vocab.json").read_text())["<|endoftext|>"]
        ids = tok.encode(text)
        assert ids == ref.encode(text) and len(ids) < len(text.encode("utf-8"))
        assert tok.decode(ids) == text == ref.decode(ids)
        assert tok.encode_batch([TEXT, "x"]) == [ref.encode(TEXT), ref.encode("x")]


def test_tiktoken_matches_tiktoken_encoding(tmp_path):
    import tiktoken

    # A rank file from a trained BPE: its ids are ranks 0..n-1, in merge order.
    byte_of = _byte_of_char()
    vocab = _trained_bpe(700, []).get_vocab()
    ranks = {bytes(byte_of[c] for c in token): i for token, i in vocab.items()}
    lines = [f"{base64.b64encode(t).decode()} {r}" for t, r in sorted(ranks.items(), key=lambda x: x[1])]
    (tmp_path / "tokenizer.model").write_text("\n".join(lines) + "\n")
    specials = _llama3_specials(len(ranks))
    ref = tiktoken.Encoding(name="llama3_small", pat_str=LLAMA3_PAT, mergeable_ranks=ranks, special_tokens=specials)
    tok = build_tokenizer(TokenizerConfig(type="tiktoken", path=str(tmp_path / "tokenizer.model")))
    assert tok.vocab_size == ref.n_vocab == len(ranks) + 256 and tok.eod == specials["<|end_of_text|>"]
    for name in ("<|begin_of_text|>", "<|eot_id|>", "<|reserved_special_token_250|>"):
        assert tok.token_to_id(name) == specials[name]
    text = "<|begin_of_text|>" + TEXT + "<|end_of_text|>"
    ids = tok.encode(text)
    assert ids == ref.encode(text, allowed_special="all") and len(ids) < len(text.encode("utf-8"))
    assert tok.decode(ids) == text == ref.decode(ids)
    # The folder holding tokenizer.model is the same tokenizer.
    assert build_tokenizer(TokenizerConfig(type="tiktoken", path=str(tmp_path))).encode(TEXT) == ref.encode(TEXT)


def test_preprocess_with_gpt2_bpe(gpt2_dir, tmp_path):
    from transformers import GPT2Tokenizer

    ref = GPT2Tokenizer(str(gpt2_dir / "vocab.json"), str(gpt2_dir / "merges.txt"))
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in CORPUS[:3]))
    cfg = pp.parse_args([f"input={tmp_path / 'in.jsonl'}", f"output_prefix={tmp_path / 'c'}", "progress=false",
                         "tokenizer.type=gpt2_bpe", f"tokenizer.path={gpt2_dir}"])
    ds = IndexedDataset(pp.preprocess(cfg)["text"])
    assert [np.asarray(ds[i]).tolist() for i in range(len(ds))] == [ref.encode(t) + [ref.eos_token_id]
                                                                   for t in CORPUS[:3]]


def test_unreadable_files_name_the_file(gpt2_dir, tmp_path):
    def fails(match, **cfg):
        with pytest.raises(DataError, match=match) as info:
            build_tokenizer(TokenizerConfig(**cfg))
        assert "\n" not in str(info.value)

    fails("nowhere.vocab.json: GPT-2 vocabulary not found", type="gpt2_bpe", path=str(tmp_path / "nowhere.vocab.json"))
    (tmp_path / "vocab.json").write_bytes((gpt2_dir / "vocab.json").read_bytes())
    fails("merges.txt: GPT-2 merges file not found", type="gpt2_bpe", path=str(tmp_path))
    (tmp_path / "merges.txt").write_text("#version: 0.2\nnot-a-pair\n")
    fails("merges.txt:2: not a merge", type="gpt2_bpe", path=str(tmp_path))
    (tmp_path / "merges.txt").write_text("#version: 0.2\nq z\n")
    fails("merges.txt: merge 1 .* do not belong together", type="gpt2_bpe", path=str(tmp_path))
    (tmp_path / "vocab.json").write_text("[1, 2]")
    fails("vocab.json: not a GPT-2 vocab.json", type="gpt2_bpe", path=str(tmp_path))
    fails("missing.model: tiktoken BPE file not found", type="tiktoken", path=str(tmp_path / "missing.model"))
    (tmp_path / "bad.model").write_text("IQ== 0\nnot base64!\n")
    fails("bad.model:2: not a tiktoken BPE line", type="tiktoken", path=str(tmp_path / "bad.model"))
    (tmp_path / "gap.model").write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {b * 2}\n"
                                                for b in range(256)))
    fails("gap.model: the ranks are not 0..255", type="tiktoken", path=str(tmp_path / "gap.model"))


def test_demo_corpus_is_cached_per_tokenizer_file(gpt2_dir, tmp_path):
    from megatron_hydra.data import demo

    other = tmp_path / "other"
    other.mkdir()
    _trained_bpe(300, ["<|endoftext|>"]).model.save(str(other))
    cfgs = [TokenizerConfig(type="gpt2_bpe", path=str(d)) for d in (gpt2_dir, other, gpt2_dir)]
    prefixes = [demo.build_demo_corpus(c, str(tmp_path / "cache"), max_bytes=20_000)[0] for c in cfgs]
    assert prefixes[0] != prefixes[1] and prefixes[0] == prefixes[2]
