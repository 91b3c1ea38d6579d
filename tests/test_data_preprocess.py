"""preprocess: jsonl/txt -> .bin/.idx, checked against Python's own UTF-8 encoding and tokenizers."""

import json
import os
import runpy
import sys
import threading
import time
import warnings
from multiprocessing.pool import ThreadPool
from unittest import mock

import numpy as np
import pytest

from megatron_hydra.config.schema import TokenizerConfig
from megatron_hydra.data import preprocess as pp
from megatron_hydra.data.gpt_dataset import GPTDataset
from megatron_hydra.data.indexed import IndexedDataset
from megatron_hydra.errors import ConfigError, DataError

TEXTS = ["hello world", "", "ünïcödé ✓ and more", "line one\nline two\n", "x" * 300, "{\"json\": 1}"]


def write_jsonl(path, records, extra_lines=()):
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
        for line in extra_lines:
            f.write(line + "\n")
    return str(path)


def run(tmp_path, input, **kw):
    cfg = pp.PreprocessConfig(input=str(input), output_prefix=str(tmp_path / "out" / "c"), progress=False)
    for k, v in kw.items():
        setattr(cfg, k, v)
    return pp.preprocess(cfg)


def read_docs(prefix):
    ds = IndexedDataset(prefix)
    di = ds.document_indices
    return [np.concatenate([ds[i] for i in range(di[d], di[d + 1])]).tolist() for d in range(ds.num_documents)]


def test_byte_tokenizer_output_matches_utf8(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t, "other": t.upper()} for t in TEXTS])
    out = run(tmp_path, src, json_keys=["text", "other"])
    assert set(out) == {"text", "other"} and out["text"].endswith("c_text_document")
    for key, f in (("text", str), ("other", str.upper)):
        expected = [list(f(t).encode("utf-8")) + [256] for t in TEXTS if t]  # empty documents are skipped
        assert read_docs(out[key]) == expected
        assert IndexedDataset(out[key]).dtype == np.uint16


def test_output_identical_for_any_worker_count(tmp_path):
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "δέλτα", "\n", "epsilon", "zeta"]
    records = [{"text": " ".join(rng.choice(words, int(rng.integers(1, 200))))} for _ in range(400)]
    src = write_jsonl(tmp_path / "in.jsonl", records)
    outs = {}
    for workers in (1, 2):
        cfg = pp.PreprocessConfig(input=src, output_prefix=str(tmp_path / f"w{workers}" / "c"), workers=workers,
                                  progress=False, chunk_bytes=2000,
                                  tokenizer=TokenizerConfig(type="bpe", vocab_size=300))
        outs[workers] = pp.preprocess(cfg)["text"]
    for ext in (".bin", ".idx"):
        with open(outs[1] + ext, "rb") as a, open(outs[2] + ext, "rb") as b:
            assert a.read() == b.read()
    samples = [GPTDataset(IndexedDataset(outs[w]), np.arange(400), 50, 32, 3, str(tmp_path / f"k{w}")) for w in (1, 2)]
    for i in range(len(samples[0])):
        np.testing.assert_array_equal(samples[0].sample_tokens(i), samples[1].sample_tokens(i))


def test_bpe_is_trained_saved_next_to_the_data_and_round_trips(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in TEXTS * 20])
    out = run(tmp_path, src, tokenizer=TokenizerConfig(type="bpe", vocab_size=300))
    tok_path = str(tmp_path / "out" / "c_tokenizer.json")
    from tokenizers import Tokenizer

    reference = Tokenizer.from_file(tok_path)  # the library itself, not our wrapper
    eod = reference.token_to_id("<|endoftext|>")
    docs = read_docs(out["text"])
    assert len(docs) == 20 * sum(1 for t in TEXTS if t)
    for ids, text in zip(docs, [t for t in TEXTS * 20 if t]):
        assert ids[-1] == eod and max(ids) < reference.get_vocab_size() <= 300
        assert reference.decode(ids[:-1]) == text


def test_text_files_and_directories(tmp_path):
    d = tmp_path / "corpus"
    (d / "sub").mkdir(parents=True)
    big = "".join(f"line {i} of a long file\n" for i in range(500))
    (d / "b.txt").write_text(big)
    (d / "sub" / "a.txt").write_text("small ✓")
    write_jsonl(d / "c.jsonl", [{"text": "from json"}])
    (d / "ignored.md").write_text("not an input")
    out = run(tmp_path, d, chunk_bytes=1000)
    ds = IndexedDataset(out["text"])
    docs = read_docs(out["text"])
    # Sorted by path: b.txt, c.jsonl, sub/a.txt; the big file is one document of many pieces.
    assert docs == [list(big.encode()) + [256], list(b"from json") + [256], list("small ✓".encode()) + [256]]
    assert ds.document_indices[1] > 1 and max(ds.sequence_lengths) <= 1000 + 30
    pieces = [bytes(ds[i].astype(np.uint8)).decode() for i in range(ds.document_indices[1])]
    assert all(p.endswith("\n") for p in pieces[:-1])  # cut at line ends


def test_bad_lines_stop_or_skip(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "ok"}], ["{not json", "[1, 2]", '{"title": "no text"}'])
    with pytest.raises(DataError, match=r"in\.jsonl:2: not valid JSON.*on_bad_line=skip") as err:
        run(tmp_path, src)
    assert str(err.value).startswith(src)
    assert not os.path.exists(tmp_path / "out" / "c_text_document.bin")
    out = run(tmp_path, src, on_bad_line="skip")
    assert read_docs(out["text"]) == [list(b"ok") + [256]]
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"title": "x"}])
    with pytest.raises(DataError, match=r"bad\.jsonl:1: no string field 'text'"):
        run(tmp_path, bad)


def test_empty_and_missing_inputs(tmp_path):
    empty = write_jsonl(tmp_path / "empty.jsonl", [{"text": ""}])
    with pytest.raises(DataError, match="empty.jsonl: no documents .* empty"):
        run(tmp_path, empty)
    with pytest.raises(DataError, match="nope.jsonl: input not found"):
        run(tmp_path, tmp_path / "nope.jsonl")
    (tmp_path / "d").mkdir()
    with pytest.raises(DataError, match="no .jsonl or .txt files"):
        run(tmp_path, tmp_path / "d")


def test_arguments_are_typed_overrides():
    cfg = pp.parse_args(["input=a.jsonl", "output_prefix=o", "json_keys=[text,title]",
                         "tokenizer.type=bpe", "tokenizer.vocab_size=8192", "workers=2"])
    assert cfg.json_keys == ["text", "title"] and cfg.tokenizer.vocab_size == 8192 and cfg.workers == 2
    with pytest.raises(ConfigError, match="bogus"):
        pp.parse_args(["input=a", "output_prefix=o", "bogus=1"])
    with pytest.raises(ConfigError, match="workers"):
        pp.parse_args(["input=a", "output_prefix=o", "workers=many"])
    with pytest.raises(ConfigError, match="output_prefix is required"):
        pp.parse_args(["input=a"])


def _python_m_preprocess(*argv: str) -> int:
    """``python -m megatron_hydra.data.preprocess *argv`` run as the interpreter runs ``-m`` (the
    module's ``__main__`` block), in this process: a fresh interpreter would only add its start.
    Returns the exit status."""
    with mock.patch.object(sys, "argv", ["preprocess", *argv]), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the module is imported already (by this file)
        try:
            runpy.run_module("megatron_hydra.data.preprocess", run_name="__main__", alter_sys=True)
        except SystemExit as stop:
            return stop.code
    raise AssertionError("the module's __main__ block did not exit")


def test_command_line(tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in TEXTS])
    code = _python_m_preprocess(f"input={src}", f"output_prefix={tmp_path}/cli")
    err = capsys.readouterr().err
    assert code == 0, err
    assert "MB/s" in err and os.path.exists(f"{tmp_path}/cli_text_document.idx")
    assert _python_m_preprocess("input=x.jsonl") == 2
    assert capsys.readouterr().err.strip() == "error: output_prefix is required, e.g. output_prefix=..."


def test_read_ahead_is_bounded():
    pulled, consumed = [0], 0
    peak = 0

    def source():
        for i in range(200):
            pulled[0] += 1
            yield i

    with ThreadPool(2) as pool:
        for _ in pp._bounded_imap(pool, abs, source(), max_pending=4):
            consumed += 1
            time.sleep(0.001)
            peak = max(peak, pulled[0] - consumed)
    assert consumed == 200 and peak <= 5
    assert threading.active_count() < 10
