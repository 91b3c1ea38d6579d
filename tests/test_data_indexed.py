"""The .bin/.idx format against an independent writer that follows Megatron-Core's layout."""

import os
import pickle
import struct

import numpy as np
import pytest

from megatron_hydra.data.indexed import IndexedDataset, IndexedDatasetWriter, token_dtype
from megatron_hydra.errors import DataError

# Megatron-Core's dtype codes, written out here rather than imported from the code under test.
SPEC_DTYPES = {1: "u1", 2: "i1", 3: "<i2", 4: "<i4", 5: "<i8", 6: "<f8", 7: "<f4", 8: "<u2"}


def spec_write(prefix, docs, code):
    """Write ``docs`` (a list of documents, each a list of 1-D arrays) straight from the spec."""
    dtype = np.dtype(SPEC_DTYPES[code])
    seqs = [np.asarray(s, dtype=dtype) for doc in docs for s in doc]
    with open(prefix + ".bin", "wb") as f:
        for s in seqs:
            f.write(s.tobytes())
    lengths = [len(s) for s in seqs]
    pointers, pos = [], 0
    for n in lengths:
        pointers.append(pos)
        pos += n * dtype.itemsize
    doc_idx = [0]
    for doc in docs:
        doc_idx.append(doc_idx[-1] + len(doc))
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", code))
        f.write(struct.pack("<Q", len(seqs)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(struct.pack(f"<{len(lengths)}i", *lengths))
        f.write(struct.pack(f"<{len(pointers)}q", *pointers))
        f.write(struct.pack(f"<{len(doc_idx)}q", *doc_idx))


def random_docs(code, seed=0, n_docs=7):
    rng = np.random.default_rng(seed)
    dtype = np.dtype(SPEC_DTYPES[code])
    docs = []
    for _ in range(n_docs):
        doc = []
        for _ in range(rng.integers(1, 4)):
            n = int(rng.integers(0, 40))
            if dtype.kind == "f":
                doc.append(rng.standard_normal(n).astype(dtype))
            else:
                info = np.iinfo(dtype)
                doc.append(rng.integers(info.min, int(info.max) + 1, n, dtype=np.int64 if dtype != np.uint64 else dtype).astype(dtype))
        docs.append(doc)
    return docs


def write_ours(prefix, docs, dtype):
    with IndexedDatasetWriter(prefix, dtype) as w:
        for doc in docs:
            for s in doc:
                w.add_item(s)
            w.end_document()


@pytest.mark.parametrize("code", sorted(SPEC_DTYPES))
def test_round_trip_and_bytes_match_spec_writer(tmp_path, code):
    docs = random_docs(code, seed=code)
    spec_write(str(tmp_path / "spec"), docs, code)
    write_ours(str(tmp_path / "ours"), docs, SPEC_DTYPES[code])
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"ours{ext}").read_bytes() == (tmp_path / f"spec{ext}").read_bytes()
    for prefix in ("spec", "ours"):
        ds = IndexedDataset(str(tmp_path / prefix))
        flat = [s for doc in docs for s in doc]
        assert ds.dtype == np.dtype(SPEC_DTYPES[code])
        assert len(ds) == len(flat) and ds.num_documents == len(docs)
        for i, s in enumerate(flat):
            np.testing.assert_array_equal(ds[i], s)
        assert list(ds.document_indices) == list(np.cumsum([0] + [len(d) for d in docs]))


def test_header_bytes_by_hand(tmp_path):
    write_ours(str(tmp_path / "x"), [[np.array([1, 2, 3])], [np.array([4])]], np.uint16)
    expected = (b"MMIDIDX\x00\x00" + (1).to_bytes(8, "little") + bytes([8]) + (2).to_bytes(8, "little")
                + (3).to_bytes(8, "little") + (3).to_bytes(4, "little") + (1).to_bytes(4, "little")
                + (0).to_bytes(8, "little") + (6).to_bytes(8, "little")
                + b"".join(i.to_bytes(8, "little") for i in (0, 1, 2)))
    assert (tmp_path / "x.idx").read_bytes() == expected
    assert (tmp_path / "x.bin").read_bytes() == bytes([1, 0, 2, 0, 3, 0, 4, 0])


def test_partial_reads_are_views_without_copy(tmp_path):
    spec_write(str(tmp_path / "d"), [[np.arange(100)], [np.arange(100, 150)]], 4)
    ds = IndexedDataset(str(tmp_path / "d"))
    np.testing.assert_array_equal(ds.get(1, 10, 5), np.arange(110, 115))
    np.testing.assert_array_equal(ds.get(0, 95), np.arange(95, 100))
    part = ds.get(0, 3, 4)
    assert not part.flags.owndata and np.shares_memory(part, ds.tokens)
    with pytest.raises(IndexError):
        ds.get(1, 45, 10)
    with pytest.raises(IndexError):
        ds[2]
    assert len(pickle.dumps(ds)) < 1000  # re-opened by path, not copied
    np.testing.assert_array_equal(pickle.loads(pickle.dumps(ds))[1], np.arange(100, 150))


def test_token_dtype_threshold_is_megatrons():
    assert token_dtype(257) == np.uint16 and token_dtype(65499) == np.uint16
    assert token_dtype(65500) == np.int32 and token_dtype(128256) == np.int32


def test_writer_refuses_ids_that_do_not_fit_and_discards_on_error(tmp_path):
    with pytest.raises(ValueError, match="do not fit"):
        with IndexedDatasetWriter(str(tmp_path / "w"), np.uint16) as w:
            w.add_document(np.array([1, 70000]))
    assert os.listdir(tmp_path) == []


def test_empty_index_reads_as_empty(tmp_path):
    write_ours(str(tmp_path / "e"), [], np.uint16)
    ds = IndexedDataset(str(tmp_path / "e"))
    assert len(ds) == 0 and ds.num_documents == 0 and ds.num_tokens == 0


@pytest.fixture
def good(tmp_path):
    prefix = str(tmp_path / "good")
    spec_write(prefix, [[np.arange(10)], [np.arange(5)]], 8)
    return prefix


def _patch(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


@pytest.mark.parametrize("case, match", [
    ("no_bin", "good.bin: file not found"),
    ("no_idx", "good.idx: file not found"),
    ("magic", "good.idx: not a Megatron index file"),
    ("version", "good.idx: index version 2"),
    ("dtype", "good.idx: unknown token dtype code 9"),
    ("idx_truncated", "good.idx: .* truncated"),
    ("header_truncated", "good.idx: truncated header"),
    ("bin_truncated", "good.bin: .* truncated"),
    ("bin_longer", "good.bin: .* does not match its index"),
    ("doc_idx", "good.idx: document boundaries"),
])
def test_bad_files_raise_data_error_naming_the_file(good, case, match):
    idx, bin_ = good + ".idx", good + ".bin"
    if case == "no_bin":
        os.remove(bin_)
    elif case == "no_idx":
        os.remove(idx)
    elif case == "magic":
        _patch(idx, 0, b"XXIDIDX")
    elif case == "version":
        _patch(idx, 9, struct.pack("<Q", 2))
    elif case == "dtype":
        _patch(idx, 17, bytes([9]))
    elif case == "idx_truncated":
        os.truncate(idx, os.path.getsize(idx) - 4)
    elif case == "header_truncated":
        os.truncate(idx, 12)
    elif case == "bin_truncated":
        os.truncate(bin_, os.path.getsize(bin_) - 2)
    elif case == "bin_longer":
        with open(bin_, "ab") as f:
            f.write(b"\0\0")
    elif case == "doc_idx":
        _patch(idx, os.path.getsize(idx) - 8, struct.pack("<q", 5))
    with pytest.raises(DataError, match=match) as err:
        IndexedDataset(good)
    assert str(err.value).startswith(good) and "\n" not in str(err.value)
