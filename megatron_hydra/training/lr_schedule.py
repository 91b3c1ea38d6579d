"""Learning-rate schedule: linear warmup to ``lr``, then cosine (or linear) decay to ``min_lr``."""

from __future__ import annotations

import math

from megatron_hydra.config.schema import OptimConfig


def lr_at(step: int, optim: OptimConfig, max_steps: int) -> float:
    """Learning rate of the update with 0-based index ``step``. The first warmup update already
    uses lr / warmup_steps, so no update is wasted at 0. Megatron-LM's scheduler computes its first
    update's rate before any step is counted (its init lr, 0 by default), so its warmup runs one
    update behind this one; the decay is the same function of the step."""
    if optim.warmup_steps and step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    decay_steps = optim.decay_steps or max_steps
    if optim.lr_schedule == "constant" or decay_steps <= optim.warmup_steps:
        return optim.lr
    progress = min(1.0, (step - optim.warmup_steps) / (decay_steps - optim.warmup_steps))
    if optim.lr_schedule == "linear":
        factor = 1.0 - progress
    else:
        factor = 0.5 * (1.0 + math.cos(math.pi * progress))
    return optim.min_lr + (optim.lr - optim.min_lr) * factor
