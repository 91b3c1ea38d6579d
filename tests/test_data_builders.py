"""build_datasets / build_tokenizer_for: splits, blends, the demo corpus, and errors for people."""

import multiprocessing
import os

import numpy as np
import pytest

from megatron_hydra.config.schema import DataConfig, TokenizerConfig
from megatron_hydra.data import demo
from megatron_hydra.data.blending import BlendedDataset, deviation_bound
from megatron_hydra.data.builders import build_datasets, build_tokenizer_for, parse_blend, parse_split
from megatron_hydra.data.indexed import IndexedDatasetWriter
from megatron_hydra.errors import ConfigError, DataError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STRIDE = 1000  # token = doc * STRIDE + position (+ an offset per corpus)


def make_corpus(prefix, n_docs, base=0, dtype=np.int32):
    rng = np.random.default_rng(n_docs + base)
    with IndexedDatasetWriter(str(prefix), dtype) as w:
        for d in range(n_docs):
            w.add_document(base + d * STRIDE + np.arange(int(rng.integers(5, 80))))
    return str(prefix)


def cfg(**kw):
    return DataConfig(name="indexed", **kw)


def seen_docs(ds):
    return {int(t) // STRIDE for i in range(len(ds)) for t in ds[i]["tokens"].tolist()}


def test_splits_are_disjoint_and_cover_the_corpus(tmp_path):
    prefix = make_corpus(tmp_path / "c", 200)
    train, valid, test = build_datasets(cfg(blend=[prefix], split="80,15,5"), seq_length=16, seed=1,
                                        num_samples=(50, 10, 5), vocab_size=10**6)
    assert len(train) >= 50 and len(valid) >= 10 and len(test) >= 5
    docs = [seen_docs(ds) for ds in (train, valid, test)]
    assert docs[0] == set(range(160)) and docs[1] == set(range(160, 190)) and docs[2] == set(range(190, 200))


def test_empty_splits_are_none_and_an_empty_train_split_an_error(tmp_path):
    prefix = make_corpus(tmp_path / "c", 50)
    train, valid, test = build_datasets(cfg(blend=[prefix], split="969,30,1"), seq_length=8, seed=1,
                                        num_samples=(10, 10, 10), vocab_size=10**6)
    assert train is not None and valid is not None and test is None  # 1/1000 of 50 documents
    _, valid, _ = build_datasets(cfg(blend=[prefix]), seq_length=8, seed=1, num_samples=(10, 0, 0), vocab_size=10**6)
    assert valid is None
    with pytest.raises(DataError, match="train split is empty"):
        build_datasets(cfg(blend=[prefix], split="0,1,0"), seq_length=8, seed=1, num_samples=(10, 1, 1),
                       vocab_size=10**6)


def test_blend_of_two_corpora_has_the_weights_proportions(tmp_path):
    a = make_corpus(tmp_path / "a", 100)
    b = make_corpus(tmp_path / "b", 100, base=500_000)
    train, _, _ = build_datasets(cfg(blend=[0.25, a, 0.75, b], split="1"), seq_length=8, seed=3,
                                 num_samples=(400, 0, 0), vocab_size=10**6)
    assert isinstance(train, BlendedDataset) and len(train) == 400
    from_b = np.cumsum([train[i]["tokens"][0].item() >= 500_000 for i in range(400)])
    bound = deviation_bound([0.25, 0.75])[1]
    assert np.all(np.abs(from_b - 0.75 * np.arange(1, 401)) <= bound + 1e-9)


def test_tokens_beyond_the_vocabulary(tmp_path):
    prefix = make_corpus(tmp_path / "c", 20)
    with pytest.raises(DataError, match=r"c\.bin: token id \d+ >= the model's vocabulary size 1000"):
        build_datasets(cfg(blend=[prefix]), seq_length=8, seed=1, num_samples=(10, 0, 0), vocab_size=1000)


def test_empty_and_missing_corpora(tmp_path):
    with IndexedDatasetWriter(str(tmp_path / "empty"), np.uint16):
        pass
    with pytest.raises(DataError, match="empty.bin: no tokens: the corpus is empty"):
        build_datasets(cfg(blend=[str(tmp_path / "empty")]), seq_length=8, seed=1, num_samples=(1, 0, 0),
                       vocab_size=100)
    with pytest.raises(DataError, match="nothere.idx: file not found"):
        build_datasets(cfg(blend=[str(tmp_path / "nothere")]), seq_length=8, seed=1, num_samples=(1, 0, 0),
                       vocab_size=100)


@pytest.mark.parametrize("blend", [None, [], ["a", "b"], [0.5, "a", 0.5], [-1, "a"], ["x", "a"], [1, 2],
                                   [0.5, "a", 0, "b"], [True, "a"]])
def test_malformed_blends(blend):
    with pytest.raises(DataError, match="data.blend"):
        parse_blend(blend)


def test_blend_and_split_parsing():
    assert parse_blend(["/d/x.bin"]) == [(1.0, "/d/x")]
    assert [w for w, _ in parse_blend([1, "/a", 3, "/b"])] == [0.25, 0.75]
    assert parse_split("969,30,1") == [0.969, 0.03, 0.001] and parse_split("98/2") == [0.98, 0.02, 0.0]
    for bad in ("", "a,b", "-1,2", "0,0,0", "1,1,1,1"):
        with pytest.raises(ConfigError, match="data.split"):
            parse_split(bad)


def _stdlib_texts():
    texts = []
    for _, path, _ in demo.source_files():
        try:
            with open(path, encoding="utf-8") as f:
                texts.append(f.read())
        except UnicodeDecodeError:
            pass
    return texts


def test_demo_corpus_is_stdlib_text_built_once(tmp_path):
    sources = [t.encode() for t in _stdlib_texts()]
    data = DataConfig(name="demo", cache_dir=str(tmp_path), tokenizer=TokenizerConfig(type="byte"))
    train, valid, _ = build_datasets(data, seq_length=64, seed=0, num_samples=(20, 4, 0), vocab_size=257)
    assert len(train) >= 20 and valid is not None
    for i in range(0, len(train), max(1, len(train) // 20)):
        tokens = train[i]["tokens"].numpy()
        for piece in np.split(tokens, np.where(tokens == 256)[0]):
            piece = bytes(int(t) for t in piece if t != 256)
            assert any(piece in s for s in sources)
    corpora = [d for d in os.listdir(tmp_path) if not d.endswith(".lock")]
    assert len(corpora) == 1
    stamp = os.path.getmtime(tmp_path / corpora[0] / "demo_text_document.bin")
    assert build_tokenizer_for(data).decode([104, 105]) == "hi"
    assert os.path.getmtime(tmp_path / corpora[0] / "demo_text_document.bin") == stamp


def test_demo_bpe_tokenizer_decodes_samples_to_stdlib_text(tmp_path):
    data = DataConfig(name="demo", cache_dir=str(tmp_path), tokenizer=TokenizerConfig(type="bpe", vocab_size=512))
    train, _, _ = build_datasets(data, seq_length=128, seed=0, num_samples=(8, 0, 0), vocab_size=512)
    tok = build_tokenizer_for(data)
    sources = _stdlib_texts()
    for i in range(4):
        for piece in tok.decode(train[i]["tokens"].tolist()).split("<|endoftext|>"):
            assert any(piece in s for s in sources)


def _build_demo(cache_dir):
    return demo.build_demo_corpus(TokenizerConfig(type="byte"), cache_dir, max_bytes=200_000)[0]


def test_concurrent_demo_builds_produce_one_corpus(tmp_path):
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        a, b = pool.map(_build_demo, [str(tmp_path)] * 2)
    assert a == b
    assert sorted(os.listdir(tmp_path))[0].startswith("byte-") and not [d for d in os.listdir(tmp_path) if ".tmp" in d]


def test_group_files_compose_into_the_schema():
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from megatron_hydra.config.schema import register_configs

    register_configs()
    with initialize_config_dir(config_dir=os.path.join(ROOT, "conf"), version_base="1.3"):
        d = OmegaConf.to_object(compose("config", overrides=["data=demo"]).data)
        assert d.name == "demo" and d.tokenizer.type == "bpe" and d.tokenizer.vocab_size == 8192
        d = OmegaConf.to_object(compose("config", overrides=["data=indexed", "data.blend=[0.3,a,0.7,b]"]).data)
        assert d.name == "indexed" and parse_blend(d.blend)[1][0] == 0.7
