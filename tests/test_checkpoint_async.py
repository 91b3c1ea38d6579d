"""Asynchronous saves (``checkpoint.async_save``): the same run as synchronous saves, one save in
flight at a time, failures raised at the next wait, and a kill mid-write costs only that save.

References: the same run with ``checkpoint.async_save=false`` (losses and checkpoint tensors
bitwise, the tensors read back by DCP's own converter), and the staged values against clones taken
before the originals were changed.
"""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path
from unittest import mock

import pytest
import torch

from conftest import SMALL, assert_same_trajectory, read_metrics, run_training
from megatron_hydra.checkpoint import store
from megatron_hydra.checkpoint.async_save import BackgroundWriter, HostStager
from megatron_hydra.errors import CheckpointError


# The background writer -------------------------------------------------------------------------
def test_one_save_in_flight_and_a_failure_is_raised_once_as_one_line():
    writer, spans = BackgroundWriter(), []

    def slow(name):
        def run():
            begin = time.monotonic()
            time.sleep(0.2)
            spans.append((name, begin, time.monotonic()))
        return run

    writer.submit("a", slow("a"))
    assert writer.in_flight
    writer.submit("b", slow("b"))  # waits for "a" first
    writer.wait()
    (_, _, end_a), (_, begin_b, _) = spans
    assert begin_b >= end_a

    writer.submit("/ckpt/step_0000007", lambda: (_ for _ in ()).throw(OSError("No space left on device\ndetail")))
    with pytest.raises(CheckpointError) as e:
        writer.submit("/ckpt/step_0000008", lambda: None)  # the next save's wait raises it
    assert "\n" not in str(e.value) and "/ckpt/step_0000007" in str(e.value) and "No space left" in str(e.value)
    writer.wait()  # raised once, not again

    refused = CheckpointError("refused to save x: y holds NaN or inf")
    writer.submit("x", lambda: (_ for _ in ()).throw(refused))
    with pytest.raises(CheckpointError) as e:
        writer.wait()
    assert e.value is refused


# Staging -----------------------------------------------------------------------------------------
def test_staging_copies_tensors_and_chunks_into_reused_buffers():
    from megatron_hydra.checkpoint.chunks import Chunks, Placement

    plain = torch.arange(6.0).reshape(2, 3)
    local = torch.arange(12.0).reshape(3, 4)  # a TP shard, written as its rows 1..2 (a flat range)
    sd = {"plain": plain, "chunks": Chunks.of(Placement((6, 4), (3, 4), 0, 3), local.reshape(-1)[4:], 4)}
    before = {"plain": plain.clone(), "chunks": [t.clone() for t in sd["chunks"].local_tensors()]}
    stager = HostStager()
    staged = stager.stage(sd)
    for t in (plain, local):  # training goes on changing its tensors
        t.add_(100)
    assert torch.equal(staged["plain"], before["plain"])
    assert isinstance(staged["chunks"], Chunks)
    assert [o for o, _ in staged["chunks"].parts] == [o for o, _ in sd["chunks"].parts] == [(4, 0)]
    assert all(torch.equal(a, b) for a, b in zip(staged["chunks"].local_tensors(), before["chunks"]))
    again = stager.stage(sd)  # the next save (the previous one written by then) reuses the buffers
    assert again["plain"].data_ptr() == staged["plain"].data_ptr() and torch.equal(again["plain"], plain)
    assert again["chunks"].local_tensors()[0].data_ptr() == staged["chunks"].local_tensors()[0].data_ptr()


# Whole runs -------------------------------------------------------------------------------------
def read_checkpoint(path, out):
    """Every tensor of a checkpoint, read back by DCP's own converter (not by our loader)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(path), str(out))
    return torch.load(out, weights_only=True)


def test_async_and_sync_saves_give_the_same_run_and_checkpoints(tmp_path):
    common = [*SMALL, "parallel=tp2", "trainer.devices=2", "trainer.max_steps=3", "checkpoint.every_n_steps=1",
              "checkpoint.keep_last=0"]
    sync = run_training([*common, "checkpoint.async_save=false"], tmp_path / "sync")
    async_ = run_training(common, tmp_path / "async")  # the default
    assert_same_trajectory(async_, sync, rel=0)
    for step in range(1, 4):  # every save complete when the run returns: the end waited
        path = tmp_path / "async" / "checkpoints" / f"step_{step:07d}"
        assert store.is_complete(path), path
    name = "checkpoints/step_0000003"
    a = read_checkpoint(tmp_path / "sync" / name, tmp_path / "a.pt")
    b = read_checkpoint(tmp_path / "async" / name, tmp_path / "b.pt")
    assert a.keys() == b.keys() and any(k.startswith("optim/") for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key


RUN = [*SMALL, "trainer.devices=1", "checkpoint.every_n_steps=1", "checkpoint.resume=auto", "trainer.max_steps=6"]
STUCK_STEP = 3


def _run_with_a_stuck_commit(run_dir: Path) -> None:
    """A run whose background write of step ``STUCK_STEP`` never commits (a very slow disk)."""
    real = store.commit

    def commit(final):
        if final.endswith(f"step_{STUCK_STEP:07d}"):
            (run_dir / "stuck").write_text("")
            time.sleep(300)
        real(final)

    with mock.patch.object(store, "commit", commit):
        run_training(RUN, run_dir)


def test_sigkill_mid_write_keeps_the_previous_checkpoint_and_resumes_bitwise(tmp_path):
    ref = run_training([*RUN, "checkpoint.async_save=false"], tmp_path / "ref")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    proc = multiprocessing.get_context("forkserver").Process(target=_run_with_a_stuck_commit, args=(run_dir,))
    proc.start()
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "stuck").exists() and proc.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert (run_dir / "stuck").exists(), f"the write of step {STUCK_STEP} never began (exit code {proc.exitcode})"
        time.sleep(0.5)  # training reaches the next save, which must wait for the stuck one
        ckpts = run_dir / "checkpoints"
        assert not list(ckpts.glob(f"step_{STUCK_STEP + 1:07d}*")), "a second save started while one was in flight"
    finally:
        proc.kill()
        proc.join()
    assert store.latest(str(ckpts)) == str(ckpts / f"step_{STUCK_STEP - 1:07d}")
    assert (ckpts / f"step_{STUCK_STEP:07d}.tmp").is_dir()
    resumed = run_training(RUN, run_dir)  # async, resume=auto: from the step before the stuck one
    assert resumed and resumed[-1]["step"] == 5
    assert not list(ckpts.glob("*.tmp"))  # store.clean removed the interrupted save
    assert_same_trajectory(read_metrics(run_dir), ref, rel=0)
    a = read_checkpoint(tmp_path / "ref" / "checkpoints" / "step_0000006", tmp_path / "a.pt")
    b = read_checkpoint(ckpts / "step_0000006", tmp_path / "b.pt")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_a_writer_failure_in_a_run_stops_it_with_one_line(tmp_path, monkeypatch):
    def failing(final):
        raise OSError(f"[Errno 28] No space left on device: '{final}'")

    monkeypatch.setattr(store, "commit", failing)
    with pytest.raises(CheckpointError) as e:
        run_training([*SMALL, "trainer.devices=1", "trainer.max_steps=2", "checkpoint.every_n_steps=1"],
                     tmp_path / "run")
    assert "\n" not in str(e.value) and "No space left" in str(e.value) and "step_0000001" in str(e.value)
    assert store.latest(str(tmp_path / "run" / "checkpoints")) is None
