"""``python -m megatron_hydra.generate`` and ``python -m megatron_hydra.evaluate`` at any layout.

The checkpoint is an import of a small random Llama (GQA, RoPE) with a BPE tokenizer. The
generate CLI runs at tp2 as a user runs it (a fresh interpreter, the launcher spawning two
workers) and must print the text of the single-process reference loop (``generate.generate`` on
the whole model). The evaluate CLI runs at pp2 on a local multiple-choice task over a jsonl and
must write lm-eval's results JSON with the task's metric. Each bad input is one line and exit
status 2, before any worker starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from unittest import mock

import pytest
import torch

from conftest import ROOT, _spawn_forked

transformers = pytest.importorskip("transformers")

PROMPTS = ["def main(", "the quick brown fox"]
NEW_TOKENS = 10


def _perturbed(model, seed: int):
    """O(1) random weights: a sharding error cannot hide in near-uniform logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(a Llama import with its tokenizer, a BERT import): the second is another family."""
    from megatron_hydra.convert import api
    from megatron_hydra.data.tokenizers import train_bpe

    root = tmp_path_factory.mktemp("generate_cli")
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=300, max_position_embeddings=64, bos_token_id=0, eos_token_id=0))
    _perturbed(llama, 0).save_pretrained(root / "llama_hf")
    train_bpe(["def main(argv):\n    return argv\n" * 8, "the quick brown fox jumps over the lazy dog\n" * 4], 300,
              str(root / "llama_hf" / "tokenizer.json"))
    api.from_hf(str(root / "llama_hf"), str(root / "llama"))
    bert = transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64))
    bert.save_pretrained(root / "bert_hf")
    api.from_hf(str(root / "bert_hf"), str(root / "bert"))
    return root / "llama", root / "bert"


def _reference_text(ckpt) -> str:
    """The single-process loop on the whole model, greedy, one prompt at a time."""
    from megatron_hydra.checkpoint.standalone import load_model
    from megatron_hydra.config.schema import SamplingConfig
    from megatron_hydra.data.tokenizers import HFTokenizer
    from megatron_hydra.generate import generate

    _, _, model = load_model(str(ckpt))
    tok = HFTokenizer(str(ckpt / "tokenizer.json"))
    greedy = SamplingConfig(greedy=True)
    return "".join(p + tok.decode(generate(model, tok.encode(p), NEW_TOKENS, greedy, eod=tok.eod)) + "\n"
                   for p in PROMPTS)


def test_generate_cli_at_tp2_prints_the_single_process_text(checkpoints, tmp_path, env_no_launcher):
    ckpt, _ = checkpoints
    args = [sys.executable, "-m", "megatron_hydra.generate", f"checkpoint={ckpt}", f"prompts=[{','.join(PROMPTS)}]",
            f"max_new_tokens={NEW_TOKENS}", "sampling.greedy=true", "parallel=tp2", "trainer.devices=2",
            f"run_dir={tmp_path / 'run'}"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=240, env=env_no_launcher, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout == _reference_text(ckpt)
    assert len(set(out.stdout)) > 10  # real continuations, not one repeated token
    assert (tmp_path / "run" / "resolved_config.yaml").exists()
    assert not (tmp_path / "run" / "checkpoints").exists()  # a run of a checkpoint saves nothing


def _mc_task(root) -> str:
    """A local multiple-choice task over a jsonl (lm-eval's task YAML; no network)."""
    rows = [{"question": f"what is {a} plus {b}?", "choices": [str(a + b), str(a * b + 1), "four"], "answer": i % 3}
            for i, (a, b) in enumerate([(1, 2), (2, 2), (3, 1), (0, 5), (2, 3), (4, 4), (1, 1), (3, 3)])]
    (root / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "tiny_mc.yaml").write_text(
        f"task: tiny_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {root / 'mc.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\n"
        "doc_to_text: \"Question: {{question}}\\nAnswer:\"\ndoc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: \"{{answer}}\"\nmetric_list:\n  - metric: acc\n")
    return str(root / "tiny_mc.yaml")


def test_evaluate_cli_at_pp2_writes_the_results_json(checkpoints, tmp_path):
    """Through the launcher (its workers forked from the suite's preloaded server, as
    ``conftest.run_training`` starts them) at pp2, with limit= and batch_size=."""
    pytest.importorskip("lm_eval")
    from megatron_hydra import launcher
    from megatron_hydra.evaluate import main

    ckpt, _ = checkpoints
    task = _mc_task(tmp_path)
    with mock.patch.object(launcher, "_spawn_local", _spawn_forked), mock.patch.dict(os.environ):
        code = main([f"checkpoint={ckpt}", f"tasks=[{task}]", "parallel=pp2", "trainer.devices=2", "limit=6",
                     "batch_size=4", f"output={tmp_path / 'out'}", f"run_dir={tmp_path / 'run'}"])
    assert code == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    acc = results["results"]["tiny_mc"]["acc,none"]
    assert 0.0 <= acc <= 1.0 and acc * 6 == pytest.approx(round(acc * 6))  # a share of the 6 examples
    assert results["config"]["limit"] == 6


BAD = {
    "unknown task": ("evaluate", ["tasks=[no_such_task_zq]"], "no task 'no_such_task_zq'"),
    "task file that does not parse": ("evaluate", ["tasks=[{tmp}/broken.yaml]"], "is not a task lm-eval reads"),
    "missing task file": ("evaluate", ["tasks=[{tmp}/absent.yaml]"], "does not exist"),
    "another model family": ("generate", ["checkpoint={bert}"], "holds a model.arch=bert model"),
    "layout that does not divide the model": ("generate", ["parallel.tensor_parallel_size=3", "trainer.devices=3"],
                                              "model.num_attention_heads=4 is not divisible"),
    "missing checkpoint": ("generate", ["checkpoint={tmp}/nowhere"], "no such file or directory"),
    "context parallelism": ("generate", ["parallel.context_parallel_size=2", "trainer.devices=2"],
                            "parallel.context_parallel_size=2"),
    "virtual pipeline stages": ("evaluate", ["tasks=[x.yaml]", "parallel=pp2", "parallel.virtual_pipeline_size=2",
                                             "trainer.devices=2"], "parallel.virtual_pipeline_size=2"),
    "bad sampling": ("generate", ["sampling.top_p=1.5"], "sampling.top_p=1.5"),
    "unknown option": ("generate", ["data.name=demo"], "argument 'data.name=demo'"),
    "unknown layout": ("generate", ["parallel=tp7"], "config group 'parallel' has no option 'tp7'"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_input_is_one_line_before_any_worker(case, checkpoints, tmp_path, capsys):
    from megatron_hydra import evaluate, generate, launcher

    if "task" in case:
        pytest.importorskip("lm_eval")
    mode, extra, message = BAD[case]
    llama, bert = checkpoints
    (tmp_path / "broken.yaml").write_text("task: broken\ndataset_path: [unclosed\n")
    extra = [e.format(tmp=tmp_path, bert=bert) for e in extra]
    argv = [f"checkpoint={llama}", *(["tasks=[x.yaml]"] if mode == "evaluate" else []), *extra,
            f"run_dir={tmp_path / 'run'}"]

    def no_workers(*args, **kwargs):
        raise AssertionError("a worker was started")

    with mock.patch.object(launcher, "_run_locked", no_workers):
        code = (evaluate if mode == "evaluate" else generate).main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err


def test_launch_py_modes_need_a_checkpoint_and_tasks():
    from conftest import compose_config
    from megatron_hydra.config import derive
    from megatron_hydra.errors import ConfigError

    with pytest.raises(ConfigError, match="mode=generate needs checkpoint.load"):
        derive(compose_config(["mode=generate"]))
    with pytest.raises(ConfigError, match="mode=evaluate needs trainer.eval.tasks"):
        derive(compose_config(["mode=evaluate", "checkpoint.load=ckpt"]))
    with pytest.raises(ConfigError, match="trainer.eval.tasks is empty"):
        derive(compose_config(["trainer.eval.every_n_steps=5"]))
    with pytest.raises(ConfigError, match="trainer.eval.limit=0"):
        derive(compose_config(["trainer.eval.limit=0"]))
