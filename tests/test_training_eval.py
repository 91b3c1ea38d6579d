"""Evaluations during training (``trainer.eval``, training/evaluation.py): short SMALL runs that
evaluate a local multiple-choice task every 2 steps, at tp1 and at tp2 with sequence parallelism.

The logged accuracy is checked against a naive reference on the checkpoint saved at the same
step (a whole model in one process, float64, every choice scored by a full forward over its UTF-8
bytes), the training losses bitwise against the same run without evaluation (dropout on, so a
random stream that the evaluation moved would show), and a failing evaluation (its task's data
file gone) is one warning line per evaluation while the run completes. The runs share one fixture.
"""

from __future__ import annotations

import json
import logging
import math
import re
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import SMALL, run_training, spawn_ranks

pytest.importorskip("lm_eval")

TASK = "tiny_mc"
EVERY = 2
# Dropout on: the evaluation must leave the random streams of the dropout masks as they were.
BASE = [*SMALL, "trainer.max_steps=4", "model.hidden_dropout=0.1", "model.attention_dropout=0.1",
        f"checkpoint.every_n_steps={EVERY}", "checkpoint.async_save=false", "trainer.eval.limit=12",
        "trainer.eval.batch_size=5"]
# float64 without dropout: tp2 + sequence parallelism trains as one process does, to 1e-9.
TP_BASE = [*SMALL, "precision=fp64", "trainer.max_steps=3", f"checkpoint.every_n_steps={EVERY}",
           "checkpoint.async_save=false", "trainer.eval.limit=12", "trainer.eval.batch_size=5"]
TP2 = ["parallel=tp2", "parallel.sequence_parallel=true", "trainer.devices=2"]
# Short byte strings (the SMALL model has 32 positions): "<a>+<b>=" and four candidate sums.
DOCS = [{"question": f"{a}+{b}=", "choices": [str(a + b + d) for d in (0, 1, -1, 2)], "answer": (a * 7 + b) % 4}
        for a, b in [(i % 5 + 1, i // 5 + 2) for i in range(12)]]


def _task(folder: Path, name: str, data: Path) -> Path:
    path = folder / f"{name}.yaml"
    path.write_text(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
                    "test_split: test\noutput_type: multiple_choice\ndoc_to_text: \"{{question}}\"\n"
                    "doc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{answer}}\"\n"
                    "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    return path


def _eval(task: Path):
    return [f"trainer.eval.tasks=[{task}]", f"trainer.eval.every_n_steps={EVERY}"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("training_eval")
    data = root / "mc.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    task = _task(root, TASK, data)
    # A task whose data file is gone: the launcher's check reads task files, not their data, so the
    # run starts and each evaluation fails.
    broken = _task(root, "gone", root / "gone.jsonl")
    dirs = {name: root / name for name in ("plain", "eval", "failing", "plain64", "tp2")}
    out = {"dirs": dirs, "plain": run_training(BASE, dirs["plain"]),
           "eval": run_training([*BASE, *_eval(task)], dirs["eval"])}
    with _warnings() as out["warnings"]:
        out["failing"] = run_training([*BASE, *_eval(broken)], dirs["failing"])
    out["plain64"] = run_training(TP_BASE, dirs["plain64"])
    out["tp2"] = run_training([*TP_BASE, *_eval(task), *TP2], dirs["tp2"])
    return out


@contextmanager
def _warnings():
    """The warning lines our logger emits meanwhile (a one-process run trains in this process)."""
    lines = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(f"{record.levelname}: {record.getMessage()}")
    logger = logging.getLogger("megatron_hydra")
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)


def reference_accuracy(checkpoint: Path) -> float:
    """lm-eval's multiple-choice accuracy, computed naively: each choice continues the question
    after a space; the choice whose bytes the model finds most likely (summed log-probabilities)
    is the answer."""
    from megatron_hydra.checkpoint.standalone import load_model

    _, _, model = load_model(str(checkpoint))
    model = model.double().eval()
    right = 0
    with torch.no_grad():
        for doc in DOCS:
            context = list(doc["question"].encode())
            scores = []
            for choice in doc["choices"]:
                continuation = list((" " + choice).encode())
                whole = torch.tensor([context + continuation])
                logp = torch.log_softmax(model(whole[:, :-1])[0].double(), dim=-1)
                scores.append(sum(float(logp[len(context) - 1 + k, t]) for k, t in enumerate(continuation)))
            right += max(range(len(scores)), key=scores.__getitem__) == doc["answer"]
    return right / len(DOCS)


def _losses(rows):
    return [(r["step"], r["loss"], r["grad_norm"]) for r in rows if "loss" in r]


def _eval_rows(rows):
    return {int(r["step"]): r[f"eval/{TASK}/acc"] for r in rows if f"eval/{TASK}/acc" in r}


def test_accuracy_logged_at_its_steps_equals_the_reference(runs):
    rows, ckpts = runs["eval"], runs["dirs"]["eval"] / "checkpoints"
    # Evaluated after steps 2 and 4: rows 1 and 3 (the step column counts from 0, as the loss's).
    logged = _eval_rows(rows)
    assert sorted(logged) == [1, 3]
    for row, step in ((1, 2), (3, 4)):
        assert logged[row] == reference_accuracy(ckpts / f"step_{step:07d}")
    assert all(f"eval/{TASK}/acc_stderr" in r for r in rows if f"eval/{TASK}/acc" in r)
    results = json.loads((runs["dirs"]["eval"] / "eval" / "step_0000004" / "results.json").read_text())
    assert results["results"][TASK]["acc,none"] == logged[3]


def test_training_is_unchanged_by_evaluation(runs):
    assert _losses(runs["eval"]) == _losses(runs["plain"])  # bitwise: dropout draws included
    assert _losses(runs["failing"]) == _losses(runs["plain"])


def test_a_failing_evaluation_is_one_line_and_training_goes_on(runs):
    rows = runs["failing"]
    assert not any(k.startswith("eval/") for r in rows for k in r)
    assert max(r["step"] for r in rows) == 3  # every step trained
    failures = [line for line in runs["warnings"] if "eval at step" in line]
    assert len(failures) == 2, runs["warnings"]
    for line, step in zip(failures, (2, 4)):
        pattern = rf"WARNING: eval at step {step} failed: [^\n]*gone\.jsonl[^\n]*; training goes on"
        assert re.fullmatch(pattern, line), line
    assert (runs["dirs"]["failing"] / "checkpoints" / "step_0000004").is_dir()


def test_tensor_parallel_run_evaluates_its_own_model_and_trains_on(runs):
    """tp2 with sequence parallelism (which the engine switches off while it runs): every rank
    evaluates the live shards after step 2, and step 3 trains as the single process does."""
    logged = _eval_rows(runs["tp2"])
    assert list(logged) == [1]
    assert logged[1] == reference_accuracy(runs["dirs"]["tp2"] / "checkpoints" / "step_0000002")
    ours, ref = _losses(runs["tp2"]), _losses(runs["plain64"])
    assert [r[0] for r in ours] == [r[0] for r in ref] == [0, 1, 2]
    for (_, loss, norm), (_, ref_loss, ref_norm) in zip(ours, ref):
        assert loss == pytest.approx(ref_loss, rel=1e-9) and norm == pytest.approx(ref_norm, rel=1e-9)


def _agree_ranks(rank: int, world: int):
    """Rank 1's evaluation raises, rank 0's succeeds: both hear of the failure (no rank is left
    waiting), and training state is restored on both."""
    from megatron_hydra.training.evaluation import EvalCallback

    cfg = SimpleNamespace(trainer=SimpleNamespace(eval=SimpleNamespace(every_n_steps=1), collective_timeout_s=60))
    callback = EvalCallback(cfg, SimpleNamespace(), SimpleNamespace(rank=rank))
    callback.on_train_start(None, None)

    def evaluate(pl_module, step):
        torch.manual_seed(0)  # as lm-eval does
        pl_module.model.eval()  # as the engine does
        if rank == 1:
            raise RuntimeError(f"no data at step {step}\nsecond line")
        return {TASK: {"acc,none": 0.5}}

    callback._evaluate = evaluate
    warnings = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("megatron_hydra").addHandler(handler)
    model = torch.nn.Dropout(0.5)
    state = torch.get_rng_state()
    result = callback.run(SimpleNamespace(loggers=[], current_epoch=0), SimpleNamespace(model=model), 7)
    restored = torch.equal(torch.get_rng_state(), state) and model.training
    line = callback._agree("same")
    callback.teardown(None, None, "fit")
    return result, callback.failures, restored, line, warnings


def test_ranks_agree_on_a_failure_of_one_rank():
    results = spawn_ranks(_agree_ranks, 2)
    for rank in (0, 1):
        result, failures, restored, line, warnings = results[rank]
        assert result is None and failures == [7] and restored
        assert line == "same"  # every rank failed alike: the line without a rank
    assert results[0][4] == ["eval at step 7 failed: rank 1: RuntimeError: no data at step 7; training goes on"]
    assert results[1][4] == []  # only rank 0 talks


def test_metric_names():
    from megatron_hydra.training.evaluation import eval_metrics, metric_name

    assert metric_name("acc,none") == "acc" and metric_name("exact_match,strict-match") == "exact_match/strict-match"
    metrics = eval_metrics({"t": {"acc,none": 1, "acc_stderr,none": "N/A", "alias": "t", "sample_len": 12,
                                  "flag,none": True, "ppl,none": math.inf, "exact_match,strict-match": 0.25}})
    assert metrics == {"eval/t/acc": 1.0, "eval/t/ppl": math.inf, "eval/t/exact_match/strict-match": 0.25}


def test_report_plots_the_evaluations(runs):
    from conftest import read_metrics
    from megatron_hydra import report

    run = runs["dirs"]["eval"]
    paths = report.report(str(run))
    png = run / "report" / "eval.png"
    assert str(png) in paths and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    job = report.Job(str(run), report.read_metrics(str(run / "csv" / "metrics.csv")))
    assert report.eval_keys([job]) == [f"eval/{TASK}/acc"]
    seq_length = 32  # SMALL's model.seq_length; 8 samples per step
    expected = [((r["step"] + 1) * 8 * seq_length, r[f"eval/{TASK}/acc"], r[f"eval/{TASK}/acc_stderr"])
                for r in read_metrics(run) if f"eval/{TASK}/acc" in r]
    assert report.eval_series(job, f"eval/{TASK}/acc", report.tokens_by_step(job)) == expected
    assert len(expected) == 2
    plain = runs["dirs"]["plain"]
    assert report.eval_keys([report.Job(str(plain), report.read_metrics(str(plain / "csv" / "metrics.csv")))]) == []
