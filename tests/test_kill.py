"""Signals to a multi-rank run: every process of the run ends with its launcher, a stop request
saves first, a stopped rank cannot hang the run, and a run SIGKILLed twice resumes to
exactly the result of an uninterrupted one."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from pathlib import Path
from typing import List

import torch

from conftest import SMALL, launch_cmd, read_metrics, run_training

RUN = [*SMALL, "trainer.devices=2", "checkpoint.every_n_steps=1", "checkpoint.resume=auto"]


def run_pids(run_dir: Path) -> List[int]:
    """Processes whose command line names the run dir: the launcher (hydra.run.dir=...) and its
    workers (.../resolved_config.yaml)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if str(run_dir).encode() in f.read():
                        pids.append(int(entry))
            except OSError:
                continue
    return pids


def wait_gone(run_dir: Path, seconds: float) -> List[int]:
    deadline = time.monotonic() + seconds
    while (left := run_pids(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def start(run_dir: Path, env, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen(launch_cmd(*RUN, *overrides, f"hydra.run.dir={run_dir}"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)


def steps_saved(run_dir: Path) -> List[int]:
    ckpt = run_dir / "checkpoints"
    return sorted(int(p.name[5:]) for p in ckpt.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")) \
        if ckpt.exists() else []


def wait_for_step(run_dir: Path, proc: subprocess.Popen, above: int, timeout: float = 120) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if steps_saved(run_dir) and steps_saved(run_dir)[-1] > above:
            return True
        time.sleep(0.02)
    return False


def kill_all(run_dir: Path) -> None:
    for pid in run_pids(run_dir):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _final_weights(run_dir: Path) -> dict:
    from megatron_hydra.checkpoint.standalone import load_model

    _, _, model = load_model(str(run_dir / "checkpoints" / f"step_{steps_saved(run_dir)[-1]:07d}"))
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_second_signal_during_the_save_stops_at_once(tmp_path, env_no_launcher):
    # A first signal alone saves and exits 0: test_checkpoint_errors.py (SIGINT to two ranks, then
    # resume). Here steps are long enough (a larger model) that the second comes before the save.
    slow = ("model.hidden_size=256", "model.seq_length=256", "data.global_batch_size=32")
    run_dir = tmp_path / "run"
    proc = start(run_dir, env_no_launcher, "trainer.max_steps=100000", *slow)
    try:
        assert wait_for_step(run_dir, proc, 0), proc.stderr.read()[-3000:] if proc.poll() is not None else ""
        proc.send_signal(signal.SIGTERM)
        seen = []
        while not (seen and "every rank saves" in seen[-1]):  # the first one was taken
            seen.append(proc.stderr.readline())
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        err = "".join(seen) + err
    finally:
        kill_all(run_dir)
    assert "Traceback" not in err, err[-3000:]
    assert proc.returncode == 128 + signal.SIGINT, err[-3000:]
    assert [line for line in err.splitlines() if line.startswith("error: ")] == [
        err.strip().splitlines()[-1]] and "second SIGINT" in err
    assert wait_gone(run_dir, 5) == []


def test_a_stopped_rank_ends_the_run_within_the_collective_timeout(tmp_path, env_no_launcher):
    # tp=2: the tensor-parallel collectives run on a subgroup (its own process group, made with
    # new_group, even though it spans both ranks), not on the world group.
    run_dir = tmp_path / "run"
    proc = start(run_dir, env_no_launcher, "parallel=tp2", "trainer.max_steps=100000",
                 "trainer.collective_timeout_s=5")
    try:
        assert wait_for_step(run_dir, proc, 1)  # training is in its steady state
        rank1 = [pid for pid in run_pids(run_dir) if b"RANK=1\0" in Path(f"/proc/{pid}/environ").read_bytes()
                 and b"megatron_hydra.training.worker" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(rank1) == 1
        os.kill(rank1[0], signal.SIGSTOP)
        stopped = time.monotonic()
        _, err = proc.communicate(timeout=60)
        elapsed = time.monotonic() - stopped
    finally:
        kill_all(run_dir)
    assert proc.returncode == 1, err[-3000:]
    assert elapsed < 5 + 20, (elapsed, err[-1500:])  # the timeout, the agent's 5 s shutdown, slack
    assert [line for line in err.splitlines() if line.startswith("error: ")], err[-3000:]
    assert "Traceback" not in err
    assert wait_gone(run_dir, 5) == []


def test_sigkill_of_the_launcher_group_twice_resumes_bitwise(tmp_path, env_no_launcher):
    max_steps = 16
    steps = f"trainer.max_steps={max_steps}"
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    run_training([*RUN, steps], ref_dir)  # uninterrupted: the launch path, with forked workers
    rng = random.Random(21)
    for _ in range(2):
        proc = start(run_dir, env_no_launcher, steps)
        last = steps_saved(run_dir)[-1] if steps_saved(run_dir) else 0
        if wait_for_step(run_dir, proc, last):
            time.sleep(rng.uniform(0.0, 0.15))  # a random moment of training: mid-step or mid-save
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        assert proc.wait() in (0, -signal.SIGKILL), proc.stderr.read()[-3000:]
        left = wait_gone(run_dir, 5)
        kill_all(run_dir)
        assert left == [], f"processes of the run survived their launcher by 5 s: {left}"
    assert steps_saved(run_dir)[-1] < max_steps, "the run finished before the last kill"
    run_training([*RUN, steps], run_dir)  # resume=auto from the last kill's newest checkpoint, to the end
    want, got = _final_weights(ref_dir), _final_weights(run_dir)
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name
    ref_rows, rows = read_metrics(ref_dir), read_metrics(run_dir)
    assert [r["step"] for r in rows if "loss" in r] == [r["step"] for r in ref_rows if "loss" in r]
    assert [r["loss"] for r in rows if "loss" in r] == [r["loss"] for r in ref_rows if "loss" in r]
