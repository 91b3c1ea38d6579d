"""``python -m megatron_hydra.report``: plots and the table of a sweep.

``check_report`` is run on a real two-job multirun by test_launcher.py's multirun test (which
already pays for the sweep); here the ranking by validation loss, the labels and the errors are
checked on metric files written by hand.
"""

from __future__ import annotations

import builtins
import csv
from pathlib import Path
from unittest import mock

import pytest

from conftest import read_metrics
from megatron_hydra import report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def table_rows(text: str):
    """The table's data rows as lists of cells (header and separator dropped)."""
    lines = [line for line in text.splitlines() if line.startswith("|")][2:]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]


def check_report(sweep_dir: Path, seq_length: int) -> str:
    """The report of a sweep of two jobs that differ in optim.lr only (and did not validate):
    two PNGs, and a table whose numbers are the jobs' CSVs', best final loss first."""
    out = sweep_dir / "plots"
    assert report.main([str(sweep_dir), "--out", str(out)]) == 0
    for name in ("loss.png", "throughput.png"):
        assert (out / name).read_bytes()[:8] == PNG_SIGNATURE
    text = (out / "summary.md").read_text()
    rows = table_rows(text)
    expected = []
    for job in ("0", "1"):
        metrics = read_metrics(sweep_dir / job)
        expected.append((metrics[-1]["loss"], job, metrics))
    expected.sort()
    assert [row[0] for row in rows] == ["1", "2"]
    for row, (loss, job, metrics) in zip(rows, expected):
        name, label = row[1].split(" ", 1)
        assert name == job and label.startswith("optim.lr=") and " " not in label  # the one differing override
        assert float(row[2]) == pytest.approx(loss, abs=1e-4) and row[3] == ""  # no validation
        assert int(row[4]) == metrics[-1]["step"] + 1
        assert float(row[5]) == metrics[-1]["consumed_samples"] * seq_length
        assert float(row[8]) == pytest.approx(max(m["peak_memory_gib"] for m in metrics), abs=1e-3)
    return text


def _job(root: Path, name: str, rows, overrides=None, seq_length: int = 16) -> Path:
    job = root / name
    (job / "csv").mkdir(parents=True)
    keys = sorted({k for r in rows for k in r})
    with open(job / "csv" / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, keys)
        writer.writeheader()
        writer.writerows(rows)
    (job / "resolved_config.yaml").write_text(f"model:\n  seq_length: {seq_length}\noptim:\n  lr: {name}\nrun_dir: {job}\n")
    if overrides is not None:
        (job / ".hydra").mkdir()
        (job / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    return job


def _train(step, loss, samples):
    return {"step": step, "loss": loss, "consumed_samples": samples, "tokens_per_s": 100.0 + step, "mfu": 1.5}


def test_ranks_by_final_validation_loss_and_labels_by_differing_overrides(tmp_path):
    # Job 0 trains to the lower loss but validates worse: validation decides.
    _job(tmp_path, "0", [_train(0, 5.0, 4), _train(1, 3.0, 8), {"step": 1, "val_loss": 4.5}],
         ["optim.lr=0.1", "trainer.max_steps=2"])
    _job(tmp_path, "1", [_train(0, 5.0, 4), _train(1, 3.5, 8), {"step": 1, "val_loss": 4.0}],
         ["optim.lr=0.01", "trainer.max_steps=2"])
    assert report.main([str(tmp_path)]) == 0
    rows = table_rows((tmp_path / "report" / "summary.md").read_text())
    assert [r[1] for r in rows] == ["1 optim.lr=0.01", "0 optim.lr=0.1"]
    assert [(r[2], r[3], r[5], r[6], r[7]) for r in rows] == [("3.5000", "4.0000", "128", "100.5", "1.50"),
                                                            ("3.0000", "4.5000", "128", "100.5", "1.50")]


def test_labels_from_the_saved_configs_without_hydra_overrides(tmp_path):
    _job(tmp_path, "0", [_train(0, 2.0, 4)])
    _job(tmp_path, "1", [_train(0, 1.0, 4)])
    assert report.labels([str(tmp_path / "0"), str(tmp_path / "1")]) == ["optim.lr=0", "optim.lr=1"]


def test_single_run_and_bad_paths(tmp_path, capsys):
    run = _job(tmp_path, "run", [_train(0, 2.0, 4), _train(1, 1.5, 8)])
    assert report.main([str(run)]) == 0
    assert (run / "report" / "loss.png").read_bytes()[:8] == PNG_SIGNATURE
    capsys.readouterr()
    for bad in (tmp_path / "missing", tmp_path / "run" / "csv"):
        assert report.main([str(bad)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"error: {bad}")


def test_missing_matplotlib_is_one_line_with_the_pip_fix(tmp_path, capsys):
    run = _job(tmp_path, "run", [_train(0, 2.0, 4)])
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    with mock.patch.object(builtins, "__import__", no_matplotlib):
        assert report.main([str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install '.[report]'" in err
    assert not (run / "report").exists()
