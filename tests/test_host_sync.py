"""No host sync on the hot path: between logging steps a training step reads no device value on the
host, so on a GPU the host queues step after step without waiting for the device.

A host sync is counted where it happens on any device: every read of a tensor's value into Python
(``.item()``, ``float(t)``, ``bool(t)``, ``if t < x`` all dispatch ``aten._local_scalar_dense``)
and every ``Tensor.tolist()``. Reads inside ``torch.optim`` are left out: AdamW keeps its ``step``
counters on the CPU unless it is fused or capturable (host tensors by design, read without a sync).
"""

from __future__ import annotations

import os
import traceback
from collections import Counter
from contextlib import contextmanager
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import megatron_hydra
from conftest import SMALL, compose_config, run_training
from megatron_hydra.errors import MegatronHydraError

PACKAGE = os.path.dirname(megatron_hydra.__file__) + os.sep


def _caller() -> str:
    """Who asked for the read: the innermost frame that is ours or Lightning's, or 'optim'."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        name = frame.filename
        if "/torch/optim/" in name:
            return "optim"
        if name.startswith(PACKAGE):
            return "ours"
        if "lightning" in name:
            return "lightning"
    return "other"


class HostReads(TorchDispatchMode):
    """Counts host reads of tensor values by step (``self.step``) and by caller."""

    def __init__(self) -> None:
        super().__init__()
        self.step = None
        self.counts: Counter = Counter()

    def note(self) -> None:
        caller = _caller()
        if caller != "optim":
            self.counts[self.step, caller] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.note()
        return func(*args, **(kwargs or {}))

    def per_step(self, caller: str, steps: int):
        return [self.counts[s, caller] for s in range(steps)]


@contextmanager
def counting_host_reads():
    reads = HostReads()
    tolist = torch.Tensor.tolist

    def counted_tolist(self, *args, **kwargs):
        reads.note()
        return tolist(self, *args, **kwargs)

    with mock.patch.object(torch.Tensor, "tolist", counted_tolist), reads:
        yield reads


# Through Lightning: the real loop, callbacks and logging -------------------------------------------
def _fit_counting(overrides, run_dir):
    """``run_training`` (one process) with host reads counted per step: a step's window runs from
    the start of its batch to the start of the next, so a checkpoint due after step k, which is
    written when batch k + 1 starts, counts in step k + 1; the save at the end counts as 'end'."""
    import pytorch_lightning as pl

    from megatron_hydra.training import train as train_module

    with counting_host_reads() as reads:
        class Steps(pl.Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                reads.step = trainer.global_step

            def on_train_end(self, trainer, pl_module):
                reads.step = "end"

        build = train_module.build_trainer

        def with_steps(*args, **kwargs):
            trainer = build(*args, **kwargs)
            trainer.callbacks.insert(0, Steps())  # before the checkpoint callback's hooks
            return trainer

        with mock.patch.object(train_module, "build_trainer", with_steps):
            rows = run_training(overrides, run_dir)
    return reads, rows


def test_no_host_sync_between_logging_steps(tmp_path):
    steps = 8
    reads, rows = _fit_counting([*SMALL, f"trainer.max_steps={steps}", "trainer.log_every_n_steps=4",
                                 "checkpoint.every_n_steps=0"], tmp_path)
    ours = reads.per_step("ours", steps)
    # Steps 3 and 7 are logging steps (Lightning logs step s when s + 1 is a multiple of 4): the
    # guard's flag, the metrics (one transfer each) and the stop-request agreement. None elsewhere.
    assert ours == [0, 0, 0, 3, 0, 0, 0, 3], ours
    assert [r["step"] for r in rows] == [3.0, 7.0]
    assert all(r["mfu"] > 0 for r in rows)


def test_checkpoint_steps_are_sync_steps_too(tmp_path):
    steps = 6
    reads, rows = _fit_counting([*SMALL, f"trainer.max_steps={steps}", "trainer.log_every_n_steps=4",
                                 "checkpoint.every_n_steps=3", "checkpoint.keep_last=0"], tmp_path)
    ours = reads.per_step("ours", steps)
    # Step 2 ends where a checkpoint is due (global step 3): the guard, the metrics and the stop
    # agreement read there; the save, as batch 3 starts, reads the guard and (checkpoint.sharded)
    # every tensor it writes, for NaN. Step 3 is a logging step, step 5 ends at the next checkpoint.
    assert ours[0] == ours[1] == ours[4] == 0 and ours[2] == 3 and ours[3] > 3 and ours[5] == 3, ours
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_0000003", "step_0000006"]


# One process without Lightning: the step the dry run drives -----------------------------------------
def _train_step(precision: str):
    """A single-process module with the real strategy and optimizer, stepped without a Trainer."""
    from megatron_hydra.config import derive
    from megatron_hydra.parallel.state import ParallelState
    from megatron_hydra.training.module import LMModule
    from megatron_hydra.training.step import TrainStep
    from megatron_hydra.training.strategy import MegatronStrategy

    cfg = compose_config([*SMALL, f"precision={precision}", "optim.clip_grad=1.0"])
    module = LMModule(cfg, derive(cfg), ParallelState.single())
    strategy = MegatronStrategy(module.ps, torch.device("cpu"), grad_bucket_size=cfg.parallel.grad_bucket_size)
    strategy.wrap_model(module)
    return TrainStep(module, module.build_optimizer(strategy.grad_buffer))


def _batch(step: int):
    tokens = torch.randint(0, 500, (8, 32), generator=torch.Generator().manual_seed(step))
    return {"tokens": tokens, "labels": tokens.roll(-1, 1), "loss_mask": torch.ones(8, 32)}


@pytest.mark.parametrize("precision,per_step", [("fp32", 0), ("bf16", 0), ("fp16", 1)])
def test_optimizer_step_clip_and_guard_read_nothing(precision, per_step):
    """bf16/fp32: no read in forward, backward, clipping, AdamW or the guard. fp16: one, the
    overflow flag its loss scaler decides on (parallel.optimizer), however many tensors it checks."""
    train_step = _train_step(precision)
    steps = 3
    with counting_host_reads() as reads:
        for step in range(steps):
            reads.step = step
            result = train_step(_batch(step), step)  # the guard records it
        reads.step = "verify"
        train_step.module.guard.verify()
    assert reads.per_step("ours", steps) == [per_step] * steps
    assert reads.counts["verify", "ours"] == 1
    if precision != "fp16":  # (fp16's first steps overflow at the initial scale: no norm)
        assert result.grad_norm > 1.0  # clipped: clip_grad=1.0 on a fresh model


# The clip multiplies on the device -------------------------------------------------------------------
def _old_clip(grads, norm, max_norm):
    """The reference: what ``clip_grads`` did with ``if coef < 1`` on the host."""
    out = [g.clone() for g in grads]
    coef = max_norm / (norm + 1e-6)
    if coef < 1:
        for g in out:
            g.mul_(coef.to(g.dtype))
    return out


@pytest.mark.parametrize("max_norm", [0.5, 1e6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_device_clip_is_bitwise_the_host_branch(max_norm, dtype):
    from megatron_hydra.parallel.grad_clip import clip_grads
    from megatron_hydra.parallel.state import ParallelState

    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=gen, dtype=dtype) * 3 for n in (7, 130, 1000)]
    grads[1][5] = -0.0
    before = [g.clone() for g in grads]
    with counting_host_reads() as reads:
        norm = clip_grads(grads, [True] * 3, max_norm, ParallelState.single())
    assert sum(reads.counts.values()) == 0
    expected = _old_clip(before, norm, max_norm)
    assert all(torch.equal(g, e) for g, e in zip(grads, expected))
    if max_norm > 1e3:  # not clipped: multiplied by exactly 1, every bit kept (the -0.0 too)
        assert all(torch.equal(g, b) for g, b in zip(grads, before))
        assert torch.signbit(grads[1][5])


def test_nan_norm_leaves_grads_as_the_host_branch_did():
    from megatron_hydra.parallel.grad_clip import clip_grads
    from megatron_hydra.parallel.state import ParallelState

    grads = [torch.tensor([1.0, float("nan"), 2.0]), torch.tensor([3.0])]
    before = [g.clone() for g in grads]
    norm = clip_grads(grads, [True, True], 1.0, ParallelState.single())
    assert torch.isnan(norm)
    assert torch.equal(grads[1], before[1]) and torch.equal(grads[0][[0, 2]], before[0][[0, 2]])


def test_clip_and_guard_run_on_fake_cuda_tensors():
    """The dry run's tensors (FakeTensorMode on device cuda) have no values: reading one on the host
    raises, so running through is itself proof that neither reads."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_hydra.parallel.grad_clip import clip_grads
    from megatron_hydra.parallel.state import ParallelState
    from megatron_hydra.training.guard import FiniteGuard

    with FakeTensorMode():
        grads = [torch.randn(5, 3, device="cuda"), torch.randn(7, device="cuda")]
        norm = clip_grads(grads, [True, True], 1.0, ParallelState.single())
        guard = FiniteGuard()
        guard.record(0, torch.randn((), device="cuda"), norm, skipped=False)
        guard.record(1, torch.randn((), device="cuda"), None, skipped=True)
        assert guard.values.device.type == "cuda"
        with pytest.raises(Exception, match="data-dependent|_local_scalar_dense|item"):
            guard.verify()  # the read, which only logging steps and saves make


# The guard reads on logging steps and before saves ---------------------------------------------------
def test_divergence_between_logging_steps_stops_at_the_next_one_naming_its_step(tmp_path):
    # lr=1e30: step 0 is finite, step 1's loss is NaN; the next logging step is 3.
    with pytest.raises(MegatronHydraError) as err:
        run_training([*SMALL, "optim.lr=1e30", "trainer.max_steps=6", "trainer.log_every_n_steps=4"], tmp_path)
    message = str(err.value)
    assert "\n" not in message and "diverged at step 1" in message and "nan" in message
    assert not (tmp_path / "csv" / "metrics.csv").exists()  # step 3 was not logged
    assert not list((tmp_path / "checkpoints").glob("step_*"))


def test_the_save_at_the_end_reads_the_guard_first(tmp_path):
    # No logging step and no scheduled save before the end: the last save (checkpoint.save_last)
    # is the first read, and it refuses to write the weights of steps 1 and 2.
    with pytest.raises(MegatronHydraError, match="diverged at step 1"):
        run_training([*SMALL, "optim.lr=1e30", "trainer.max_steps=3", "trainer.log_every_n_steps=10"], tmp_path)
    assert not list((tmp_path / "checkpoints").glob("step_*"))


# The stop request is agreed on only at sync steps -----------------------------------------------------
def test_stop_agreement_waits_for_the_next_sync_step(tmp_path):
    from types import SimpleNamespace

    from megatron_hydra.config import derive
    from megatron_hydra.parallel.state import ParallelState
    from megatron_hydra.training import checkpointing

    cfg = compose_config([*SMALL, "trainer.log_every_n_steps=4", "checkpoint.every_n_steps=6"], str(tmp_path))
    callback = checkpointing.CheckpointCallback(cfg, derive(cfg), ParallelState.single(), None)
    module = SimpleNamespace(device=torch.device("cpu"))
    agreed, stopped = [], None
    callback._previous_handlers = checkpointing.install_stop_handlers()
    try:
        checkpointing.request_stop(15, None)  # SIGTERM arrives during step 0
        for step in range(10):
            trainer = SimpleNamespace(global_step=step + 1, should_stop=False)
            with mock.patch.object(callback, "_agree_to_stop", wraps=callback._agree_to_stop) as agree:
                callback.on_train_batch_end(trainer, module, None, None, 0)
            if agree.called:
                agreed.append(step)
            if trainer.should_stop and stopped is None:
                stopped = step
    finally:
        callback.teardown(None, None, "fit")
    assert agreed == [3, 5, 7]  # logging steps 3 and 7; step 5 ends at the checkpoint of global step 6
    assert stopped == 3 and callback.save_due
