"""Stopping and failing a one-process run (``python launch.py``, the default): it trains in the
launching process, and must answer Ctrl-C and its own failures as a multi-rank run does. The first
SIGINT saves at the next step boundary and exits 0; a second one stops at once, exit 130; an error
that is not one of ours is one line naming ``rank0.error``. Multi-rank stops: test_kill.py and
test_checkpoint_errors.py."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from conftest import SMALL, launch_cmd, launch_py, run_training

NOTICE = ("SIGINT: every rank saves a checkpoint at the next step boundary and stops "
          "(send SIGINT again to stop at once, without saving)")
LONG = [*SMALL, "trainer.max_steps=5000", "optim.decay_steps=5000", "checkpoint.every_n_steps=0"]


def _start(run_dir: Path, env, *overrides: str) -> subprocess.Popen:
    out, err = open(run_dir.parent / "stdout.txt", "w"), open(run_dir.parent / "stderr.txt", "w")
    with out, err:
        return subprocess.Popen(launch_cmd(*LONG, *overrides, f"hydra.run.dir={run_dir}"), stdout=out, stderr=err,
                                env=env, start_new_session=True)


def _wait_for(proc: subprocess.Popen, path: Path, text: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if path.exists() and text in path.read_text():
            return
        time.sleep(0.05)
    raise AssertionError(f"{text!r} never appeared in {path.name} (exit {proc.poll()}): {path.read_text()[-2000:]}")


def _end(proc: subprocess.Popen) -> int:
    try:
        return proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _steps(ckpt: Path):
    return sorted(p.name for p in ckpt.glob("step_*")) if ckpt.exists() else []


def test_ctrl_c_saves_at_the_next_step_and_exits_0(tmp_path, env_no_launcher):
    run_dir = tmp_path / "run"
    proc = _start(run_dir, env_no_launcher)
    try:
        _wait_for(proc, tmp_path / "stdout.txt", "training starts at step 0")
        time.sleep(0.5)  # a few steps
        proc.send_signal(signal.SIGINT)
    finally:
        code = _end(proc)
    err = (tmp_path / "stderr.txt").read_text()
    assert code == 0, err[-3000:]
    assert "Traceback" not in err and "error:" not in err, err[-3000:]
    assert NOTICE in err.splitlines(), err[-3000:]
    saved = _steps(run_dir / "checkpoints")
    assert len(saved) == 1 and (run_dir / "checkpoints" / saved[0] / "COMPLETE").is_file(), saved
    assert 0 < int(saved[0][5:]) < 5000


def test_a_second_ctrl_c_stops_at_once_with_status_130(tmp_path, env_no_launcher):
    # Steps of about a second, so the second SIGINT lands before the step the first one waits for ends.
    run_dir = tmp_path / "run"
    proc = _start(run_dir, env_no_launcher, "model.hidden_size=256", "model.seq_length=256",
                  "data.global_batch_size=32")
    try:
        _wait_for(proc, tmp_path / "stdout.txt", "training starts at step 0")
        proc.send_signal(signal.SIGINT)
        _wait_for(proc, tmp_path / "stderr.txt", NOTICE, timeout=30)  # the first one was taken
        proc.send_signal(signal.SIGINT)
    finally:
        code = _end(proc)
    err = (tmp_path / "stderr.txt").read_text()
    assert code == 128 + signal.SIGINT, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert errors == [err.strip().splitlines()[-1]] and "second SIGINT" in errors[0], err[-3000:]


def test_a_failure_that_is_not_ours_is_one_line_naming_rank0_error(tmp_path, env_no_launcher, monkeypatch, capfd):
    from megatron_hydra.training import train

    def fail(*args, **kwargs):
        raise RuntimeError("injected failure\nwith a second line")

    monkeypatch.setattr(train, "_train", fail)
    run_dir = tmp_path / "run"
    code = launch_py([*SMALL, "trainer.max_steps=2", f"hydra.run.dir={run_dir}"], env_no_launcher)
    err = capfd.readouterr().err
    assert code == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: rank 0 failed: RuntimeError: injected failure (traceback: {run_dir}/rank0.error)"], err
    report = (run_dir / "rank0.error").read_text()
    assert report.startswith("RuntimeError: injected failure\n") and "Traceback" in report and "in fail" in report


def test_ctrl_c_while_the_model_is_built_saves_at_the_first_step(tmp_path, monkeypatch, capfd):
    # The request is kept until training starts, as a spawned worker holds an early SIGTERM.
    from megatron_hydra.training import train

    built = train.LMModule

    def interrupted_build(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        return built(*args, **kwargs)

    monkeypatch.setattr(train, "LMModule", interrupted_build)
    before = signal.getsignal(signal.SIGINT)
    try:
        rows = run_training([*SMALL, "trainer.max_steps=50"], tmp_path)
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C during the model build reached the run as a KeyboardInterrupt")
    assert NOTICE in capfd.readouterr().err.splitlines()
    assert [r["step"] for r in rows if "loss" in r] == [0.0]  # one step trained, then saved and stopped
    assert _steps(tmp_path / "checkpoints") == ["step_0000001"]
    assert (tmp_path / "checkpoints" / "step_0000001" / "COMPLETE").is_file()
    assert signal.getsignal(signal.SIGINT) is before  # handed back after the run


def test_ctrl_c_before_training_is_one_line_with_status_130(tmp_path, monkeypatch):
    from conftest import compose_config
    from megatron_hydra import launcher

    def preparing(*args):
        raise KeyboardInterrupt  # what Ctrl-C raises while the data are prepared

    monkeypatch.setattr(launcher, "preflight", preparing)
    try:
        with pytest.raises(launcher.Interrupted) as stopped:
            launcher.run(compose_config([*SMALL, "trainer.max_steps=2"], str(tmp_path)))
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C before training left the launcher as a KeyboardInterrupt (a traceback)")
    assert stopped.value.exit_code == 128 + signal.SIGINT
    assert "\n" not in str(stopped.value) and "SIGINT" in str(stopped.value)


class _HandlerOfSigint(torch.utils.data.Dataset):
    """What SIGINT does in the DataLoader worker that reads the item."""

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> bool:
        return signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def test_loader_workers_leave_ctrl_c_to_the_training_process():
    """In a one-process run the loader workers share the terminal's process group: a Ctrl-C that
    ended one would fail the step that saves. Our loaders' workers ignore SIGINT."""
    from conftest import compose_config
    from megatron_hydra.config import derive
    from megatron_hydra.parallel.state import ParallelState
    from megatron_hydra.training.train import build_dataloaders

    cfg = compose_config([*SMALL, "data.num_workers=1"])
    train_loader, _ = build_dataloaders(cfg, derive(cfg), ParallelState.single())
    assert train_loader.worker_init_fn is not None
    probe = torch.utils.data.DataLoader(_HandlerOfSigint(), num_workers=1, worker_init_fn=train_loader.worker_init_fn)
    assert next(iter(probe)).tolist() == [True]
