"""lm-eval on our engine against lm-eval's own Hugging Face backend: time to evaluate a local
100-example multiple-choice task with a gpt_125m-shaped model, both in the same run.

    python benchmarks/eval_speed.py [examples=100] [batch=8] [threads=2] [rounds=2] [layers=12] [hidden=768]

A GPT-2 of gpt_125m's shape (12 layers, hidden 768, 12 heads, vocabulary 50257, 2048 positions;
random weights) is saved by transformers, imported (``convert from_hf``) and exported again
(``convert to_hf``); lm-eval's ``hf`` backend evaluates the export, ours (``inference.lm_eval_adapter``
over an ``Engine`` at tp1, this process) the checkpoint, both through ``simple_evaluate`` on the same
task YAML over a jsonl: ``examples`` questions of four choices (4 x examples loglikelihood
requests), the same batch size, float32. Each side runs once on 2 questions to warm up (imports,
dataset cache, first allocations), then ``rounds`` times on all of them, the two sides
alternating; the best round of each counts: the whole ``simple_evaluate`` call (task loading,
lm-eval's environment survey, metrics) and, within it, the model's part (the ``loglikelihood``
call). Prints both and their ratios; asserts nothing. Needs
``lm-eval[hf]`` (accelerate) besides this package and transformers.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

DEFAULTS = {"examples": 100, "batch": 8, "threads": 2, "layers": 12, "hidden": 768, "rounds": 2}
VOCAB, POSITIONS = 50257, 2048
WORDS = ("apple river stone cloud seven orange quiet window garden silver bridge market winter "
         "candle forest yellow number paper engine island").split()


def _corpus(n: int):
    """Distinct questions with four answers each, and a text to train the tokenizer on."""
    rows = []
    for i in range(n):
        w = [WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(8)]
        rows.append({"question": f"Which word follows {w[0]} {w[1]} and {w[2]} in list {i} of {w[3]}?",
                     "choices": [f"{w[4]} {w[5]}", w[6], f"the {w[7]}", f"{w[5]} or {w[4]}"], "answer": i % 4})
    text = [" ".join(r["question"] + " " + " ".join(r["choices"]) for r in rows)] * 4
    return rows, text


def _task(root: Path, rows) -> str:
    (root / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = root / "speed_mc.yaml"
    path.write_text(f"task: speed_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {root / 'mc.jsonl'}\n"
                    "test_split: test\noutput_type: multiple_choice\ndoc_to_text: \"Question: {{question}}\\nAnswer:\"\n"
                    "doc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{answer}}\"\nmetric_list:\n  - metric: acc\n")
    return str(path)


def _checkpoint(root: Path, args, text) -> tuple:
    """(our checkpoint, its Hugging Face export) of a random gpt_125m-shaped GPT-2."""
    import transformers

    from megatron_hydra.convert import api
    from megatron_hydra.data.tokenizers import train_bpe

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=args["hidden"], n_layer=args["layers"], n_head=args["hidden"] // 64,
                                  n_positions=POSITIONS, vocab_size=VOCAB, bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(cfg).eval().save_pretrained(root / "src")
    train_bpe(text, 2048, str(root / "src" / "tokenizer.json"))
    api.from_hf(str(root / "src"), str(root / "ckpt"), name="gpt_125m_shaped")
    api.to_hf(str(root / "ckpt"), str(root / "hf"))
    return str(root / "ckpt"), str(root / "hf")


def _timed(target, run) -> tuple:
    """(seconds of ``run()``, seconds of it inside ``target.loglikelihood``, its results);
    ``target``: an LM or an LM class (ours builds its LM inside ``evaluate``)."""
    inner, spent = target.loglikelihood, [0.0]

    def loglikelihood(*a, **k):
        start = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            spent[0] += time.perf_counter() - start

    with mock.patch.object(target, "loglikelihood", loglikelihood):
        start = time.perf_counter()
        results = run()
        return time.perf_counter() - start, spent[0], results


def _ours(ckpt: str, task: str, batch: int, limit=None):
    from megatron_hydra.checkpoint import standalone
    from megatron_hydra.config.schema import EvalConfig
    from megatron_hydra.data.tokenizers import HFTokenizer
    from megatron_hydra.inference import lm_eval_adapter
    from megatron_hydra.inference.engine import Engine
    from megatron_hydra.parallel.state import ParallelState

    _, derived, model = standalone.load_model(ckpt)
    engine = Engine([model], ParallelState.single(), derived.transformer, batch_size=batch)
    tokenizer = HFTokenizer(os.path.join(ckpt, "tokenizer.json"))
    cfg = EvalConfig(tasks=[task], batch_size=batch, limit=limit)
    return _timed(lm_eval_adapter.MegatronLM,
                  lambda: lm_eval_adapter.evaluate(engine, tokenizer, POSITIONS, cfg)["speed_mc"])


def _hf(hf_dir: str, task: str, batch: int, limit=None):
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    lm = HFLM(pretrained=hf_dir, device="cpu", dtype="float32", batch_size=batch)
    manager = TaskManager(include_path=os.path.dirname(task), include_defaults=False)
    return _timed(lm, lambda: simple_evaluate(model=lm, tasks=[task], task_manager=manager, limit=limit,
                                              log_samples=False)["results"]["speed_mc"])


def main(argv) -> None:
    args = dict(DEFAULTS)
    for arg in argv:
        key, _, value = arg.partition("=")
        if key not in DEFAULTS:
            raise SystemExit(f"unknown argument {arg!r}: use {', '.join(f'{k}=' for k in DEFAULTS)}")
        args[key] = int(value)
    torch.set_num_threads(args["threads"])
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        rows, text = _corpus(args["examples"])
        task = _task(root, rows)
        ckpt, hf_dir = _checkpoint(root, args, text)
        runs = {"ours": lambda **k: _ours(ckpt, task, args["batch"], **k),
                "hf": lambda **k: _hf(hf_dir, task, args["batch"], **k)}
        for run in runs.values():
            run(limit=2)  # warm-up: imports, dataset cache, first allocations
        times = {name: [] for name in runs}
        for _ in range(args["rounds"]):  # alternating: a change in the machine's load hits both
            for name, run in runs.items():
                times[name].append(run())
        times = {name: min(results, key=lambda r: r[0]) for name, results in times.items()}
    print(f"{args['examples']} questions x 4 choices, {args['layers']} layers x hidden {args['hidden']}, "
          f"vocabulary {VOCAB}, batch {args['batch']}, {args['threads']} thread(s), float32, CPU")
    print(f"{'backend':<8}{'evaluate s':>12}{'model s':>10}{'acc':>8}")
    for name, (total, model_s, results) in times.items():
        print(f"{name:<8}{total:>12.2f}{model_s:>10.2f}{results['acc,none']:>8.3f}")
    (ours_total, ours_model, _), (hf_total, hf_model, _) = times["ours"], times["hf"]
    print(f"ours / hf: evaluate {ours_total / hf_total:.2f}, model {ours_model / hf_model:.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
