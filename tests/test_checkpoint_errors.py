"""Bad checkpoints fail in one line before workers start; interrupted saves are ignored; a signal
saves and stops cleanly, and the next run continues from there."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time

import pytest

from conftest import SMALL, compose_config, launch_cmd, preflight_error, run_training
from megatron_hydra.errors import CheckpointError


@pytest.fixture
def ckpt(small_checkpoint):
    return small_checkpoint


def test_missing_path(tmp_path):
    message = preflight_error(tmp_path, f"checkpoint.load={tmp_path / 'nope'}")
    assert "nope" in message and "no such file" in message


def test_not_a_checkpoint(tmp_path, ckpt):
    (tmp_path / "empty").mkdir()
    assert "is not a checkpoint" in preflight_error(tmp_path, f"checkpoint.load={tmp_path / 'empty'}")
    # The checkpoints directory instead of one checkpoint: the message names the one inside.
    message = preflight_error(tmp_path, f"checkpoint.load={ckpt.parent}")
    assert "is not a checkpoint" in message and "step_0000002" in message


def test_incomplete(tmp_path, ckpt):
    partial = tmp_path / "step_0000002"
    shutil.copytree(ckpt, partial)
    (partial / "COMPLETE").unlink()
    message = preflight_error(tmp_path, f"checkpoint.load={partial}")
    assert "incomplete" in message and "step_0000002" in message


def test_shape_mismatch_names_the_tensor_and_both_shapes(tmp_path, ckpt):
    message = preflight_error(tmp_path, f"checkpoint.load={ckpt}", "model.hidden_size=128")
    assert "embedding.weight" in message and "[500, 64]" in message and "[500, 128]" in message


def test_worker_side_shape_check_reads_the_tensor_files(ckpt):
    """The same check without the metadata file: the loader reads DCP's own metadata."""
    from megatron_hydra.checkpoint.sharded import load
    from megatron_hydra.config import derive
    from megatron_hydra.parallel.state import ParallelState
    from megatron_hydra.training.module import LMModule

    cfg = compose_config([*SMALL, "model.num_layers=3"])
    module = LMModule(cfg, derive(cfg), ParallelState.single())
    with pytest.raises(CheckpointError, match="no tensor layers.2"):
        load(str(ckpt), module.model, None, module.ps, 500)


def _model_only_copy(ckpt, dest):
    """A genuine weights-only checkpoint of the same model."""
    from megatron_hydra.checkpoint.sharded import save
    from megatron_hydra.config import derive
    from megatron_hydra.parallel.state import ParallelState
    from megatron_hydra.training.module import LMModule

    meta = json.loads((ckpt / "meta.json").read_text())
    cfg = compose_config(SMALL)
    module = LMModule(cfg, derive(cfg), ParallelState.single())
    save(str(dest), module.model, None, module.ps, 500, {k: v for k, v in meta.items() if k != "has_optimizer"})


def test_optimizer_state_missing_names_the_flag(tmp_path, ckpt):
    weights = tmp_path / "weights" / "step_0000002"
    _model_only_copy(ckpt, weights)
    assert "checkpoint.load_optimizer=false" in preflight_error(tmp_path, f"checkpoint.load={weights}")
    rows = run_training([*SMALL, "trainer.max_steps=3", f"checkpoint.load={weights}", "checkpoint.load_optimizer=false"],
                        tmp_path / "ok")
    assert [r["step"] for r in rows] == [2.0]


def test_interrupted_saves_are_ignored(tmp_path, ckpt):
    """A save killed mid-write leaves a .tmp dir (or, killed mid-rename, a dir without the marker):
    resume=auto takes the newest complete checkpoint and continues from it."""
    from megatron_hydra.checkpoint import store

    root = tmp_path / "run" / "checkpoints"
    shutil.copytree(ckpt, root / ckpt.name)
    shutil.copytree(ckpt, root / "step_0000003.tmp")
    shutil.copytree(ckpt, root / "step_0000004")
    (root / "step_0000004" / "COMPLETE").unlink()
    assert store.latest(str(root)) == str(root / ckpt.name)
    rows = run_training([*SMALL, "trainer.max_steps=3"], tmp_path / "run")
    assert [r["step"] for r in rows] == [2.0]
    assert store.is_complete(str(root / "step_0000003"))


def test_keep_last_retains_the_newest(tmp_path):
    run_training([*SMALL, "trainer.max_steps=4", "checkpoint.every_n_steps=1", "checkpoint.keep_last=2"], tmp_path)
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_0000003", "step_0000004"]


def _wait_for(path, text, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists() and text in path.read_text():
            return
        time.sleep(0.2)
    raise AssertionError(f"{text!r} never appeared in {path}")


# SIGUSR1 on several ranks is test_cluster_launch.py's warning-signal test (save, then requeue), and
# a second signal during the save test_kill.py's. Ctrl-C of a two-rank run: every rank saves, exit 0.
@pytest.mark.parametrize("sig,devices", [(signal.SIGINT, 2)], ids=["sigint_2ranks"])
def test_signal_saves_and_stops_then_resume_continues(tmp_path, env_no_launcher, sig, devices):
    common = [*SMALL, "optim.decay_steps=5000", f"trainer.devices={devices}", "checkpoint.every_n_steps=0"]
    log = tmp_path / "out.txt"
    with open(log, "w") as out:
        proc = subprocess.Popen(launch_cmd(*common, "trainer.max_steps=5000", f"hydra.run.dir={tmp_path}"),
                                stdout=out, stderr=subprocess.STDOUT, env=env_no_launcher)
        try:
            _wait_for(log, "training starts at step 0")
            time.sleep(1)  # a few steps, and every rank past its own start
            proc.send_signal(sig)
            assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
        finally:
            proc.kill()
    text = log.read_text()
    assert "stop requested by signal: saved step" in text and "Traceback" not in text, text[-3000:]
    saved = sorted((tmp_path / "checkpoints").glob("step_*"))
    assert len(saved) == 1 and saved[0].name.startswith("step_"), saved
    step = int(saved[0].name.split("_")[1])
    assert 0 < step < 5000
    rows = run_training([*common, f"trainer.max_steps={step + 2}"], tmp_path)
    steps = [r["step"] for r in rows]  # the metric history of both runs, each step once
    assert steps[-2:] == [float(step), float(step + 1)] and len(steps) == len(set(steps))
