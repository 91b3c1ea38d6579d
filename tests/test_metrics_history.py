"""Resuming into the same run directory continues the metric history: every step once.

The reference is the first run's own history: the steps before the resume point stay as they
were logged, and the steps the resumed run repeats (resume is bitwise exact) log the same values.
TensorBoard's events are read back with TensorBoard's own EventAccumulator.
"""

from __future__ import annotations

import shutil

import pytest

from conftest import SMALL, run_training

COMMON = [*SMALL, "trainer.log_every_n_steps=1", "checkpoint.every_n_steps=2", "checkpoint.keep_last=0",
          "checkpoint.resume=auto", "trainer.val_check_interval=2", "trainer.limit_val_batches=1"]


def _train_steps(rows):
    return [int(r["step"]) for r in rows if "loss" in r]


def _tensorboard_steps(run_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_resume_appends_to_csv_and_tensorboard_history(tmp_path):
    from megatron_hydra.launcher import final_validation_loss

    run_dir = tmp_path / "run"
    first = run_training([*COMMON, "trainer.max_steps=4"], run_dir)
    assert _train_steps(first) == [0, 1, 2, 3]
    # A preemption after the checkpoint of step 2, once steps 2 and 3 were logged (and a row torn
    # by the kill): the resumed run starts at step 2 and must log steps 2 and 3 once more.
    shutil.rmtree(run_dir / "checkpoints" / "step_0000004")
    with open(run_dir / "csv" / "metrics.csv", "a") as f:
        f.write("40.0,0,1.5,5.9")
    run_training([*COMMON, "trainer.max_steps=6"], run_dir)
    rows = run_training([*COMMON, "trainer.max_steps=8"], run_dir)  # a second resume, from step 6

    assert _train_steps(rows) == list(range(8))
    assert [int(r["step"]) for r in rows if "val_loss" in r] == [1, 3, 5, 7]
    by_step = {int(r["step"]): r["loss"] for r in rows if "loss" in r}
    assert [by_step[s] for s in range(4)] == [r["loss"] for r in first if "loss" in r]
    last_val = max((r for r in rows if "val_loss" in r), key=lambda r: r["step"])["val_loss"]
    assert final_validation_loss(str(run_dir)) == last_val

    events = _tensorboard_steps(run_dir, "loss")
    assert [s for s, _ in events] == list(range(8))
    assert [v for _, v in events] == pytest.approx([by_step[s] for s in range(8)], rel=1e-6)
    assert [s for s, _ in _tensorboard_steps(run_dir, "val_loss")] == [1, 3, 5, 7]


def test_fresh_start_in_a_reused_directory_starts_an_empty_history(tmp_path):
    run_dir = tmp_path / "run"
    run_training([*SMALL, "trainer.max_steps=3", "trainer.log_every_n_steps=1"], run_dir)
    shutil.rmtree(run_dir / "checkpoints")
    rows = run_training([*SMALL, "trainer.max_steps=2", "trainer.log_every_n_steps=1"], run_dir)
    assert _train_steps(rows) == [0, 1]
    assert [s for s, _ in _tensorboard_steps(run_dir, "loss")] == [0, 1]
