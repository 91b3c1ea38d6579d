"""``trainer.profile_steps=[first, last]``: torch.profiler over a window of training steps.

Steps count from 0 as the ``step`` column of ``csv/metrics.csv`` does, and both ends are included:
``[10, 12]`` records three optimizer steps. Every rank records its own window (on a GPU its CUDA
kernels too) and writes a Chrome trace, ``<run_dir>/profile/rank<r>.json``, which
``chrome://tracing`` or Perfetto (ui.perfetto.dev) opens; each step is a ``ProfilerStep#<step>``
range. A run resumed past ``first`` records what is left of the window; one resumed past ``last``
records nothing.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import pytorch_lightning as pl
from torch.profiler import ProfilerAction, ProfilerActivity, profile

log = logging.getLogger("megatron_hydra")


def trace_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, "profile", f"rank{rank}.json")


class StepProfiler(pl.Callback):
    """Starts the profiler before step ``first`` and writes the trace after step ``last``."""

    def __init__(self, first: int, last: int, run_dir: str, rank: int, cuda: bool):
        self.first, self.last = first, last
        self.path = trace_path(run_dir, rank)
        self.activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        self._profiler: Optional[profile] = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        step = trainer.global_step  # the step about to run
        if self._profiler is None and self.first <= step <= self.last:
            # A schedule that always records: only with a schedule does the profiler mark each step.
            self._profiler = profile(activities=self.activities, schedule=lambda _: ProfilerAction.RECORD,
                                     record_shapes=True)
            self._profiler.step_num = step  # its ProfilerStep#<n> ranges carry the run's step
            self._profiler.start()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._profiler is None:
            return
        step = trainer.global_step - 1  # the step just trained
        if step >= self.last:
            self._finish()
        else:
            self._profiler.step()

    def on_train_end(self, trainer, pl_module) -> None:
        if self._profiler is not None:  # stopped early (a stop signal inside the window)
            self._finish()

    def _finish(self) -> None:
        prof, self._profiler = self._profiler, None
        prof.stop()
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        prof.export_chrome_trace(self.path)
        log.info("profile of steps %d..%d: %s", self.first, self.last, self.path)
