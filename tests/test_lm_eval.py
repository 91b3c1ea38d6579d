"""lm-evaluation-harness through our engine equals lm-eval's own Hugging Face backend.

The reference is lm-eval's ``HFLM`` (``--model hf``) on a small random GPT-2 exported by ``convert
to_hf`` from the checkpoint ours loads, both in float32 on the CPU, given the same requests:
loglikelihoods (empty, space-ended and over-long contexts among them), rolling loglikelihoods of
documents longer than the model, greedy ``generate_until`` with stop strings, and
``simple_evaluate`` on local task YAMLs over jsonl files (multiple choice, generation, perplexity).
Ours runs at tp1 (data-parallel over two ranks), tp2 and pp2 on two gloo ranks started once.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from unittest import mock

import pytest
import torch

from conftest import spawn_ranks

pytest.importorskip("lm_eval")
transformers = pytest.importorskip("transformers")

VOCAB, POSITIONS = 300, 64
CORPUS = ["the quick brown fox jumps over the lazy dog\n" * 4, "Question: what is two plus two?\nAnswer: four\n" * 4]
LONG = "the quick brown fox jumps over the lazy dog\n" * 6  # > POSITIONS tokens: cut on the left / rolled
LOGLIKELIHOOD = [("the quick brown", " fox"), ("", "the lazy dog"), ("Question: what is two plus two?\nAnswer: ", "four"),
                 (LONG, " the quick"), ("x", "y z w"), ("the quick brown", " fox jumps")]
ROLLING = [LONG, "Answer: four", "dog"]
GREEDY = {"until": ["o"], "max_gen_toks": 10, "do_sample": False}
GENERATE = [("the quick", {"until": ["\n"], "max_gen_toks": 12, "do_sample": False}),
            ("Question: what is two plus two?\nAnswer:", {"until": ["\n"], "max_gen_toks": 12, "do_sample": False}),
            (LONG, {"until": ["\n"], "max_gen_toks": 12, "do_sample": False}),
            ("the", GREEDY), ("Answer: fo", GREEDY), ("dog", GREEDY)]
SAMPLED = [(c, {"until": ["\n"], "max_gen_toks": 8, "do_sample": True, "temperature": 0.9, "top_k": 20})
           for c in ("the quick", "Answer:", "dog")]
LIMIT, FEWSHOT = 6, 1


def _spread(model) -> None:
    """O(1) random weights (norms around one): a mapping error cannot hide in near-zero logits."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.2
            p.copy_(noise + 1.0 if "ln" in name else noise)


def _write_tasks(root) -> list:
    """Three local tasks over jsonl files: multiple choice, generation until a stop string, and
    a document perplexity. Absolute data paths: lm-eval reads them relative to the working dir."""
    questions = [{"question": f"what is {a} plus {b}?", "choices": [str(a + b), str(a * b + 1), "four"],
                  "answer": i % 3} for i, (a, b) in enumerate([(1, 2), (2, 2), (3, 1), (0, 5), (2, 3), (4, 4),
                                                              (1, 1), (3, 3), (5, 2), (6, 1), (2, 7), (9, 0)])]
    prompts = [{"prompt": f"Question: what is {i} plus {i}?\nAnswer:", "target": " four"} for i in range(10)]
    docs = [{"text": LONG}, {"text": "the lazy dog jumps"}, {"text": "Answer: four\nQuestion: two"}]
    data = {"mc": questions, "gen": prompts, "ppl": docs}
    for name, rows in data.items():
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = lambda name: (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {root / name}.jsonl\n"  # noqa: E731
                           "test_split: test\n")
    (root / "tiny_mc.yaml").write_text(
        f"task: tiny_mc\n{common('mc')}output_type: multiple_choice\n"
        "doc_to_text: \"Question: {{question}}\\nAnswer:\"\ndoc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: \"{{answer}}\"\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    (root / "tiny_gen.yaml").write_text(
        f"task: tiny_gen\n{common('gen')}output_type: generate_until\ndoc_to_text: \"{{{{prompt}}}}\"\n"
        "doc_to_target: \"{{target}}\"\ngeneration_kwargs:\n  until: [\"\\n\", \"o\"]\n  max_gen_toks: 8\n"
        "  do_sample: false\nmetric_list:\n  - metric: exact_match\n")
    (root / "tiny_ppl.yaml").write_text(
        f"task: tiny_ppl\n{common('ppl')}output_type: loglikelihood_rolling\ndoc_to_text: \"\"\n"
        "doc_to_target: \"{{text}}\"\nmetric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n"
        "  - metric: bits_per_byte\n")
    return [str(root / f"tiny_{name}.yaml") for name in data]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(our checkpoint, its export to Hugging Face, the task YAMLs)."""
    from megatron_hydra.convert import api
    from megatron_hydra.data.tokenizers import train_bpe

    root = tmp_path_factory.mktemp("lm_eval")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=POSITIONS, vocab_size=VOCAB,
                                  bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    _spread(model)
    model.eval().save_pretrained(root / "src")
    train_bpe(CORPUS, VOCAB, str(root / "src" / "tokenizer.json"))
    api.from_hf(str(root / "src"), str(root / "ckpt"), name="tiny_gpt2")
    api.to_hf(str(root / "ckpt"), str(root / "hf"))
    return str(root / "ckpt"), str(root / "hf"), _write_tasks(root), _greedy_request(model, str(root / "src"))


def _greedy_request(model, hf_dir):
    """A (context, continuation) whose continuation is transformers' own greedy choice, so that
    the greedy flags compared below are not all False."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    # Ends in punctuation, not whitespace (lm-eval moves that to the continuation): the
    # continuation is a word of its own, tokenised as generated.
    context = "Question: what is two plus two?\nAnswer:"
    ids = tokenizer(context, return_tensors="pt").input_ids
    with torch.no_grad():
        new = model.generate(ids, max_new_tokens=1, do_sample=False, pad_token_id=0)[0, ids.shape[1]:]
    return context, tokenizer.decode(new)


def _instances(kind, args):
    from lm_eval.api.instance import Instance

    return [Instance(kind, {}, a if isinstance(a, tuple) else (a,), i) for i, a in enumerate(args)]


def _all_requests(lm, greedy, evaluate=None, sample=True) -> dict:
    """Every request kind through ``lm``, and ``evaluate()``'s {task: {metric: value}}."""
    return {"loglikelihood": lm.loglikelihood(_instances("loglikelihood", [*LOGLIKELIHOOD, greedy])),
            "rolling": lm.loglikelihood_rolling(_instances("loglikelihood_rolling", ROLLING)),
            "generate": lm.generate_until(_instances("generate_until", GENERATE)),
            "sampled": lm.generate_until(_instances("generate_until", SAMPLED)) if sample else None,
            "metrics": evaluate() if evaluate else None}


@pytest.fixture(scope="module")
def reference(setup):
    """lm-eval's own Hugging Face backend on the exported directory."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    _, hf_dir, tasks, greedy = setup
    # accelerate starts a process group of its own where a launcher's variables are set
    launch_vars = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    with mock.patch.dict(os.environ, {k: v for k, v in os.environ.items() if k not in launch_vars}, clear=True):
        lm = HFLM(pretrained=hf_dir, device="cpu", dtype="float32", batch_size=4)
    manager = TaskManager(include_path=os.path.dirname(tasks[0]), include_defaults=False)

    def evaluate():
        results = simple_evaluate(model=lm, tasks=tasks, limit=LIMIT, num_fewshot=FEWSHOT, task_manager=manager,
                                  log_samples=False)
        return {task: {k: v for k, v in m.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
                for task, m in results["results"].items()}

    # Hugging Face draws from a generator of its own: sampling is compared across our layouts only.
    return _all_requests(lm, greedy, evaluate, sample=False)


def _ours(ckpt, tasks, greedy, layout, world, write_to=None) -> dict:
    """Our adapter over an Engine on this rank's stage of ``ckpt`` at ``layout`` (tp, pp; the
    rest of ``world`` data-parallel); ``tasks`` evaluated too unless None."""
    from megatron_hydra.checkpoint import sharded, standalone
    from megatron_hydra.config import derive
    from megatron_hydra.config.schema import EvalConfig
    from megatron_hydra.data.tokenizers import HFTokenizer
    from megatron_hydra.inference import lm_eval_adapter
    from megatron_hydra.inference.engine import Engine
    from megatron_hydra.models.stages import build_stage_chunks
    from megatron_hydra.parallel.state import ParallelState

    cfg, _ = standalone.single_process(standalone.read_config(ckpt))
    cfg.parallel.tensor_parallel_size, cfg.parallel.pipeline_parallel_size = layout
    cfg.trainer.devices = world
    derived = derive(cfg)
    ps = ParallelState.build(tp=derived.tp, pp=derived.pp, dp=derived.dp)
    chunks, _ = build_stage_chunks(cfg, derived, ps)
    sharded.load(ckpt, chunks[0], None, ps, derived.transformer.vocab_size, load_optimizer=False)
    tokenizer = HFTokenizer(os.path.join(ckpt, "tokenizer.json"))
    engine = Engine(chunks, ps, derived.transformer, batch_size=4)
    lm = lm_eval_adapter.MegatronLM(engine, tokenizer, POSITIONS, batch_size=4)
    config = EvalConfig(tasks=tasks or [], limit=LIMIT, num_fewshot=FEWSHOT, batch_size=4)
    printed = io.StringIO()

    def evaluate():
        with contextlib.redirect_stdout(printed):
            return lm_eval_adapter.evaluate(engine, tokenizer, POSITIONS, config, write_to)

    return {**_all_requests(lm, greedy, evaluate if tasks else None), "printed": printed.getvalue()}


def _layouts(rank, world, ckpt, tasks, greedy, out_dir):
    """tp1 (data-parallel over the two ranks: each scores its share), tp2 and pp2."""
    return {"tp1": _ours(ckpt, tasks, greedy, (1, 1), world, write_to=out_dir),
            "tp2": _ours(ckpt, tasks, greedy, (2, 1), world), "pp2": _ours(ckpt, None, greedy, (1, 2), world)}


@pytest.fixture(scope="module")
def ours(setup, tmp_path_factory):
    """Ours at every layout, from one start of two ranks: {rank: {layout: results}}."""
    ckpt, _, tasks, greedy = setup
    out_dir = tmp_path_factory.mktemp("eval_out")
    return spawn_ranks(_layouts, 2, ckpt, tasks, greedy, str(out_dir)), out_dir


LAYOUTS = ["tp1", "tp2", "pp2"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_loglikelihood_matches_hf_backend(reference, ours, layout):
    ref, got = reference["loglikelihood"], ours[0][0][layout]["loglikelihood"]
    assert [g for _, g in got] == [g for _, g in ref] and any(g for _, g in ref)
    assert [lp for lp, _ in got] == pytest.approx([lp for lp, _ in ref], abs=1e-4, rel=0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_loglikelihood_rolling_matches_hf_backend(reference, ours, layout):
    assert ours[0][0][layout]["rolling"] == pytest.approx(reference["rolling"], abs=1e-4, rel=0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_greedy_generate_until_matches_hf_backend(reference, ours, layout):
    assert ours[0][0][layout]["generate"] == reference["generate"]
    # Distinct texts, some cut at a stop string ("o" ends a GREEDY request early).
    assert len(set(reference["generate"])) >= 4
    assert any(len(text) < 5 for text, (_, kw) in zip(reference["generate"], GENERATE) if kw is GREEDY)


def test_seeded_sampling_is_the_same_at_every_layout(ours):
    results = ours[0][0]
    assert results["tp1"]["sampled"] == results["tp2"]["sampled"] == results["pp2"]["sampled"]
    assert len(set(results["tp1"]["sampled"])) == len(SAMPLED)


@pytest.mark.parametrize("layout", ["tp1", "tp2"])
def test_simple_evaluate_metrics_match_hf_backend(reference, ours, layout):
    ref, got = reference["metrics"], ours[0][0][layout]["metrics"]
    assert sorted(ref) == sorted(got) == ["tiny_gen", "tiny_mc", "tiny_ppl"]
    for task, metrics in ref.items():
        assert set(metrics) == set(got[task]), task
        for key, value in metrics.items():
            # Perplexities exponentiate summed log-likelihoods (Hugging Face sums in float32, we in
            # float64): 1e-4 relative; accuracies are counts and agree exactly within it.
            assert got[task][key] == pytest.approx(value, rel=1e-4, abs=1e-8), (task, key)


def test_every_rank_has_every_result(ours):
    ranks, _ = ours
    for layout in LAYOUTS:
        assert {k: v for k, v in ranks[1][layout].items() if k != "printed"} == \
            {k: v for k, v in ranks[0][layout].items() if k != "printed"}


def test_rank_zero_writes_results_json_and_prints_the_table(ours):
    ranks, out_dir = ours
    (path,) = out_dir.glob("*.json")
    written = json.loads(path.read_text())
    assert written["results"]["tiny_mc"]["acc,none"] == ranks[0]["tp1"]["metrics"]["tiny_mc"]["acc,none"]
    assert written["config"]["limit"] == LIMIT and written["n-shot"]["tiny_mc"] == FEWSHOT
    assert "pretty_env_info" in written  # lm-eval's own survey, on the writing rank
    assert "tiny_mc" in ranks[0]["tp1"]["printed"] and "acc_norm" in ranks[0]["tp1"]["printed"]
    assert ranks[1]["tp1"]["printed"] == ""


# Task checks, before any worker starts --------------------------------------------------------------
def _check_error(tasks) -> str:
    from megatron_hydra.errors import ConfigError
    from megatron_hydra.inference.lm_eval_adapter import check_tasks

    with pytest.raises(ConfigError) as err:
        check_tasks(tasks)
    message = str(err.value)
    assert "\n" not in message and message.startswith("trainer.eval.tasks")
    return message


def test_check_tasks_accepts_local_task_files(setup):
    from megatron_hydra.inference.lm_eval_adapter import check_tasks

    check_tasks(setup[2])


def test_check_tasks_refuses_an_unknown_name():
    assert "no task 'no_such_task_xyz'" in _check_error(["no_such_task_xyz"])


@pytest.mark.parametrize("case", ["missing", "directory", "unparsable", "no_task_key", "not_a_mapping"])
def test_check_tasks_refuses_a_bad_task_file(tmp_path, case):
    path = tmp_path / "task.yaml"
    if case == "directory":
        path.mkdir()
    elif case == "unparsable":
        path.write_text("task: [unclosed\n  - x: {\n")
    elif case == "no_task_key":
        path.write_text("dataset_path: json\noutput_type: multiple_choice\n")
    elif case == "not_a_mapping":
        path.write_text("- just\n- a list\n")
    message = _check_error([str(path)])
    assert str(path) in message


class _Recorder:
    """An engine that records what it is asked and scores a pair by its length."""

    def __init__(self):
        self.calls = []

    def score(self, requests):
        self.calls.append(requests)
        return [(-float(len(c) + len(x)), len(x) == 1) for c, x in requests]


def test_requests_reach_the_engine_longest_first_once_each():
    from megatron_hydra.data.tokenizers import ByteTokenizer
    from megatron_hydra.inference.lm_eval_adapter import MegatronLM

    engine = _Recorder()
    lm = MegatronLM(engine, ByteTokenizer(), max_length=64)
    pairs = [("ab", "c"), ("abcdef", "g"), ("ab", "c"), ("", "xyz"), ("a ", "bc")]
    out = lm.loglikelihood(_instances("loglikelihood", pairs))
    eod = ByteTokenizer.eod
    # The trailing space moves to the continuation; the empty context becomes end-of-document.
    assert engine.calls == [[(list(b"abcdef"), list(b"g")), (list(b"a"), list(b" bc")), ([eod], list(b"xyz")),
                             (list(b"ab"), list(b"c"))]]
    assert out == [(-3.0, True), (-7.0, True), (-3.0, True), (-4.0, False), (-4.0, False)]


def test_generation_longer_than_the_model_is_one_line():
    from megatron_hydra.data.tokenizers import ByteTokenizer
    from megatron_hydra.errors import ConfigError
    from megatron_hydra.inference.lm_eval_adapter import MegatronLM

    lm = MegatronLM(_Recorder(), ByteTokenizer(), max_length=16)
    with pytest.raises(ConfigError, match="max_gen_toks=16 leaves no room"):
        lm.generate_until(_instances("generate_until", [("abc", {"until": ["x"], "max_gen_toks": 16})]))


def test_sampling_follows_lm_eval_generation_arguments():
    from megatron_hydra.config.schema import SamplingConfig
    from megatron_hydra.inference.lm_eval_adapter import sampling_from

    assert sampling_from({"do_sample": False, "temperature": 0.7}) == SamplingConfig(greedy=True)
    assert sampling_from({"do_sample": True, "temperature": 0.0}) == SamplingConfig(greedy=True)
    assert sampling_from({"do_sample": True, "temperature": 0.7, "top_k": 5, "top_p": 0.9}) == SamplingConfig(
        greedy=False, temperature=0.7, top_k=5, top_p=0.9)
