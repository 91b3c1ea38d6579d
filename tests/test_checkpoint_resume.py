"""A run stopped at a checkpoint and resumed continues exactly, in the same or another layout.

The references are uninterrupted runs: the same run without the stop (bitwise, same layout), and
the original layout's own losses (resharded continuation, fp64 at 1e-9).
"""

from __future__ import annotations

import shutil

import pytest
import torch

from conftest import SMALL, assert_same_trajectory, run_training

# Stopped after 2 of 4 steps: two resumed steps show the continuation (the second one starts from
# state the resumed run produced itself).
STEPS = ["trainer.max_steps=4", "checkpoint.every_n_steps=2", "checkpoint.keep_last=0"]


def read_checkpoint(path, tmp_path):
    """Every tensor of a checkpoint, read back by DCP's own converter (not by our loader)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / f"{path.parent.parent.name}.pt"
    dcp_to_torch_save(str(path), str(out))
    return torch.load(out, weights_only=True)


def resume_from(ckpt, run_dir):
    """A fresh run dir whose checkpoint directory holds only ``ckpt`` (as after a stop there)."""
    shutil.copytree(ckpt, run_dir / "checkpoints" / ckpt.name)
    return run_dir


@pytest.mark.parametrize("layout", [
    ["trainer.devices=1"],
    ["trainer.devices=2"],
    ["parallel=tp2", "trainer.devices=2"],
    ["parallel=pp2", "trainer.devices=2"],
    ["parallel=tp2_pp2", "trainer.devices=4"],
], ids=["single", "dp2", "tp2", "pp2", "tp2_pp2"])
def test_resume_is_bitwise_exact(tmp_path, layout):
    full = run_training([*SMALL, *STEPS, *layout], tmp_path / "full")
    ckpts = tmp_path / "full" / "checkpoints"
    resumed_dir = resume_from(ckpts / "step_0000002", tmp_path / "resumed")
    resumed = run_training([*SMALL, *STEPS, *layout, "checkpoint.resume=auto"], resumed_dir)
    assert [r["step"] for r in resumed] == [2.0, 3.0]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full[2:]]
    assert [r["consumed_samples"] for r in resumed] == [r["consumed_samples"] for r in full[2:]]
    a = read_checkpoint(ckpts / "step_0000004", tmp_path)
    b = read_checkpoint(resumed_dir / "checkpoints" / "step_0000004", tmp_path)
    assert a.keys() == b.keys() and any(k.startswith("optim/") for k in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_resharded_continuation_matches_the_original_layout(tmp_path):
    common = [*SMALL, *STEPS, "precision=fp64"]
    original = run_training([*common, "parallel=tp2_pp2", "trainer.devices=8"], tmp_path / "orig")
    ckpt = tmp_path / "orig" / "checkpoints" / "step_0000002"
    for name, layout in (("single", ["trainer.devices=1"]), ("tp4", ["parallel=tp4", "trainer.devices=4"])):
        rows = run_training([*common, *layout, f"checkpoint.load={ckpt}", "checkpoint.every_n_steps=0",
                             "checkpoint.save_last=false"], tmp_path / name)  # nothing reads their checkpoints
        assert [r["step"] for r in rows] == [2.0, 3.0], name
        assert_same_trajectory(rows, original[2:], rel=1e-9, keys=("loss",))
