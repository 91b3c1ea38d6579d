"""GPT samples checked against what the corpus itself says, not against stored outputs.

Every token of the test corpora is unique: it encodes (document, position in document), so each
sample can be decoded back to where its tokens came from.
"""

import collections
import os
import pickle

import numpy as np
import pytest
import torch

from conftest import spawn_ranks
from megatron_hydra.data import gpt_dataset
from megatron_hydra.data.gpt_dataset import GPTDataset
from megatron_hydra.data.indexed import IndexedDataset, IndexedDatasetWriter

STRIDE = 10_000  # token = doc * STRIDE + position


def make_corpus(path, lengths, pieces=1):
    """Documents of the given lengths; each split into up to ``pieces`` sequences."""
    rng = np.random.default_rng(len(lengths))
    with IndexedDatasetWriter(str(path), np.int32) as w:
        for d, n in enumerate(lengths):
            doc = d * STRIDE + np.arange(n)
            cuts = np.sort(rng.choice(np.arange(1, n), size=min(pieces - 1, n - 1), replace=False)) if n > 1 else []
            for part in np.split(doc, cuts):
                w.add_item(part)
            w.end_document()
    return IndexedDataset(str(path))


def lengths_for(n_docs, seed=0):
    return list(np.random.default_rng(seed).integers(1, 60, n_docs))


def check_contiguous(seq, lengths):
    """Each next token follows in the same document, or a document ended and another began."""
    for a, b in zip(seq[:-1], seq[1:]):
        da, pa, db, pb = a // STRIDE, a % STRIDE, b // STRIDE, b % STRIDE
        assert (da == db and pb == pa + 1) or (pa == lengths[da] - 1 and pb == 0), (a, b)


@pytest.mark.parametrize("pieces", [1, 3])
def test_each_epoch_covers_the_split_once(tmp_path, pieces):
    lengths = lengths_for(40)
    ds_file = make_corpus(tmp_path / "c", lengths, pieces)
    docs = np.arange(5, 35)  # a split: documents 5..34
    seq = 16
    T = sum(lengths[d] for d in docs)
    ds = GPTDataset(ds_file, docs, num_samples=3 * T // seq, seq_length=seq, seed=7, cache_dir=str(tmp_path / "k"))
    bounds = [-(-e * T // seq) for e in range(4)]  # samples starting in epoch e
    assert len(ds) == bounds[-1] >= 3 * T // seq
    split_tokens = {d * STRIDE + p for d in docs for p in range(lengths[d])}
    counts = collections.Counter()
    for e in range(3):
        for i in range(bounds[e], bounds[e + 1]):
            item = ds[i]
            toks = ds.sample_tokens(i)
            assert item["tokens"].dtype == torch.int64 and item["tokens"].shape == (seq,)
            assert torch.equal(item["tokens"], torch.from_numpy(toks[:-1]))
            assert torch.equal(item["labels"], torch.from_numpy(toks[1:]))
            assert torch.equal(item["loss_mask"], torch.ones(seq))
            check_contiguous(toks, lengths)
            counts.update(toks[:-1].tolist())
        # After e + 1 epochs' samples every split token was an input e + 1 times, except the few
        # tokens of the next epoch that the last sample reached into.
        assert set(counts) == split_tokens
        assert all(e + 1 <= c <= e + 2 for c in counts.values())
        spill = sum(c - (e + 1) for c in counts.values())
        assert spill == bounds[e + 1] * seq - (e + 1) * T and 0 <= spill < seq


def test_epochs_are_shuffled_differently(tmp_path):
    lengths = [20] * 50
    ds = GPTDataset(make_corpus(tmp_path / "c", lengths), np.arange(50), 200, 19, 3, str(tmp_path / "k"))
    per_epoch = 1000 // 19 + 1
    first = [ds.sample_tokens(i)[0] // STRIDE for i in range(10)]
    second = [ds.sample_tokens(per_epoch + i)[0] // STRIDE for i in range(10)]
    assert first != second and first != sorted(first)


def test_identical_across_builds_and_a_pure_function_of_the_index(tmp_path):
    corpus = make_corpus(tmp_path / "c", lengths_for(30, seed=1))
    a = GPTDataset(corpus, np.arange(30), 100, 32, 11, str(tmp_path / "a"))
    b = GPTDataset(IndexedDataset(str(tmp_path / "c")), np.arange(30), 100, 32, 11, str(tmp_path / "b"))
    assert len(a) == len(b)
    for i in range(len(a)):
        np.testing.assert_array_equal(a.sample_tokens(i), b.sample_tokens(i))
    # Resuming at consumed_samples=k: a fresh object (cache reused) serves the same next samples.
    resumed = GPTDataset(IndexedDataset(str(tmp_path / "c")), np.arange(30), 100, 32, 11, str(tmp_path / "a"))
    for k in (0, 37, len(a) - 5):
        for i in range(k, k + 5):
            np.testing.assert_array_equal(resumed.sample_tokens(i), a.sample_tokens(i))
    # Asking for more samples (more epochs) extends the stream and keeps its beginning.
    longer = GPTDataset(corpus, np.arange(30), 10 * len(a), 32, 11, str(tmp_path / "a"))
    assert longer.num_epochs > a.num_epochs
    for i in range(len(a)):
        np.testing.assert_array_equal(longer.sample_tokens(i), a.sample_tokens(i))
    other_seed = GPTDataset(corpus, np.arange(30), 100, 32, 12, str(tmp_path / "a"))
    assert any(not np.array_equal(other_seed.sample_tokens(i), a.sample_tokens(i)) for i in range(5))


def test_indices_are_cached_and_reused(tmp_path, monkeypatch):
    corpus = make_corpus(tmp_path / "c", lengths_for(10))
    GPTDataset(corpus, np.arange(10), 50, 8, 1, str(tmp_path / "k"))
    assert len([f for f in os.listdir(tmp_path / "k") if f.endswith(".npy")]) == 3

    def fail(*a, **k):
        raise AssertionError("rebuilt although cached")
    monkeypatch.setattr(gpt_dataset, "build_indices", fail)
    GPTDataset(corpus, np.arange(10), 50, 8, 1, str(tmp_path / "k"))


def test_documents_shorter_than_a_sample_and_few_tokens(tmp_path):
    """An epoch of 7 tokens and samples of 40: many epochs per sample, still contiguous."""
    lengths = [3, 4]
    ds = GPTDataset(make_corpus(tmp_path / "c", lengths), np.arange(2), 5, 40, 0, str(tmp_path / "k"))
    assert len(ds) >= 5
    for i in range(len(ds)):
        check_contiguous(ds.sample_tokens(i), lengths)


def test_dataloader_workers_and_pickling(tmp_path):
    corpus = make_corpus(tmp_path / "c", lengths_for(20))
    ds = GPTDataset(corpus, np.arange(20), 64, 16, 5, str(tmp_path / "k"))
    assert len(pickle.dumps(ds)) < 5000  # paths, not arrays
    clone = pickle.loads(pickle.dumps(ds))
    np.testing.assert_array_equal(clone.sample_tokens(3), ds.sample_tokens(3))
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2)
    for b, batch in enumerate(loader):
        for j in range(len(batch["tokens"])):
            assert torch.equal(batch["tokens"][j], ds[b * 4 + j]["tokens"])


def _rank_build(rank, world, corpus, cache):
    ds = GPTDataset(IndexedDataset(corpus), np.arange(20), 64, 16, 5, cache)
    return np.stack([ds.sample_tokens(i) for i in range(len(ds))])


def test_two_ranks_build_once_and_agree(tmp_path):
    make_corpus(tmp_path / "c", lengths_for(20))
    results = spawn_ranks(_rank_build, 2, str(tmp_path / "c"), str(tmp_path / "k"))
    out = str(tmp_path / "rank")
    for rank, samples in results.items():
        np.save(f"{out}{rank}.npy", samples)
    np.testing.assert_array_equal(np.load(out + "0.npy"), np.load(out + "1.npy"))
    assert not [f for f in os.listdir(tmp_path / "k") if ".tmp" in f]
    assert len([f for f in os.listdir(tmp_path / "k") if f.endswith(".npy")]) == 3  # doc, sample, shuffle index
    single = GPTDataset(IndexedDataset(str(tmp_path / "c")), np.arange(20), 64, 16, 5, str(tmp_path / "k2"))
    np.testing.assert_array_equal(np.load(out + "0.npy"), np.stack([single.sample_tokens(i) for i in range(len(single))]))
