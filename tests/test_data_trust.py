"""Data files from anyone: preprocess never leaves a corpus and a tokenizer that do not belong
together, never changes text it cannot decode, and an index that does not describe its .bin is
refused at open in one line naming the file.

References: Python's own UTF-8 codec (the bytes a document must hold) and the Hugging Face
tokenizer file itself (a corpus must decode with the tokenizer saved beside it).
"""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest

from megatron_hydra.config.schema import TokenizerConfig
from megatron_hydra.data import preprocess as pp
from megatron_hydra.data.indexed import IndexedDataset, IndexedDatasetWriter
from megatron_hydra.errors import DataError

BPE = TokenizerConfig(type="bpe", vocab_size=300)
GOOD = ["def main(argv):\n    return argv[0] + 1\n", "the quick brown fox jumps over the lazy dog\n"]


def _run(src, prefix, **kw):
    cfg = pp.PreprocessConfig(input=str(src), output_prefix=str(prefix), progress=False, **kw)
    return pp.preprocess(cfg)


def _docs(prefix):
    ds = IndexedDataset(prefix)
    di = ds.document_indices
    return [np.concatenate([ds[i] for i in range(di[d], di[d + 1])]).tolist() for d in range(ds.num_documents)]


def _write_jsonl(path, texts, extra=b""):
    path.write_bytes(b"".join(json.dumps({"text": t}).encode() + b"\n" for t in texts) + extra)
    return path


def test_failed_bpe_preprocess_keeps_the_tokenizer_that_matches_the_corpus(tmp_path):
    from tokenizers import Tokenizer

    out = tmp_path / "out"
    prefix = _run(_write_jsonl(tmp_path / "a.jsonl", GOOD * 3), out / "c",
                  tokenizer=BPE)["text"]
    files = sorted(os.listdir(out))
    before = {name: (out / name).read_bytes() for name in files}
    other = ["completely different words: zebra quartz jukebox vexing " * 3, "ünïcödé ✓ " * 10]
    bad = _write_jsonl(tmp_path / "b.jsonl", other, extra=b"{not json\n")
    with pytest.raises(DataError, match=r"b\.jsonl:3: not valid JSON"):
        _run(bad, out / "c", tokenizer=BPE)
    assert sorted(os.listdir(out)) == files  # no temporary file left behind
    assert {name: (out / name).read_bytes() for name in files} == before
    tok = Tokenizer.from_file(str(out / "c_tokenizer.json"))
    eod = tok.token_to_id("<|endoftext|>")
    assert [tok.decode(d[:-1]) for d in _docs(prefix)] == GOOD * 3 and all(d[-1] == eod for d in _docs(prefix))


def test_non_utf8_text_is_refused_naming_the_line_or_skipped_on_request(tmp_path):
    txt = tmp_path / "in.txt"
    txt.write_bytes(b"good line\nbad \xff line\nlast line\n")
    for workers in (1, 2):
        with pytest.raises(DataError, match=r"in\.txt:2: not UTF-8 text \(byte 0xff at byte offset 14 of the file\)"
                                            r".*on_bad_line=skip") as err:
            _run(txt, tmp_path / "o" / "t", workers=workers)
        assert str(err.value).startswith(str(txt)) and "\n" not in str(err.value)
    assert not (tmp_path / "o").exists() or not os.listdir(tmp_path / "o")
    out = _run(txt, tmp_path / "o" / "t", on_bad_line="skip")["text"]
    assert _docs(out) == [list("good line\nlast line\n".encode("utf-8")) + [256]]

    jsonl = _write_jsonl(tmp_path / "in.jsonl", ["ok ✓"], extra=b'{"text": "caf\xe9"}\n')  # 22 + 13 bytes
    with pytest.raises(DataError, match=r"in\.jsonl:2: not UTF-8 text \(byte 0xe9 at byte offset 35"):
        _run(jsonl, tmp_path / "j" / "t")
    assert _docs(_run(jsonl, tmp_path / "j" / "t", on_bad_line="skip")["text"]) == [list("ok ✓".encode()) + [256]]
    # A BPE is not trained on text that would be refused afterwards.
    with pytest.raises(DataError, match=r"in\.txt:2: not UTF-8"):
        _run(txt, tmp_path / "b" / "t", tokenizer=BPE)
    assert not (tmp_path / "b").exists() or not os.listdir(tmp_path / "b")


@pytest.fixture
def corpus(tmp_path):
    prefix = str(tmp_path / "c")
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for n in (10, 5, 7):
            w.add_document(np.arange(n))
    return prefix


def _patch_index(prefix, array, i, value):
    """Overwrite entry ``i`` of the index's lengths (int32) or pointers (int64) array."""
    head, num_seqs = 9 + 8 + 1 + 8 + 8, 3
    offset, fmt = (head + 4 * i, "<i") if array == "lengths" else (head + 4 * num_seqs + 8 * i, "<q")
    with open(prefix + ".idx", "r+b") as f:
        f.seek(offset)
        f.write(struct.pack(fmt, value))


@pytest.mark.parametrize("array, i, value, words", [
    ("lengths", 0, 1 << 20, "sequence 1 points to byte 20 of"),
    ("lengths", 1, -3, "sequence 1 has length -3"),
    ("pointers", 1, -4, "sequence 1 points to byte -4 of"),
    ("pointers", 2, 24, "sequence 2 points to byte 24 of"),
    ("lengths", 2, 1 << 20, "describes 2097182: truncated"),
], ids=["inflated-length", "negative-length", "negative-pointer", "overlapping-pointer", "inflated-last-length"])
def test_index_pointers_are_checked_against_the_bin_at_open(corpus, array, i, value, words):
    assert [d.tolist() for d in IndexedDataset(corpus)] == [list(range(n)) for n in (10, 5, 7)]
    _patch_index(corpus, array, i, value)
    with pytest.raises(DataError) as err:
        IndexedDataset(corpus)
    msg = str(err.value)
    assert words in msg and (corpus + ".idx") in msg and "\n" not in msg and "re-create" in msg
