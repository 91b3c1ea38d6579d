"""``trainer.compile``: the training model's blocks compiled (``models.compile``), and the cold
compile time reported once.

Dynamo compiles lazily: the first training step traces and compiles the forward of a block, its
first backward compiles the backward graph. Neither is a separate phase that could be timed on its
own without torch's private counters, so the cold time reported is the first step's wall time minus
the second's (the first step also warms the allocator and the data loader, which is small beside a
compile).

The dry run (fake process group, fake tensors on a stand-in device) runs the blocks eagerly and
says so: a compiled block holds the same parameters and, saved for backward, the same activations
to within the fusions a backend makes, so the memory plan counts a compiled block as an eager one.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

from torch import nn

from megatron_hydra.config import RunConfig
from megatron_hydra.models.compile import CompiledBlocks, compile_blocks

log = logging.getLogger("megatron_hydra")


class CompileClock:
    """Times the first two training steps of a compiled model and logs the difference once."""

    def __init__(self, compiled: CompiledBlocks, talk: bool):
        self.compiled, self.talk = compiled, talk
        self.first_step_s: Optional[float] = None
        self.cold_s: Optional[float] = None
        self._start: Optional[float] = None

    def start(self) -> None:
        self._start = time.perf_counter() if self.cold_s is None else None

    def stop(self) -> None:
        if self._start is None:
            return
        seconds = time.perf_counter() - self._start
        if self.first_step_s is None:
            self.first_step_s = seconds
            return
        self.cold_s = max(self.first_step_s - seconds, 0.0)
        if self.talk:
            log.info("compiled %d blocks (%s) in %.1f s: the first step's wall time minus the second's",
                     len(self.compiled.blocks), self.compiled.backend, self.cold_s)


def compile_for_training(cfg: RunConfig, model: nn.Module, talk: bool) -> Optional[CompileClock]:
    """With ``trainer.compile=true``, compile ``model``'s blocks and return the clock the step
    reads; None otherwise, and in the dry run (which says so once when ``talk``)."""
    if not cfg.trainer.compile:
        return None
    if cfg.mode == "dry_run":
        if talk:
            log.info("trainer.compile=true: the dry run runs the blocks eagerly; the memory plan counts a compiled "
                     "block as an eager one")
        return None
    return CompileClock(compile_blocks(model, cfg.trainer.compile_backend), talk)
