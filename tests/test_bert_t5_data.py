"""BERT and T5 sample construction against their specification, over 10k samples each.

Tolerances are binomial: a proportion p estimated from N independent draws has standard error
sqrt(p (1 - p) / N); we allow 5 standard errors (a false alarm about once in 3.5 million runs).
Counts that the specification fixes exactly (tokens masked per sample, noise tokens per T5
sample, the layout of [CLS]/[SEP], sentinel order, reconstruction of the text) are checked
exactly on every sample.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from megatron_hydra.data import preprocess as pp
from megatron_hydra.data.bert_dataset import BERT_SPECIALS, BertDataset, special_tokens, word_starts
from megatron_hydra.data.indexed import IndexedDataset
from megatron_hydra.data.t5_dataset import T5_SPECIALS, T5Dataset, noise_counts
from megatron_hydra.data.tokenizers import ByteTokenizer

N = 10_000
SE5 = lambda p, n: 5 * math.sqrt(p * (1 - p) / n)  # noqa: E731


def write_corpus(tmp_path, docs=60, seed=0) -> str:
    """Sentence-split corpus of random words (byte tokenizer), one JSON document per line."""
    rng = np.random.RandomState(seed)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]
    lines = []
    for _ in range(docs):
        sentences = [" ".join(rng.choice(words, rng.randint(2, 9))).capitalize() + "." for _ in range(rng.randint(1, 8))]
        lines.append(json.dumps({"text": " ".join(sentences)}))
    src = tmp_path / "corpus.jsonl"
    src.write_text("\n".join(lines) + "\n")
    cfg = pp.parse_args([f"input={src}", f"output_prefix={tmp_path / 'corpus'}", "split_sentences=true",
                         "append_eod=false", "progress=false"])
    return pp.preprocess(cfg)["text"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return IndexedDataset(write_corpus(tmp_path_factory.mktemp("corpus")))


def test_preprocess_writes_one_sentence_per_sequence(corpus):
    assert corpus.num_documents == 60
    assert len(corpus) > corpus.num_documents  # several sentences per document
    tok = ByteTokenizer()
    for i in range(20):
        text = tok.decode(corpus.get(i))
        assert text.endswith(".") and text.count(".") == 1 and text[0].isupper()
    assert pp.split_sentences('He said "stop." Then? Yes! ok\n\nnew') == ['He said "stop."', "Then?", "Yes!", "ok", "new"]


def _bert(corpus, **kw):
    tok = ByteTokenizer()
    ids = special_tokens(tok, BERT_SPECIALS)
    return BertDataset(corpus, np.arange(corpus.num_documents), N, 48, 7, tok, ids, **kw), ids


def test_bert_masking_statistics(corpus):
    ds, ids = _bert(corpus)
    assert len(ds) >= N
    special = [ids["[CLS]"], ids["[SEP]"], ids["[PAD]"]]
    masked = kept = replaced = total_len = total_masked = swapped = 0
    for i in range(N):
        s = {k: v.numpy() for k, v in ds[i].items()}  # the checks in numpy: cheaper on small arrays
        n = int(s["padding_mask"].sum())
        tokens, labels, mask = s["tokens"][:n], s["labels"][:n], s["loss_mask"][:n].astype(bool)
        # layout: [CLS] A [SEP] B [SEP], token types 0 then 1, padding after
        types = s["token_types"][:n]
        first_b = np.flatnonzero(types == 1)[0]
        assert tokens[0] == ids["[CLS]"] and (s["tokens"][n:] == ids["[PAD]"]).all()
        assert types[first_b] == 1 and types[first_b - 1] == 0
        # exactly round(15% of the length) masked, capped at 15% of the longest sample; never a special
        assert int(mask.sum()) == min(round(0.15 * 45), max(1, round(0.15 * n)))
        assert not np.isin(labels[mask], special).any()
        orig, now = labels[mask], tokens[mask]
        masked += int((now == ids["[MASK]"]).sum())
        kept += int((now == orig).sum())
        replaced += int(((now != orig) & (now != ids["[MASK]"])).sum())
        total_len, total_masked = total_len + n, total_masked + int(mask.sum())
        swapped += int(s["sop_labels"])
    assert total_masked / total_len == pytest.approx(0.15, abs=0.5 / (total_len / N))  # rounding per sample
    # [MASK] 80%; unchanged 10% plus the random draws that hit the original (1 / 257); random 10% less those.
    p_keep, p_rand = 0.1 + 0.1 / 257, 0.1 - 0.1 / 257
    for count, p in ((masked, 0.8), (kept, p_keep), (replaced, p_rand)):
        assert abs(count / total_masked - p) < SE5(p, total_masked)
    assert abs(swapped / N - 0.5) < SE5(0.5, N)


def test_bert_whole_word_masking_masks_whole_words(corpus):
    ds, ids = _bert(corpus, whole_word_masking=True)
    starts = word_starts(ByteTokenizer(), max(ids.values()) + 1)
    for i in range(500):
        s = ds[i]
        n = int(s["padding_mask"].sum())
        mask, labels = s["loss_mask"][:n].bool(), s["labels"][:n]
        original = torch.where(mask, labels, s["tokens"][:n])
        assert (original[mask] != ids["[SEP]"]).all()
        for j in range(1, n):  # a continuation piece is masked exactly when the piece before it is
            if not starts[int(original[j])] and original[j - 1] not in (ids["[CLS]"], ids["[SEP]"]):
                assert mask[j] == mask[j - 1]


def test_bert_samples_are_deterministic(corpus):
    a, _ = _bert(corpus)
    b, _ = _bert(corpus)
    for i in (0, 17, N - 1):
        assert all(torch.equal(a[i][k], b[i][k]) for k in a[i])


def test_t5_span_corruption_statistics(corpus):
    tok = ByteTokenizer()
    ids = special_tokens(tok, T5_SPECIALS)
    ds = T5Dataset(corpus, np.arange(corpus.num_documents), N, 64, 24, 3, ids, tok.eod, short_seq_prob=0.0)
    sentinels = [ids[f"<extra_id_{i}>"] for i in range(100)]
    is_sentinel = set(sentinels)  # membership; the list gives the order
    total_raw = total_noise = total_spans = 0
    ones, expected_ones, variance = 0, 0.0, 0.0
    for i in range(N):
        s = {k: v.numpy() for k, v in ds[i].items()}  # the checks in numpy: cheaper on small arrays
        enc = s["tokens"][: int(s["padding_mask"].sum())].tolist()
        dec = s["labels"][: int(s["loss_mask"].sum())].tolist()
        assert enc[-1] == dec[-1] == tok.eod
        assert s["decoder_tokens"][0] == ids["<pad>"] and s["decoder_tokens"][1:len(dec)].tolist() == dec[:-1]
        enc_sent = [t for t in enc if t in is_sentinel]
        dec_sent = [t for t in dec if t in is_sentinel]
        assert enc_sent == dec_sent == sentinels[:len(enc_sent)]  # in order, one per span
        # reconstruct the raw text: replace each sentinel by the span that follows it in the labels
        spans, cur = {}, None
        for t in dec[:-1]:
            if t in is_sentinel:
                cur = t
                spans[cur] = []
            else:
                spans[cur].append(t)
        raw, noise_mask = [], []
        for t in enc[:-1]:
            if t in is_sentinel:
                assert spans[t], "empty span"
                raw += spans[t]
                noise_mask += [1] * len(spans[t])
            else:
                raw.append(t)
                noise_mask.append(0)
        noise, nspans = noise_counts(len(raw), 0.15, 3.0)
        assert sum(noise_mask) == noise and len(enc_sent) == nspans
        assert noise_mask[0] == 0 and noise_mask[-1] == 1  # runs alternate, kept first, noise last
        assert len(enc) <= 64 and len(dec) <= 24
        total_raw, total_noise, total_spans = total_raw + len(raw), total_noise + noise, total_spans + nspans
        # The noise tokens are cut into nspans non-empty spans uniformly over compositions, under
        # which a span has length 1 with probability (nspans - 1) / (noise - 1).
        p1 = (nspans - 1) / (noise - 1) if nspans > 1 else float(noise == 1)
        ones += sum(len(v) == 1 for v in spans.values())
        expected_ones += nspans * p1
        variance += nspans * p1 * (1 - p1)
    assert total_noise / total_raw == pytest.approx(0.15, abs=0.5 / (total_raw / N))
    assert total_noise / total_spans == pytest.approx(3.0, abs=0.5 * 3 / 2)  # spans rounded per sample
    assert abs(ones - expected_ones) < 5 * math.sqrt(variance)


def test_wordpiece_specials_and_word_starts_come_from_the_vocabulary(tmp_path):
    from tokenizers import Tokenizer as HF, models, pre_tokenizers

    from megatron_hydra.data.tokenizers import HFTokenizer

    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "play", "##ing", "##ed", "go"])}
    tok = HF(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["[SEP]"])
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = HFTokenizer(str(tmp_path / "tokenizer.json"))
    ids = special_tokens(hf, BERT_SPECIALS)
    assert ids == {"[CLS]": 2, "[SEP]": 3, "[MASK]": 4, "[PAD]": 0}  # nothing appended
    assert word_starts(hf, 9).tolist() == [True] * 6 + [False, False, True]
    assert hf.encode("playing go") == [5, 6, 8]
    # and the byte tokenizer appends all four after its 257 ids
    assert special_tokens(ByteTokenizer(), BERT_SPECIALS) == {"[CLS]": 257, "[SEP]": 258, "[MASK]": 259, "[PAD]": 260}


@pytest.mark.parametrize("arch,need", [("bert", 261), ("t5", 358)])
def test_vocab_too_small_for_appended_specials_is_one_line_data_error(arch, need):
    from conftest import compose_config
    from megatron_hydra.config import derive
    from megatron_hydra.data.arch_datasets import dataset_factory
    from megatron_hydra.errors import DataError

    cfg = compose_config([f"model={arch}_base", f"data=indexed_{arch}", "data.tokenizer.type=byte",
                          f"model.vocab_size={need - 1}"])
    with pytest.raises(DataError, match=f"model.vocab_size >= {need}"):
        dataset_factory(cfg.data, derive(cfg).transformer, 0)
    cfg.model.vocab_size = need
    assert dataset_factory(cfg.data, derive(cfg).transformer, 0) is not None
