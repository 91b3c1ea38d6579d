"""The non-finite guard: a NaN/inf loss or gradient norm stops the run in one line naming the step,
a checkpoint holding NaN/inf is never written, so retention never deletes the last good one; fp16's
skipped overflow steps go on as before."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import SMALL, compose_config, read_metrics, run_training
from megatron_hydra.errors import CheckpointError, MegatronHydraError

DIVERGE = [*SMALL, "optim.lr=1e30", "trainer.max_steps=4", "checkpoint.every_n_steps=1", "checkpoint.keep_last=2"]


def _all_finite(path) -> bool:
    """Every tensor stored in the checkpoint, read with DCP itself (not our loader)."""
    import torch.distributed.checkpoint as dcp

    from megatron_hydra.checkpoint.safe_reader import read_metadata

    metadata = read_metadata(str(path)).state_dict_metadata
    tensors = {k: torch.empty(list(v.size), dtype=v.properties.dtype) for k, v in metadata.items()}
    dcp.load(tensors, checkpoint_id=str(path), no_dist=True)
    return all(bool(torch.isfinite(t).all()) for t in tensors.values())


def test_divergence_stops_in_one_line_and_keeps_the_good_checkpoint(tmp_path):
    # lr=1e30: step 0 is finite, its update blows the weights up, step 1's loss is NaN.
    with pytest.raises(MegatronHydraError) as err:
        run_training(DIVERGE, tmp_path)
    message = str(err.value)
    assert "\n" not in message and "diverged at step 1" in message and "nan" in message
    assert [r["step"] for r in read_metrics(tmp_path)] == [0.0]  # nothing logged from the NaN step on
    saved = sorted((tmp_path / "checkpoints").glob("step_*"))
    assert [p.name for p in saved] == ["step_0000001"]  # keep_last=2 found no NaN checkpoint to keep
    assert _all_finite(saved[0])


def test_divergence_stops_every_pipeline_rank(tmp_path):
    """pp2: the loss lives on the last stage; every rank must stop at the same step (no hang)."""
    with pytest.raises(MegatronHydraError, match="diverged at step 1"):
        run_training([*DIVERGE, "trainer.devices=2", "parallel=pp2"], tmp_path)
    assert [p.name for p in (tmp_path / "checkpoints").glob("step_*")] == ["step_0000001"]


def test_fp16_skipped_overflow_steps_are_not_divergence(tmp_path):
    # A loss scale of 2^20 overflows fp16 grads: the scaler skips those steps (norm NaN) and halves it.
    rows = run_training([*SMALL, "trainer.max_steps=4", "precision=fp16", "precision.initial_loss_scale=1048576",
                         "precision.hysteresis=1"], tmp_path)
    assert [r["step"] for r in rows] == [0.0, 1.0, 2.0, 3.0]
    assert rows[-1]["skipped_steps"] >= 1 and any(math.isnan(r["grad_norm"]) for r in rows)
    assert all(math.isfinite(r["loss"]) for r in rows)


def test_nonfinite_weights_are_never_written(tmp_path):
    from megatron_hydra.checkpoint.sharded import save
    from megatron_hydra.config import derive
    from megatron_hydra.parallel.state import ParallelState
    from megatron_hydra.training.module import LMModule

    cfg = compose_config(SMALL)
    module = LMModule(cfg, derive(cfg), ParallelState.single())
    with torch.no_grad():
        dict(module.model.named_parameters())["layers.1.mlp.fc2.weight"][3, 5] = float("inf")
    with pytest.raises(CheckpointError, match="refused to save .*layers.1.mlp.fc2.weight holds NaN or inf"):
        save(str(tmp_path / "step_0000005"), module.model, None, module.ps, 500, {"step": 5})
    assert list(tmp_path.iterdir()) == []  # not even a temporary directory


def test_guard_unit():
    from megatron_hydra.training.guard import FiniteGuard, NonFiniteError

    def check_finite(step, loss, norm, skipped):
        guard = FiniteGuard()
        guard.record(step, loss, norm, skipped)
        guard.verify()

    nan = torch.tensor(float("nan"))
    check_finite(3, torch.tensor(2.0), torch.tensor(1.0), skipped=False)
    check_finite(3, torch.tensor(2.0), nan, skipped=True)  # fp16 overflow: the scaler's business
    for loss, norm, skipped in [(nan, torch.tensor(1.0), False), (torch.tensor(2.0), torch.tensor(float("inf")), False),
                                (torch.tensor(float("inf")), nan, True)]:
        with pytest.raises(NonFiniteError, match="diverged at step 3"):
            check_finite(3, loss, norm, skipped)