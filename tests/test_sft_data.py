"""Supervised fine-tuning data (``data=sft``): loss on assistant tokens only, lossless packing,
one-line errors for bad files, and every layout equal to the single process on packed batches.

The loss masks are checked against ids written out by hand (the byte tokenizer's bytes; a word-level
tokenizer's vocabulary), packing against the samples it was given, and the tp2 / pp2 / dp2 runs
(Llama form) against one single-process run in float64. The fine-tune command the docs give for
an imported Hugging Face model runs once, as written, on a tiny random GPT-2.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import SMALL, assert_same_trajectory, compose_config, launch_py, run_training
from megatron_hydra.data.builders import build_datasets
from megatron_hydra.data.chat_template import JinjaTemplate, load_template
from megatron_hydra.data.packing import best_fit_packs
from megatron_hydra.data.sft_dataset import SFTDataset, SFTSamples, read_conversations
from megatron_hydra.data.tokenizers import HFTokenizer
from megatron_hydra.errors import ConfigError, DataError

EOD = 256  # the byte tokenizer's end of document


def _write_jsonl(path, rows) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return str(path)


def _b(text: str):
    return list(text.encode())


# Loss on assistant tokens only ---------------------------------------------------------------------
CONVERSATIONS = [
    {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"},
                  {"role": "assistant", "content": "yo"}, {"role": "user", "content": "q"},
                  {"role": "assistant", "content": "ok"}]},
    {"prompt": "2+2", "response": "4"},
]


def _expected_default():
    """Ids and learned flags of CONVERSATIONS under the default template, written out by hand."""
    first = [(_b("<|system|>\nS") + [EOD], 0), (_b("<|user|>\nhi") + [EOD], 0), (_b("<|assistant|>\n"), 0),
             (_b("yo") + [EOD], 1), (_b("<|user|>\nq") + [EOD], 0), (_b("<|assistant|>\n"), 0), (_b("ok") + [EOD], 1)]
    second = [(_b("<|user|>\n2+2") + [EOD], 0), (_b("<|assistant|>\n"), 0), (_b("4") + [EOD], 1)]
    return [([i for ids, _ in c for i in ids], [f for ids, f in c for _ in ids]) for c in (first, second)]


def test_default_template_loss_mask_is_the_assistant_tokens(tmp_path):
    path = _write_jsonl(tmp_path / "chat.jsonl", CONVERSATIONS)
    cfg = compose_config(["data=sft", f"data.path={path}", "data.tokenizer.type=byte", "data.split=[1,0,0]"])
    train, valid, _ = build_datasets(cfg.data, seq_length=128, seed=3, num_samples=(1, 0, 0), vocab_size=300)
    assert valid is None and len(train) == 1  # both conversations fit one pack
    item = {k: v.numpy() for k, v in train[0].items()}
    expected = {len(ids) - 1: (ids, flags) for ids, flags in _expected_default()}
    seen = 0
    for doc in range(2):
        at = np.flatnonzero(item["document_ids"] == doc)
        ids, flags = expected[len(at)]
        assert at[0] == seen and np.array_equal(at, np.arange(seen, seen + len(at)))
        assert item["tokens"][at].tolist() == ids[:-1] and item["labels"][at].tolist() == ids[1:]
        assert item["loss_mask"][at].tolist() == flags[1:]
        assert item["position_ids"][at].tolist() == list(range(len(at)))
        seen += len(at)
    pad = np.arange(seen, 128)
    assert (item["document_ids"][pad] == 2).all() and not item["loss_mask"][pad].any()
    assert int(item["loss_mask"].sum()) == 3 + 3 + 2  # "yo<eod>", "ok<eod>", "4<eod>"


def _word_tokenizer(directory: Path, template: str = None) -> HFTokenizer:
    """A word-level tokenizer.json with ChatML's special tokens, and a tokenizer_config.json
    holding a ChatML-style chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "system", "user", "assistant",
             "be", "brief", "hi", "hello", "bye", "2+2", "4"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    directory.mkdir(exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    template = template or ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>"
                            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "<|im_end|>"}))
    return HFTokenizer(str(directory / "tokenizer.json"))


def test_tokenizer_chat_template_loss_mask(tmp_path):
    """Ids of the word-level vocabulary above: 2 <|im_start|>, 3 <|im_end|>, 4 system, 5 user,
    6 assistant, 7 be, 8 brief, 9 hi, 10 hello, 11 bye, 12 2+2, 13 4."""
    template = load_template(_word_tokenizer(tmp_path / "tok"))
    assert isinstance(template, JinjaTemplate)
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"},
            {"role": "assistant", "content": "bye"}]
    ids, learned = template.tokens(chat)
    assert ids.tolist() == [2, 4, 7, 8, 3, 2, 5, 9, 3, 2, 6, 10, 3, 2, 5, 11, 3, 2, 6, 11, 3]
    assert learned.astype(int).tolist() == [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1]
    ids, learned = template.tokens([{"role": "user", "content": "2+2"}, {"role": "assistant", "content": "4"}])
    assert ids.tolist() == [2, 5, 12, 3, 2, 6, 13, 3]
    assert learned.astype(int).tolist() == [0, 0, 0, 0, 0, 0, 1, 1]


def test_generation_tags_render_and_unsplittable_templates_are_refused(tmp_path):
    """Hugging Face's {% generation %} tag renders its body; a template that renders the turns in
    reverse has no prefix structure, so the file's conversation is refused in one line."""
    tagged = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {% if m['role'] == 'assistant' %}{% generation %}"
              "{{ m['content'] }}<|im_end|>{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>{% endif %}"
              "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")
    ids, learned = load_template(_word_tokenizer(tmp_path / "tagged", tagged)).tokens(
        [{"role": "user", "content": "2+2"}, {"role": "assistant", "content": "4"}])
    assert ids.tolist() == [2, 5, 12, 3, 2, 6, 13, 3] and learned.astype(int).tolist() == [0, 0, 0, 0, 0, 0, 1, 1]
    reverse = "{% for m in messages | reverse %}{{ m['content'] }} {% endfor %}"
    tokenizer_dir = tmp_path / "reverse"
    _word_tokenizer(tokenizer_dir, reverse)
    path = _write_jsonl(tmp_path / "chat.jsonl", [{"prompt": "hi", "response": "hello"}])
    cfg = compose_config(["data=sft", f"data.path={path}", f"data.tokenizer.path={tokenizer_dir / 'tokenizer.json'}"])
    with pytest.raises(DataError, match=r"chat\.jsonl: conversation 1: .* prefixes") as err:
        build_datasets(cfg.data, seq_length=32, seed=0, num_samples=(1, 0, 0), vocab_size=64)
    assert "\n" not in str(err.value)


# Packing -------------------------------------------------------------------------------------------
def _random_samples(seed: int, count: int, seq: int) -> SFTSamples:
    rng = np.random.RandomState(seed)
    lengths = np.minimum(rng.lognormal(np.log(seq / 4), 0.8, count).astype(int) + 2, seq + 1)  # <= seq + 1 ids
    lengths[:3] = seq + 1  # as long as a sample may be (longer ones were truncated to this)
    ids = [rng.randint(0, 1000, n) for n in lengths]
    learned = [rng.rand(n) < 0.5 for n in lengths]
    for flags in learned:
        flags[-1] = True
    return SFTSamples(np.concatenate(ids), np.concatenate(learned), np.cumsum([0, *lengths]))


@pytest.mark.parametrize("packing", [True, False])
def test_packing_is_lossless(packing):
    seq, samples = 64, _random_samples(0, 300, 64)
    split = np.arange(20, 280)  # a split of the samples
    ds = SFTDataset(samples, split, 1, seq, seed=5, packing=packing, pad_id=7, split=0)
    placed = []
    for k in range(len(ds)):
        item = {key: v.numpy() for key, v in ds[k].items()}
        docs = item["document_ids"]
        assert (np.diff(docs) >= 0).all() and docs[0] == 0
        members = ds.pack(k)
        for doc, i in enumerate(members):
            at = np.flatnonzero(docs == doc)
            ids, learned = samples.sample(int(i))
            assert np.array_equal(item["tokens"][at], ids[:-1]) and np.array_equal(item["labels"][at], ids[1:])
            assert np.array_equal(item["loss_mask"][at], learned[1:])
            assert item["position_ids"][at].tolist() == list(range(len(ids) - 1))
        pad = np.flatnonzero(docs == len(members))
        assert len(pad) == seq - sum(len(samples.sample(int(i))[0]) - 1 for i in members)
        assert (pad == np.arange(seq - len(pad), seq)).all() and not item["loss_mask"][pad].any()
        placed += members.tolist()
    assert sorted(placed) == split.tolist()  # one epoch: every sample exactly once
    if packing:
        assert len(ds) < len(split) / 2
        again = SFTDataset(samples, split, 1, seq, seed=5, packing=True, pad_id=7, split=0)
        other = SFTDataset(samples, split, 1, seq, seed=6, packing=True, pad_id=7, split=0)
        assert [ds.pack(k).tolist() for k in range(len(ds))] == [again.pack(k).tolist() for k in range(len(again))]
        assert [ds.pack(k).tolist() for k in range(len(ds))] != [other.pack(k).tolist() for k in range(len(other))]
    else:
        assert len(ds) == len(split)
    more = SFTDataset(samples, split, 5 * len(ds), seq, seed=5, packing=packing, pad_id=7, split=0)
    later = [more.pack(k).tolist() for k in range(len(more))]  # epochs 0-4, packed as reached
    assert len(more) == 5 * len(ds) and later[:len(ds)] == [ds.pack(k).tolist() for k in range(len(ds))]
    assert [more.pack(k).tolist() for k in range(len(more))] == later  # early epochs packed again, alike
    assert sorted(i for pack in later[:more.epoch_size(0) + more.epoch_size(1)] for i in pack) == sorted(2 * split.tolist())


def test_best_fit_fills_the_gaps_next_fit_leaves():
    """Placed by hand. Capacity 10: 6 opens pack 0, 7 opens pack 1 (6+7 > 10), 4 fits pack 0 exactly
    (free 4 there, 3 in pack 1), 3 fits pack 1 exactly; next-fit would have closed pack 0. Capacity
    8: 5 and 6 open packs 0 and 1 (free 3 and 2); 2 goes where the least room is left (pack 1, where
    first-fit would take pack 0), then 3 fills pack 0."""
    assert best_fit_packs([6, 7, 4, 3], 10) == [[0, 2], [1, 3]]
    assert best_fit_packs([5, 6, 2, 3], 8) == [[0, 3], [1, 2]]


def test_long_conversations_are_truncated_and_unlearnable_ones_left_out(tmp_path):
    path = _write_jsonl(tmp_path / "long.jsonl", [{"prompt": "p" * 100, "response": "r"},  # answer beyond seq
                                                  {"prompt": "p", "response": "r" * 100}])
    cfg = compose_config(["data=sft", f"data.path={path}", "data.tokenizer.type=byte", "data.split=[1,0,0]"])
    train, _, _ = build_datasets(cfg.data, seq_length=32, seed=0, num_samples=(1, 0, 0), vocab_size=300)
    assert len(train) == 1 and train.pack(0).tolist() == [0]
    item = train[0]
    expected = _b("<|user|>\np") + [EOD] + _b("<|assistant|>\n") + _b("r" * 100)
    assert item["tokens"].tolist() == expected[:32] and item["labels"].tolist() == expected[1:33]
    assert (item["document_ids"] == 0).all()


# Bad files: one line, the file and line ------------------------------------------------------------
@pytest.mark.parametrize("line, fragment", [
    ('{"messages": [', "not valid JSON"),
    ("[1, 2]", "a JSON list"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant message"),
    ('{"messages": [{"role": "robot", "content": "hi"}]}', "message 0 is not"),
    ('{"prompt": "hi"}', "expected"),
])
def test_malformed_line_names_file_and_line(tmp_path, line, fragment):
    path = _write_jsonl(tmp_path / "bad.jsonl", [CONVERSATIONS[1], "", line])
    with pytest.raises(DataError) as err:
        read_conversations(path)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{path}:3: ") and fragment in message


@pytest.mark.parametrize("overrides, key", [([], "data.path"), (["data.path=chat.jsonl"], "data.tokenizer.path")])
def test_missing_file_or_tokenizer_named(overrides, key):
    cfg = compose_config(["data=sft", *overrides])
    with pytest.raises((DataError, ConfigError), match=key) as err:
        build_datasets(cfg.data, seq_length=32, seed=0, num_samples=(1, 0, 0), vocab_size=500)
    assert "\n" not in str(err.value)


# Layouts equal the single process on packed SFT batches --------------------------------------------
STEPS = 3
# The Llama form (rotary positions restarting per packed conversation, grouped-query attention).
LLAMA = ["model.position_embedding=rope", "model.normalization=rmsnorm", "model.activation=swiglu",
         "model.num_query_groups=2", "model.add_bias_linear=false", "model.tie_embeddings=false"]
LAYOUTS = {"tp2": ["parallel.tensor_parallel_size=2", "trainer.devices=2"],
           "pp2": ["parallel.pipeline_parallel_size=2", "trainer.devices=2"],
           "dp2": ["trainer.devices=2"]}


def _chat_rows(count: int, seed: int):
    rng = np.random.RandomState(seed)
    words = ["add", "two", "and", "three", "list", "sort", "the", "numbers", "please", "ok"]
    rows = []
    for i in range(count):
        say = lambda n: " ".join(rng.choice(words, n))  # noqa: E731
        if i % 2:
            rows.append({"prompt": say(rng.randint(1, 6)), "response": say(rng.randint(1, 8))})
        else:
            rows.append({"messages": [{"role": "system", "content": "be brief"},
                                      {"role": "user", "content": say(rng.randint(1, 4))},
                                      {"role": "assistant", "content": say(rng.randint(1, 5))}]})
    return rows


@pytest.fixture(scope="module")
def sft_single(tmp_path_factory):
    """The overrides of a 3-step float64 SFT run and its single-process metrics. Conversations of
    50-80 tokens, packed 2-3 to a sequence of 160, so positions restart within sequences. No run
    saves a checkpoint (nothing reads one)."""
    path = _write_jsonl(tmp_path_factory.mktemp("sft_data") / "chat.jsonl", _chat_rows(80, 0))
    base = [*SMALL, *LLAMA, "data=sft", f"data.path={path}", "data.tokenizer.type=byte", "model.seq_length=160",
            "data.global_batch_size=4", "precision=fp64", f"trainer.max_steps={STEPS}", "checkpoint.save_last=false"]
    return base, run_training(base, tmp_path_factory.mktemp("sft_single"))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layouts_equal_single_process_on_sft_data(sft_single, name, tmp_path):
    base, reference = sft_single
    rows = run_training([*base, *LAYOUTS[name]], tmp_path)
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert_same_trajectory(rows, reference, rel=1e-9)


# The documented fine-tune command for an imported Hugging Face model -------------------------------
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_fine_tune_an_imported_gpt2_on_chat(tmp_path, env_no_launcher, capsys):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer
    from megatron_hydra.convert.api import from_hf
    from megatron_hydra.data.tokenizers import train_bpe

    hf = tmp_path / "hf_gpt2"
    hf.mkdir()
    vocab = 300
    train_bpe(["user assistant system: what is two plus two? four.\n" * 8], vocab - 2, str(hf / "tokenizer.json"))
    tok = Tokenizer.from_file(str(hf / "tokenizer.json"))
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(hf / "tokenizer.json"))
    (hf / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=64,
                                     vocab_size=tok.get_vocab_size(with_added_tokens=True))
    transformers.GPT2LMHeadModel(config).save_pretrained(str(hf))
    ckpt = tmp_path / "ckpt"
    from_hf(str(hf), str(ckpt), name="hf")
    chat = _write_jsonl(tmp_path / "chat.jsonl", [{"prompt": "what is two plus two?", "response": "four."}] * 8)
    code = launch_py(
        ["model=from_checkpoint", "data=sft", f"data.path={chat}", f"checkpoint.load={ckpt}",
         "checkpoint.load_optimizer=false", "data.micro_batch_size=2", "trainer.max_steps=1", "optim.warmup_steps=0",
         "trainer.enable_progress_bar=false", "trainer.generate_sample_tokens=0", f"hydra.run.dir={tmp_path / 'run'}"],
        env_no_launcher)
    captured = capsys.readouterr()
    out = captured.err + captured.out
    assert code == 0, out[-2000:]
    assert f"resumed from {ckpt} at step 0" in out and "chat_template of" in out
