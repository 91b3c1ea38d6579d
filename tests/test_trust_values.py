"""Values that used to be accepted and then trained wrongly or failed late, and data lines that
used to end in a traceback: each is now one line naming the key or the file, before any worker."""

from __future__ import annotations

import json
import os
import pickle
import threading

import numpy as np
import pytest

from conftest import SMALL, compose_config, launch_py
from megatron_hydra.config import derive
from megatron_hydra.config.schema import DataConfig, TokenizerConfig
from megatron_hydra.data import token_range
from megatron_hydra.data.builders import build_datasets, check_vocab
from megatron_hydra.data.indexed import IndexedDataset, IndexedDatasetWriter
from megatron_hydra.data.preprocess import PreprocessConfig, preprocess
from megatron_hydra.data.sft_dataset import read_conversations
from megatron_hydra.errors import ConfigError, DataError

MODEL = [o for o in SMALL if not o.startswith(("data=", "model.vocab_size="))]


def _one_line(info) -> str:
    message = str(info.value)
    assert "\n" not in message
    return message


# Config values ------------------------------------------------------------------------------------

@pytest.mark.parametrize("override", [
    "optim.clip_grad=nan", "optim.lr=nan", "optim.lr=inf", "optim.min_lr=nan", "model.norm_eps=nan",
    "precision.initial_loss_scale=inf", "trainer.peak_tflops=inf", "model.rope_theta=-inf",
    "data.blend=[nan,corpus]",
])
def test_non_finite_floats_are_refused_naming_the_key(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError) as info:
        derive(compose_config([override]))
    message = _one_line(info)
    assert message.startswith(key) and "finite" in message


def test_non_finite_float_inside_a_nested_node_is_named():
    with pytest.raises(ConfigError) as info:
        derive(compose_config(["model=moe_tiny", "model.moe.capacity_factor=inf"]))
    assert _one_line(info).startswith("model.moe.capacity_factor=inf")


def _numpy_takes(seed: int) -> bool:
    try:
        np.random.RandomState(seed)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("key", ["seed", "data.seed"])
def test_seeds_outside_numpys_range_are_refused(key):
    # The range comes from numpy itself, not from the code under test.
    for seed in (-1, 2**32):
        assert not _numpy_takes(seed)
        with pytest.raises(ConfigError) as info:
            derive(compose_config([f"{key}={seed}"]))
        assert _one_line(info).startswith(f"{key}={seed}")
    for seed in (0, 2**32 - 1):
        assert _numpy_takes(seed)
        derive(compose_config([f"{key}={seed}"]))


def test_run_seed_leaves_room_for_every_pipeline_stage():
    # Stage k seeds with seed + 100 k (parallel.random.stage_seed): the last stage must fit too.
    pp2 = ["trainer.devices=2", "parallel=pp2"]
    assert _numpy_takes(2**32 - 1 - 100) and not _numpy_takes(2**32 - 1 + 100)
    derive(compose_config([*pp2, f"seed={2**32 - 1 - 100}"]))
    with pytest.raises(ConfigError, match=r"^seed=4294967295 "):
        derive(compose_config([*pp2, f"seed={2**32 - 1}"]))


@pytest.mark.parametrize("override", ["optim.adam_beta1=1.0", "optim.adam_beta2=-0.1", "optim.adam_eps=0",
                                      "optim.weight_decay=-0.1", "model.rope_theta=0"])
def test_out_of_range_optimizer_and_model_values_are_refused(override):
    with pytest.raises(ConfigError) as info:
        derive(compose_config([override]))
    assert _one_line(info).startswith(override)


@pytest.mark.parametrize("override", ["optim.clip_grad=nan", "seed=-1"])
def test_launch_refuses_before_any_worker_starts(tmp_path, env_no_launcher, capfd, override):
    code = launch_py([*SMALL, override, f"hydra.run.dir={tmp_path}"], env_no_launcher)
    err = capfd.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert override in [line for line in err.splitlines() if line.strip()][-1]
    assert not (tmp_path / "workers").exists() and not list(tmp_path.glob("rank*.error"))


# Token ids ----------------------------------------------------------------------------------------

VOCAB = 1000
BAD_ID = 5000


def _corpus(prefix, sequences):
    with IndexedDatasetWriter(str(prefix), np.uint16) as w:
        for tokens in sequences:
            w.add_document(tokens)
    return str(prefix)


def _big_corpus_with_one_bad_token(prefix):
    """More than 2**24 tokens (above which the old check read only the first 65536 tokens of 1024
    sequences), and one id past the vocabulary in the middle of the first, long, sequence."""
    long = np.zeros(2**24, np.uint16)
    long[10_000_000] = BAD_ID
    return _corpus(prefix, [long, np.arange(100, dtype=np.uint16)])


def test_every_token_of_a_large_corpus_is_checked(tmp_path):
    prefix = _big_corpus_with_one_bad_token(tmp_path / "big")
    with pytest.raises(DataError) as info:
        build_datasets(DataConfig(name="indexed", blend=[prefix]), seq_length=16, seed=1, num_samples=(10, 0, 0),
                       vocab_size=VOCAB)
    assert _one_line(info) == (f"{prefix}.bin: token id {BAD_ID} >= the model's vocabulary size {VOCAB}; set "
                               f"model.vocab_size > {BAD_ID} or re-tokenize with a smaller vocabulary")


def test_large_corpus_with_a_bad_token_fails_before_any_worker(tmp_path, env_no_launcher, capfd):
    prefix = _big_corpus_with_one_bad_token(tmp_path / "big")
    code = launch_py([*MODEL, "data=indexed", f"data.blend=[{prefix}]", f"model.vocab_size={VOCAB}",
                      f"hydra.run.dir={tmp_path / 'run'}"], env_no_launcher)
    err = capfd.readouterr().err
    assert code == 2 and "Traceback" not in err and f"token id {BAD_ID} >=" in err
    assert not list((tmp_path / "run").glob("rank*.error"))


def test_token_range_is_scanned_once_per_file(tmp_path, monkeypatch):
    scans = []
    real_scan = token_range.scan
    monkeypatch.setattr(token_range, "scan", lambda tokens: scans.append(len(tokens)) or real_scan(tokens))
    prefix = _corpus(tmp_path / "c", [np.arange(50, dtype=np.uint16), np.arange(30, dtype=np.uint16)])
    cache = str(tmp_path / "cache")
    check_vocab(IndexedDataset(prefix), VOCAB, cache)
    check_vocab(IndexedDataset(prefix), VOCAB, cache)
    assert scans == [80]
    # The same file rewritten (same size, a bad id): the cached range no longer describes it.
    _corpus(tmp_path / "c", [np.arange(50, dtype=np.uint16), np.full(30, BAD_ID, np.uint16)])
    os.utime(prefix + ".bin", ns=(0, 0))
    with pytest.raises(DataError, match=f"token id {BAD_ID} >="):
        check_vocab(IndexedDataset(prefix), VOCAB, cache)
    assert scans == [80, 80]


def test_crafted_token_range_cache_is_ignored_without_hanging(tmp_path):
    prefix = _corpus(tmp_path / "c", [np.full(10, BAD_ID, np.uint16)])
    cache = tmp_path / "cache"
    cache.mkdir()
    ds = IndexedDataset(prefix)
    path = token_range._cache_path(ds, str(cache))
    os.mkfifo(path)  # opening a FIFO for reading blocks until a writer comes: never, here
    outcome = []

    def check():
        try:
            check_vocab(ds, VOCAB, str(cache))
        except DataError as e:
            outcome.append(str(e))

    thread = threading.Thread(target=check, daemon=True)
    thread.start()
    thread.join(20)
    assert not thread.is_alive(), "the check hung on a FIFO in the cache"
    assert outcome and f"token id {BAD_ID} >=" in outcome[0]
    # A cache claiming a smaller range for another file is not taken for this one.
    os.remove(path)
    with open(path, "w") as f:
        json.dump({"bin": "/elsewhere.bin", "size": 20, "mtime_ns": 0, "inode": 0, "dtype": "<u2",
                   "min": 0, "max": 0}, f)
    with pytest.raises(DataError, match=f"token id {BAD_ID} >="):
        check_vocab(IndexedDataset(prefix), VOCAB, str(cache))


def test_token_changed_after_the_check_is_one_line_mid_run(tmp_path):
    prefix = _corpus(tmp_path / "c", [np.arange(i, i + 40, dtype=np.uint16) for i in range(20)])
    train, _, _ = build_datasets(DataConfig(name="indexed", blend=[prefix], split="100,0,0"), seq_length=16,
                                 seed=1, num_samples=(20, 0, 0), vocab_size=VOCAB)
    train[0]
    with open(prefix + ".bin", "r+b") as f:  # the file changes under the running job
        f.seek(2 * 400)
        f.write(np.uint16(BAD_ID).tobytes())
    for dataset in (train, pickle.loads(pickle.dumps(train))):  # a DataLoader worker gets a pickled copy
        with pytest.raises(DataError) as info:
            for i in range(len(dataset)):
                dataset[i]
        message = _one_line(info)
        assert message.startswith(f"{prefix}.bin: sequence 10 holds token id {BAD_ID} >= ")


# Input lines of preprocess and data=sft -----------------------------------------------------------

DEEP = '{"text": "deep", "meta": ' + "[" * 100_000 + "]" * 100_000 + "}"
SURROGATE = '{"text": "a lone \\ud800 surrogate"}'


def _preprocess(tmp_path, lines, **kw):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n")
    cfg = PreprocessConfig(input=str(src), output_prefix=str(tmp_path / "out"), progress=False, **kw)
    return str(src), preprocess(cfg)


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])  # bpe: the lines are read first to train it
@pytest.mark.parametrize("line, why", [(DEEP, "nested deeper than"), (SURROGATE, "lone surrogate")],
                         ids=["deep", "surrogate"])
def test_hostile_jsonl_line_is_one_line_naming_file_and_line(tmp_path, tokenizer, line, why):
    tok = TokenizerConfig(type=tokenizer, vocab_size=300 if tokenizer == "bpe" else None)
    with pytest.raises(DataError) as info:
        _preprocess(tmp_path, ['{"text": "fine"}', line], tokenizer=tok)
    message = _one_line(info)
    assert message.startswith(f"{tmp_path / 'in.jsonl'}:2: ") and why in message


def test_hostile_jsonl_lines_are_skipped_on_request(tmp_path):
    _, prefixes = _preprocess(tmp_path, [DEEP, '{"text": "ab"}', SURROGATE], on_bad_line="skip")
    ds = IndexedDataset(prefixes["text"])
    assert [ds[i].tolist() for i in range(len(ds))] == [[ord("a"), ord("b"), 256]]  # byte ids, then EOD


@pytest.mark.parametrize("line, why", [(DEEP.replace('"text": "deep"', '"prompt": "p", "response": "r"'),
                                        "nested deeper than"),
                                       ('{"prompt": "p\\udfff", "response": "r"}', "lone surrogate")],
                         ids=["deep", "surrogate"])
def test_hostile_sft_line_is_one_line_naming_file_and_line(tmp_path, line, why):
    path = tmp_path / "chat.jsonl"
    path.write_text('{"prompt": "p", "response": "r"}\n' + line + "\n")
    with pytest.raises(DataError) as info:
        read_conversations(str(path))
    message = _one_line(info)
    assert message.startswith(f"{path}:2: ") and why in message


def test_deep_gpt2_vocab_is_one_line(tmp_path):
    from megatron_hydra.data.tokenizers import build_tokenizer

    (tmp_path / "vocab.json").write_text("[" * 100_000 + "]" * 100_000)
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    with pytest.raises(DataError) as info:
        build_tokenizer(TokenizerConfig(type="gpt2_bpe", path=str(tmp_path)))
    assert _one_line(info).startswith(str(tmp_path / "vocab.json"))


def test_our_error_raised_in_a_dataloader_worker_is_still_one_line(tmp_path):
    """torch re-raises a DataLoader worker's exception with the worker's traceback as its message;
    the launcher and rank<N>.error still show our one line."""
    import sys

    from torch._utils import ExceptionWrapper

    from megatron_hydra.errors import one_line
    from megatron_hydra.training.worker import write_error_file

    try:
        raise DataError("data/x.bin: sequence 3 holds token id 9 >= the model's vocabulary size 8")
    except DataError:
        wrapped = ExceptionWrapper(sys.exc_info(), where="in DataLoader worker process 0")
    with pytest.raises(DataError) as err:
        wrapped.reraise()
    assert len(str(err.value).splitlines()) > 3  # what torch hands over
    line = "data/x.bin: sequence 3 holds token id 9 >= the model's vocabulary size 8"
    assert one_line(err.value) == line
    assert write_error_file(str(tmp_path), 0, err.value) == line
    assert (tmp_path / "rank0.error").read_text().splitlines()[0] == line
