"""Preference pairs (``data=preference``): what each sequence holds, checked against ids written
out by hand (the byte tokenizer's bytes, a word-level vocabulary), pairs packed whole, the
truncation rule, item ``k`` the same in every instance, and one-line errors for bad rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import compose_config
from megatron_hydra.data.builders import build_datasets
from megatron_hydra.data.preference_dataset import pair_positions, read_pairs
from megatron_hydra.data.sequence_shards import ShardingCollate
from megatron_hydra.data.sft_dataset import SFTDataset, SFTSamples
from megatron_hydra.errors import ConfigError, DataError
from test_sft_data import _word_tokenizer, _write_jsonl

EOD = 256  # the byte tokenizer's end of document
FIELDS = ("tokens", "labels", "loss_mask", "position_ids", "document_ids")


def _b(text: str):
    return list(text.encode())


def _turn(role: str, content: str, learned: bool):
    """(ids, flags) of one message under the default template: ``<|role|>\\n`` content EOD."""
    return [(_b(f"<|{role}|>\n"), 0), (_b(content) + [EOD], int(learned))]


def _flat(parts):
    return [i for ids, _ in parts for i in ids], [f for ids, f in parts for _ in ids]


def _datasets(path, seq_length, num_samples=(1, 0, 0), split="[1,0,0]", seed=3, packing=True):
    cfg = compose_config(["data=preference", f"data.path={path}", "data.tokenizer.type=byte",
                          f"data.split={split}", f"data.packing={str(packing).lower()}"])
    return build_datasets(cfg.data, seq_length=seq_length, seed=seed, num_samples=num_samples, vocab_size=300)


def _item(ds, k):
    return {key: v.numpy() for key, v in ds[k].items()}


# Rendering and the layout of a sequence ------------------------------------------------------------
PAIRS = [
    {"system": "S", "prompt": "2+2", "chosen": "4", "rejected": "5"},
    # A multi-turn history in the prompt (its assistant turn is not learned) and a two-turn answer.
    {"prompt": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "q"}],
     "chosen": [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"},
                {"role": "assistant", "content": "k"}],
     "rejected": "no"},
]


def _expected():
    """Per pair, (ids, flags) of its chosen and rejected documents, written out by hand."""
    first = _turn("system", "S", 0) + _turn("user", "2+2", 0)
    history = _turn("user", "hi", 0) + _turn("assistant", "yo", 0) + _turn("user", "q", 0)
    return [(_flat(first + _turn("assistant", "4", 1)), _flat(first + _turn("assistant", "5", 1))),
            (_flat(history + _turn("assistant", "ok", 1) + _turn("user", "more", 0) + _turn("assistant", "k", 1)),
             _flat(history + _turn("assistant", "no", 1)))]


def test_pairs_render_as_prompt_plus_answer_with_loss_on_the_answer_alone(tmp_path):
    train, valid, _ = _datasets(_write_jsonl(tmp_path / "pairs.jsonl", PAIRS), seq_length=256)
    assert valid is None and len(train) == 1  # both pairs fit one sequence
    item, members, expected = _item(train, 0), train.pack(0).tolist(), _expected()
    assert sorted(members) == [0, 1]
    at = 0
    for j, pair in enumerate(members):
        for side, (ids, flags) in enumerate(expected[pair]):
            doc = np.flatnonzero(item["document_ids"] == 2 * j + side)
            assert doc.tolist() == list(range(at, at + len(ids) - 1))  # chosen, then rejected, back to back
            assert item["tokens"][doc].tolist() == ids[:-1] and item["labels"][doc].tolist() == ids[1:]
            assert item["loss_mask"][doc].tolist() == flags[1:]
            assert item["position_ids"][doc].tolist() == list(range(len(doc)))
            at += len(doc)
    pad = np.arange(at, 256)
    assert (item["document_ids"][pad] == 4).all() and not item["loss_mask"][pad].any()
    assert item["position_ids"][pad].tolist() == list(range(len(pad)))
    assert int(item["loss_mask"].sum()) == 2 + 2 + (3 + 2) + 3  # 4<eod>, 5<eod>, ok<eod> k<eod>, no<eod>


def test_chat_template_learns_the_answer_not_the_prompts_history(tmp_path):
    """Ids of test_sft_data's word-level vocabulary: 2 <|im_start|>, 3 <|im_end|>, 5 user,
    6 assistant, 9 hi, 10 hello, 11 bye, 12 2+2, 13 4."""
    tokenizer = tmp_path / "tok"
    _word_tokenizer(tokenizer)
    path = _write_jsonl(tmp_path / "pairs.jsonl", [
        {"prompt": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                    {"role": "user", "content": "2+2"}], "chosen": "4", "rejected": "bye"}])
    cfg = compose_config(["data=preference", f"data.path={path}", f"data.tokenizer.path={tokenizer / 'tokenizer.json'}",
                          "data.split=[1,0,0]"])
    train, _, _ = build_datasets(cfg.data, seq_length=40, seed=0, num_samples=(1, 0, 0), vocab_size=64)
    item = _item(train, 0)
    prompt = [2, 5, 9, 3, 2, 6, 10, 3, 2, 5, 12, 3, 2, 6]
    for doc, answer in enumerate((13, 11)):
        ids, at = prompt + [answer, 3], np.flatnonzero(item["document_ids"] == doc)
        assert item["tokens"][at].tolist() == ids[:-1] and item["labels"][at].tolist() == ids[1:]
        assert item["loss_mask"][at].tolist() == [0] * 13 + [1, 1]  # the answer and its <|im_end|>


# Packing ---------------------------------------------------------------------------------------------
def _random_pairs(count: int, seq: int) -> SFTSamples:
    """Pairs of random documents, as cut: chosen + rejected positions <= ``seq``."""
    rng = np.random.RandomState(0)
    ids, learned, lengths = [], [], []
    for _ in range(count):
        total = int(rng.randint(4, seq + 1))
        c = int(rng.randint(2, total - 1))
        for n in (c, total - c):  # positions; a document has one id more
            ids.append(rng.randint(0, 1000, n + 1))
            learned.append(np.r_[rng.rand(n) < 0.5, True])
            lengths.append(n + 1)
    return SFTSamples(np.concatenate(ids), np.concatenate(learned), np.cumsum([0, *lengths]), group=2)


@pytest.mark.parametrize("packing", [True, False])
def test_packing_keeps_pairs_whole_and_fills_rows(packing):
    seq, pairs = 96, _random_pairs(200, 96)
    split = np.arange(10, 190)
    ds = SFTDataset(pairs, split, 1, seq, seed=5, packing=packing, pad_id=7, split=0)
    placed, free = [], []
    for k in range(len(ds)):
        item, members = _item(ds, k), ds.pack(k)
        at = 0
        for j, pair in enumerate(members):
            for side in (0, 1):  # document 2j is the chosen answer of pair j, 2j + 1 its rejected
                ids, learned = pairs.document(2 * int(pair) + side)
                doc = np.flatnonzero(item["document_ids"] == 2 * j + side)
                assert doc.tolist() == list(range(at, at + len(ids) - 1))
                assert np.array_equal(item["tokens"][doc], ids[:-1]) and np.array_equal(item["labels"][doc], ids[1:])
                assert np.array_equal(item["loss_mask"][doc], learned[1:])
                at += len(doc)
        assert (item["document_ids"][at:] == 2 * len(members)).all() and not item["loss_mask"][at:].any()
        if at == seq:
            assert item["document_ids"][-1] == 2 * len(members) - 1  # a full row has no padding document
        placed += members.tolist()
        free.append(seq - at)
        if packing and k:  # best fit opened row k only because its first pair fitted no earlier row
            first = int(pairs.positions[members[0]])
            assert all(first > room for room in free[:-1])
        if not packing:
            assert len(members) == 1
    assert sorted(placed) == split.tolist()  # one epoch: every pair exactly once
    if packing:
        assert sum(free) / (len(ds) * seq) < 0.1  # lengths uniform up to seq: a few % of padding


# Truncation ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("chosen, rejected, seq, kept", [
    (3, 4, 10, (3, 4)), (6, 4, 10, (6, 4)),  # they fit
    (3, 100, 10, (3, 7)), (100, 3, 10, (7, 3)),  # a short side leaves the rest of its half
    (100, 100, 10, (5, 5)), (100, 100, 11, (6, 5)), (100, 5, 11, (6, 5)),  # halves; chosen takes the odd one
])
def test_pair_positions_share_the_sequence(chosen, rejected, seq, kept):
    assert pair_positions(chosen, rejected, seq) == kept


def test_long_pairs_are_cut_and_unlearnable_ones_left_out(tmp_path):
    path = _write_jsonl(tmp_path / "long.jsonl", [
        {"prompt": "p", "chosen": "c", "rejected": "r" * 100},  # rejected cut, chosen whole
        {"prompt": "p" * 100, "chosen": "c", "rejected": "r"},  # the prompt leaves neither answer room
    ])
    train, _, _ = _datasets(path, seq_length=60)
    assert len(train) == 1 and train.pack(0).tolist() == [0]
    item = _item(train, 0)
    head = _b("<|user|>\np") + [EOD] + _b("<|assistant|>\n")
    chosen, rejected = head + _b("c") + [EOD], head + _b("r" * 100) + [EOD]
    kept = 60 - (len(chosen) - 1)
    assert item["tokens"].tolist() == chosen[:-1] + rejected[:kept]
    assert item["labels"].tolist() == chosen[1:] + rejected[1:kept + 1]
    assert item["document_ids"].tolist() == [0] * (len(chosen) - 1) + [1] * kept
    with pytest.raises(DataError, match="no preference pair has tokens of both answers") as err:
        _datasets(_write_jsonl(tmp_path / "none.jsonl", [{"prompt": "p" * 100, "chosen": "c", "rejected": "r"}]), 60)
    assert "\n" not in str(err.value) and "model.seq_length=60" in str(err.value)


# Epochs, splits, resumption --------------------------------------------------------------------------
def _many_pairs(count: int):
    rng = np.random.RandomState(1)
    words = ["yes", "no", "two", "four", "maybe", "sure", "the", "answer", "is"]
    say = lambda n: " ".join(rng.choice(words, n))  # noqa: E731
    return [{"prompt": say(rng.randint(1, 5)), "chosen": say(rng.randint(1, 6)), "rejected": say(rng.randint(1, 6))}
            for _ in range(count)]


def test_item_k_depends_on_file_seed_and_k_only(tmp_path):
    path = _write_jsonl(tmp_path / "pairs.jsonl", _many_pairs(40))
    first, valid, _ = _datasets(path, 320, num_samples=(40, 4, 0), split="[3,1,0]")
    again, _, _ = _datasets(path, 320, num_samples=(40, 4, 0), split="[3,1,0]")
    other, _, _ = _datasets(path, 320, num_samples=(40, 4, 0), split="[3,1,0]", seed=4)
    assert len(first) == 40 and first.epoch_size(0) < 15  # several epochs
    order = list(range(17, 40)) + list(range(17))  # a resumed run reads from item 17 on
    seen = {k: _item(again, k) for k in order}
    for k in range(40):
        item = _item(first, k)
        assert all(np.array_equal(item[f], seen[k][f]) for f in FIELDS)
    assert [first.pack(k).tolist() for k in range(10)] != [other.pack(k).tolist() for k in range(10)]
    epoch = [i for k in range(first.epoch_size(0)) for i in first.pack(k).tolist()]
    assert sorted(epoch) == list(range(30))  # the train split: the first 3/4 of the pairs
    assert {i for k in range(len(valid)) for i in valid.pack(k).tolist()} == set(range(30, 40))


def test_context_parallel_ranks_get_their_chunks_of_every_field(tmp_path):
    train, _, _ = _datasets(_write_jsonl(tmp_path / "pairs.jsonl", PAIRS), seq_length=256)
    whole = {f: torch.stack([train[0][f]]) for f in FIELDS}
    for rank in (0, 1):
        batch = ShardingCollate(2, rank)([train[0]])
        chunks = [rank, 3 - rank]  # of four chunks of 64
        for f in FIELDS:
            expected = torch.cat([whole[f][:, 64 * c:64 * (c + 1)] for c in chunks], dim=1)
            assert torch.equal(batch[f], expected), f


# Bad rows: one line naming the file and line ---------------------------------------------------------
@pytest.mark.parametrize("line, fragment", [
    ('{"prompt": "p", "chosen": "c"}', "no 'rejected'"),
    ('{"prompt": "p", "rejected": "r"}', "no 'chosen'"),
    ('{"chosen": "c", "rejected": "r"}', "no 'prompt'"),
    ('{"prompt": "p", "chosen": 4, "rejected": "r"}', "'chosen' is a JSON int"),
    ('{"prompt": "p", "chosen": "c", "rejected": ""}', "'rejected' has no assistant text"),
    ('{"prompt": "p", "chosen": [{"role": "user", "content": "c"}], "rejected": "r"}', "'chosen' has no assistant"),
    ('{"prompt": [{"role": "robot", "content": "p"}], "chosen": "c", "rejected": "r"}', "'prompt' message 0 is not"),
    ('{"prompt": "p", "chosen": "c\\udfff", "rejected": "r"}', "'chosen' message 0: lone surrogate"),
    ('{"prompt": "p", "chosen": "c", "rejected": "r", "system": 1}', "'system' is a JSON int"),
    ('{"prompt": [{"role": "system", "content": "s"}], "chosen": "c", "rejected": "r", "system": "t"}', "keep one"),
    ('["p", "c", "r"]', "a JSON list"),
    ('{"prompt": "p", ', "not valid JSON"),
    (b'{"prompt": "\xff", "chosen": "c", "rejected": "r"}', "not UTF-8"),
])
def test_bad_row_is_one_line_naming_file_and_line(tmp_path, line, fragment):
    path = tmp_path / "bad.jsonl"
    good = b'{"prompt": "p", "chosen": "c", "rejected": "r"}\n'
    path.write_bytes(good + b"\n" + (line if isinstance(line, bytes) else line.encode()) + b"\n")
    with pytest.raises(DataError) as err:
        read_pairs(str(path))
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{path}:3: ") and fragment in message, message


@pytest.mark.parametrize("overrides, key", [([], "data.path"), (["data.path=pairs.jsonl"], "data.tokenizer.path")])
def test_missing_file_or_tokenizer_named(overrides, key):
    cfg = compose_config(["data=preference", *overrides])
    with pytest.raises((DataError, ConfigError), match=key) as err:
        build_datasets(cfg.data, seq_length=32, seed=0, num_samples=(1, 0, 0), vocab_size=500)
    assert "\n" not in str(err.value) and "data=preference" in str(err.value)
