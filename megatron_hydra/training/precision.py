"""Mixed precision: which dtypes a run uses, and fp16's dynamic loss scaling.

bf16 and fp16 runs keep the model's weights and activations in 16 bits and everything the
optimizer touches in fp32: gradients are accumulated and reduced in an fp32 buffer
(``parallel.data_parallel``) and Adam updates fp32 main weights (``parallel.optimizer``), which
are rounded into the model after each step. fp16's narrow exponent range also needs the loss
multiplied by a large scale before backward, so that small gradients do not flush to zero; the
scale is divided out of the fp32 gradients before the step, and a step whose gradients overflowed
on any rank is skipped by every rank.
"""

from __future__ import annotations

from megatron_hydra.config.schema import PrecisionConfig


class DynamicLossScaler:
    """Megatron's dynamic scaler: halve the scale after ``hysteresis`` overflowing steps (not
    necessarily consecutive: a clean stretch of ``window`` steps resets the count), never below
    ``min_scale``; double it after ``window`` consecutive clean steps."""

    def __init__(self, initial_scale: float, min_scale: float, window: int, hysteresis: int):
        self.scale, self.min_scale = float(initial_scale), float(min_scale)
        self.window, self.hysteresis = window, hysteresis
        self.clean_steps, self.overflows_left = 0, hysteresis
        self.skipped_steps = 0

    @classmethod
    def from_config(cls, p: PrecisionConfig) -> "DynamicLossScaler":
        return cls(p.initial_loss_scale, p.min_loss_scale, p.loss_scale_window, p.hysteresis)

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.skipped_steps += 1
            self.clean_steps = 0
            self.overflows_left -= 1
            if self.overflows_left <= 0:
                self.scale = max(self.scale / 2.0, self.min_scale)
            return
        self.clean_steps += 1
        if self.clean_steps == self.window:
            self.clean_steps, self.overflows_left = 0, self.hysteresis
            self.scale *= 2.0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "overflows_left": self.overflows_left,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.clean_steps, self.overflows_left = int(state["clean_steps"]), int(state["overflows_left"])
        self.skipped_steps = int(state["skipped_steps"])
