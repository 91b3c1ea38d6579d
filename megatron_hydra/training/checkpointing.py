"""Checkpoints in a training run: when to save, what to resume from, stopping on a signal.

A Lightning callback, because everything it needs exists by ``on_train_start`` (the model on its
device, the optimizer). Whether step N saves is decided in ``on_train_batch_end``; the save itself
waits until Lightning has logged that step's metrics (the next ``on_train_batch_start``, or
``on_train_end``) and flushes the loggers first, so a checkpoint at step N implies the metric
history up to it is on disk: a resume after a kill continues the history without a hole. Resuming sets the loop's
step counters directly; the data sampler was already built at the checkpoint's consumed samples
(``plan.start_point``), so the run continues with the batch the stopped one would have seen next. The
consumed-samples counter is the module's own, carried over as saved: a resumed run may use another
``data.global_batch_size``, so it is never recomputed as step x batch. At the start rank 0 removes
what interrupted saves and prunes left behind (``store.clean``). A LoRA run loads its base first,
then its adapters, and saves its adapters alone (``checkpoint.plan``: the two sources, and why).

SIGTERM, SIGUSR1 and SIGUSR2 (the warning signals SLURM and submitit send before a time limit)
only set a flag; the ranks agree on it with a one-element all-reduce (a signal may reach them at
different steps), save, and stop cleanly. The all-reduce and its host read would stall a GPU step,
so the ranks agree only after the steps ``module.host_sync_step`` names, the same on every rank:
the logging steps (``trainer.log_every_n_steps``) and the steps a checkpoint is due anyway. A stop
request therefore takes effect after at most ``trainer.log_every_n_steps - 1`` more steps than it
would if agreed after every step (none at the default interval of 1; up to 9 steps at the GPU
trainer's 10), still at a step boundary, with a save on every rank. ``checkpoint.resume=auto`` then
continues the run. Inside a SLURM job a warning signal also requeues the job once the save is
complete (``checkpoint.requeue_on_signal``): this callback is the only owner of those signals while
training, in place of submitit's and Lightning's requeue handlers (docs/cluster.md).

With ``checkpoint.async_save`` (the default) a save blocks the step only while the state is
copied to host memory (``checkpoint.async_save``); a background thread writes it, prunes and logs,
its collectives on a gloo process group that every rank creates when training starts, apart from
training's groups. ``last_saved`` is the step of the newest save started; the next save, the end of
training (before a requeue), and teardown wait for the one in flight, and raise its failure.

A one-process run trains inside its launcher's process (``launcher``), whose handler keeps SIGTERM
and SIGINT for the whole run (``launcher_keeps_stop_signals``): it prints the notice, records the
request here, and raises ``lifecycle.StopAtOnce`` on a second signal, which ends the run where it
is. A save in flight is still finished (``on_exception``): a thread left writing while the process
exits can abort the interpreter's exit.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Callable, Iterator, List, Optional

import pytorch_lightning as pl
import torch
import torch.distributed as dist

from megatron_hydra.checkpoint import plan, sharded, store
from megatron_hydra.checkpoint.async_save import BackgroundWriter, HostStager
from megatron_hydra.config import Derived, RunConfig
from megatron_hydra.errors import CheckpointError
from megatron_hydra.parallel.state import ParallelState
from megatron_hydra.training.module import host_sync_step

log = logging.getLogger("megatron_hydra")
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
# Sent ahead of a time limit (sbatch --signal, submitit's signal_delay_s): save, then requeue.
WARNING_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)
_stop_requested: List[int] = []
_launcher_handler: Optional[Callable] = None  # see ``launcher_keeps_stop_signals``


def set_resumed_step(trainer: pl.Trainer, step: int) -> None:
    """Make Lightning's loop continue at optimizer step ``step``. Lightning resumes only from its own
    checkpoint format, which ours is not, and has no public setter: the two counters its loop
    reads are set here, in this one place: the optimizer-step progress (``trainer.global_step``)
    and the step loggers record. A Lightning version that renamed them fails here in one line."""
    loop = trainer.fit_loop.epoch_loop
    try:
        progress = loop.manual_optimization.optim_step_progress.total
        if not hasattr(loop, "_batches_that_stepped") or not hasattr(progress, "completed"):
            raise AttributeError("_batches_that_stepped")
    except AttributeError as e:
        raise CheckpointError(f"pytorch-lightning {pl.__version__} has no loop counter {e.name or e}: resuming needs "
                              "a 2.x version that has it (pip install 'pytorch-lightning>=2.4,<3')") from None
    progress.ready = progress.completed = step
    loop._batches_that_stepped = step


def request_stop(signum, frame) -> None:
    _stop_requested.append(signum)


@contextmanager
def launcher_keeps_stop_signals(handler: Callable) -> Iterator[None]:
    """For a run that trains in its launcher's process: SIGTERM stays with the launcher's
    ``handler`` while training too (it counts signals and calls ``request_stop``), and this run's
    stop requests count from here, so one that arrives while the model is built is answered with
    a save at the first step boundary, as a spawned worker answers a held SIGTERM."""
    global _launcher_handler
    _stop_requested.clear()
    _launcher_handler = handler
    try:
        yield
    finally:
        _launcher_handler = None
        _stop_requested.clear()


def install_stop_handlers() -> dict:
    """Make SIGTERM/SIGUSR1/SIGUSR2 request a save-and-stop; returns the handlers they replaced. Installed
    once training has started, i.e. over Lightning's own SIGTERM handler, which would otherwise
    exit at an arbitrary point of the step (before or after our save). Requests made before are
    kept: a spawned worker's held SIGTERM, or one its launcher recorded in this process."""
    handlers = {s: request_stop for s in STOP_SIGNALS}
    if _launcher_handler is not None:
        handlers[signal.SIGTERM] = _launcher_handler
    try:
        return {s: signal.signal(s, h) for s, h in handlers.items()}
    except ValueError:  # not the main thread: leave signals alone
        return {}


class CheckpointCallback(pl.Callback):
    def __init__(self, cfg: RunConfig, derived: Derived, ps: ParallelState, start: Optional[dict]):
        self.cfg, self.derived, self.ps, self.start = cfg, derived, ps, start
        self.dir = plan.checkpoint_dir(cfg)
        self.last_saved: Optional[int] = None
        self.stopped_by_signal = False
        self.stop_signal_kind = 0.0  # 1: SIGTERM, 2: a warning signal (save, then requeue)
        self.save_due = False
        self._previous_handlers: dict = {}
        self.blocked_s: List[float] = []  # how long each save held the training thread
        self._writer = BackgroundWriter() if cfg.checkpoint.async_save else None
        self._stager = HostStager() if cfg.checkpoint.async_save else None
        self._group = None  # the background writer's process group

    @staticmethod
    def optimizer_of(trainer: pl.Trainer):
        return trainer.optimizers[0] if trainer.optimizers else None

    # Resume ----------------------------------------------------------------------------------
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._previous_handlers = install_stop_handlers()
        if self._writer is not None and dist.is_initialized():  # collective: every rank, here
            self._group = dist.new_group(backend="gloo",
                                         timeout=timedelta(seconds=self.cfg.trainer.collective_timeout_s))
        if self.ps.rank == 0:
            for leftover in store.clean(self.dir):
                log.info("removed %s: an interrupted save or prune, not a checkpoint", leftover)
        if self.start is None:
            log.info("training starts at step 0 (checkpoints: %s)", self.dir)
            return
        if self.start.get("base"):  # LoRA: the frozen base first, its model tensors only
            sharded.load(self.start["base"], pl_module.model, None, self.ps, self.derived.transformer.vocab_size,
                         load_optimizer=False, select="base", key="checkpoint.load")
            log.info("base model loaded from %s", self.start["base"])
        if self.start["path"] is None:
            log.info("training starts at step 0 with initial adapters (checkpoints: %s)", self.dir)
            return
        self._resume(trainer, pl_module)

    def _resume(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Load the start checkpoint (under LoRA: the adapters); continue its step and random
        states unless it is ``peft.adapter``, whose weights start a new run."""
        path, step = self.start["path"], int(self.start["step"])
        weights_only = self.start.get("weights_only", False)
        select = plan.saved_part(self.derived)
        sharded.load(path, pl_module.model, self.optimizer_of(trainer), self.ps, self.derived.transformer.vocab_size,
                     self.cfg.checkpoint.load_optimizer and not weights_only, select=select)
        if weights_only:
            log.info("adapters loaded from %s (peft.adapter); training starts at step 0", path)
            return
        pl_module.consumed_samples = int(self.start["consumed_samples"])
        scaler = getattr(pl_module, "loss_scaler", None)
        if scaler is not None and "loss_scaler" in self.start and self.cfg.checkpoint.load_optimizer:
            scaler.load_state_dict(self.start["loss_scaler"])
        set_resumed_step(trainer, step)
        same_layout = self.start.get("layout") == plan.layout(self.derived)
        restored = same_layout and sharded.load_rng(path)
        self.last_saved = step
        log.info("resumed from %s at step %d (%s)", path, step,
                 "random states restored" if restored
                 else "fresh random states" if same_layout else "another layout: fresh random states")

    # Save ------------------------------------------------------------------------------------
    def _agree_to_stop(self, device: torch.device) -> float:
        """0: go on; 1: stop (SIGTERM); 2: stop, and requeue (a warning signal on any rank). The
        flag lives on the training device: NCCL reduces no CPU tensors."""
        warned = any(s in WARNING_SIGNALS for s in _stop_requested)
        flag = torch.tensor([2.0 if warned else 1.0 if _stop_requested else 0.0], device=device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag.item()

    def _requeue(self) -> None:
        """After every rank has saved: rank 0 asks SLURM to requeue the job (nothing outside SLURM)."""
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()
        if self.ps.rank == 0:
            from megatron_hydra import slurm

            slurm.requeue(os.environ)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module, outputs, batch, batch_idx) -> None:
        step, every = trainer.global_step, self.cfg.checkpoint.every_n_steps
        if not host_sync_step(step - 1, self.cfg):  # no scheduled save either (see the module docstring)
            return
        stop = self._agree_to_stop(pl_module.device)
        self.save_due = bool(stop or (every and step % every == 0))
        if stop:
            self.stop_signal_kind = stop
            self.stopped_by_signal = True
            trainer.should_stop = True

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module, batch, batch_idx) -> None:
        if self.save_due:  # decided at the end of the previous step, whose metrics are now logged
            self.save(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.save_due or (self.cfg.checkpoint.save_last and self.last_saved != trainer.global_step):
            self.save(trainer, pl_module)
        self.wait()  # the checkpoint is on disk before a requeue, or before the run reports its end
        if self.stop_signal_kind == 2 and self.cfg.checkpoint.requeue_on_signal:
            self._requeue()
        if self.stopped_by_signal:
            log.info("stop requested by signal: saved step %d, stopping (resume with checkpoint.resume=auto)",
                     trainer.global_step)
        self._restore_handlers()  # before Lightning restores the handlers it replaced, not after

    def _restore_handlers(self) -> None:
        """The signal handlers from before training; this run's stop requests are spent."""
        for sig, handler in self._previous_handlers.items():
            signal.signal(sig, handler)
        self._previous_handlers = {}
        _stop_requested.clear()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._restore_handlers()
        self.wait()
        if self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = None

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Training failed (a diverged step, a worker error): a save started before the failure
        holds good state, so it is finished rather than left half written. Lightning calls no
        ``teardown`` hook of a callback after an exception, hence here. A failure of that save is
        logged; the training failure is what the run reports."""
        self._restore_handlers()
        try:
            self.wait()
        except CheckpointError as e:
            log.error("%s", e)

    def wait(self) -> None:
        """Until the background save in flight (if any) is on disk; its failure is raised here."""
        if self._writer is not None:
            self._writer.wait()

    def save(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> str:
        """Save this step: whole, or (``async_save``) staged to host memory and handed to the
        background writer. Returns the checkpoint's path."""
        start = time.perf_counter()
        self.wait()  # at most one save in flight; a failed one stops the run here
        step = trainer.global_step
        self.save_due = False
        guard = getattr(pl_module, "guard", None)
        if guard is not None:  # never write weights that a non-finite step updated
            guard.verify()
        for logger in trainer.loggers:  # the history up to this step reaches disk before the checkpoint
            logger.save()
        path = store.step_dir(self.dir, step)
        select = plan.saved_part(self.derived)  # under LoRA the adapters alone: the base never changes
        meta = plan.meta(self.cfg, self.derived, step, pl_module.consumed_samples, select=select)
        if getattr(pl_module, "loss_scaler", None) is not None:
            meta["loss_scaler"] = pl_module.loss_scaler.state_dict()
        snap = sharded.snapshot(path, pl_module.model, self.optimizer_of(trainer), self.ps,
                                self.derived.transformer.vocab_size, meta,
                                stage=self._stager.stage if self._stager is not None else None, select=select)
        if self._writer is not None:
            self._writer.submit(path, lambda: self._write(snap))
        else:
            self._write(snap)
        self.last_saved = step
        self.blocked_s.append(time.perf_counter() - start)
        if self.ps.rank == 0:
            log.info("checkpoint %s: training blocked %.3f s%s", path, self.blocked_s[-1],
                     " (written in the background)" if self._writer is not None else "")
        return path

    def _write(self, snap: sharded.Snapshot) -> None:
        """Write, then (rank 0) retention: on the background thread when ``async_save``."""
        sharded.write(snap, self._group)
        if self.ps.rank == 0:
            pruned = store.prune(self.dir, self.cfg.checkpoint.keep_last, snap.final)
            log.info("saved checkpoint %s%s", snap.final, f" (removed {len(pruned)} older)" if pruned else "")
