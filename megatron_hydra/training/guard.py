"""The non-finite guard: a step whose loss or gradient norm is NaN or inf stops the run.

In the spirit of Megatron's ``check_for_nan_in_loss_and_grad``: training on after a NaN only
produces NaN weights, which a later save would write over the good checkpoints. The guard reads
values every rank already holds identically, so the ranks agree without a collective of their own:
the logged loss is averaged over data-parallel ranks after the pipeline's all-reduce over stages,
and the gradient norm is summed over the model-parallel group (and over data-parallel ranks when
the optimizer is sharded), so one rank's NaN reaches every rank's norm.

No host sync per step: ``record`` keeps, on the device, the first step whose values were not
finite (and those values); ``verify`` reads that once and raises. The training step verifies at
each logging step (``trainer.log_every_n_steps``) and the checkpoint callback before every save,
both at the same steps on every rank. So a divergence at step N stops the run at the first logging
step or save from N on, naming step N, and no checkpoint written holds weights from step N or later
(the checkpoints up to step N, i.e. those saved before step N trained, are kept).

fp16's loss scaler skips a step whose gradients overflowed and lowers the scale: such a step's
norm is NaN by design and is not checked; its loss still is (a NaN forward is no overflow).
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_hydra.errors import MegatronHydraError


class NonFiniteError(MegatronHydraError):
    """The loss or the gradient norm of a step is NaN or inf."""


def _raise(step: int, loss: float, norm: Optional[float]) -> None:
    norm_text = f"{norm:.4g}" if norm is not None else "not checked (fp16 step skipped)"
    raise NonFiniteError(
        f"training diverged at step {step}: loss {loss:.4g}, grad norm {norm_text}; stopped before saving "
        "it (the checkpoints written so far are kept): lower optim.lr (or raise optim.warmup_steps), then resume with "
        "checkpoint.resume=auto"
    )


class FiniteGuard:
    """The first non-finite step, kept on the device: ``first_step`` (-1 while every recorded step
    was finite) and that step's ``[loss, grad norm, norm checked]``."""

    def __init__(self) -> None:
        self.first_step: Optional[torch.Tensor] = None
        self.values: Optional[torch.Tensor] = None

    def record(self, step: int, loss: torch.Tensor, grad_norm: Optional[torch.Tensor], skipped: bool) -> None:
        """Note step ``step``'s ``loss`` and (unless the loss scaler ``skipped`` it) ``grad_norm``;
        device operations only."""
        loss = loss.detach().to(torch.float64).reshape(())
        if self.first_step is None:
            self.first_step = torch.full_like(loss, -1.0)
            self.values = torch.zeros(3, dtype=torch.float64, device=loss.device)
        checked = grad_norm is not None and not skipped
        norm = grad_norm.detach().to(loss.device, torch.float64).reshape(()) if checked else torch.zeros_like(loss)
        # x - x is 0 exactly for finite x and NaN for NaN and inf (torch.isfinite, composite, does
        # not run on the dry run's fake GPU tensors).
        first = ((loss - loss != 0) | (norm - norm != 0)) & (self.first_step < 0)
        self.first_step = torch.where(first, torch.full_like(loss, step), self.first_step)
        self.values = torch.where(first, torch.stack([loss, norm, torch.full_like(loss, float(checked))]), self.values)

    def verify(self) -> None:
        """Raise ``NonFiniteError`` naming the first non-finite step recorded; one host read."""
        if self.first_step is None:
            return
        step, loss, norm, checked = torch.cat([self.first_step.reshape(1), self.values]).tolist()
        if step >= 0:
            _raise(int(step), loss, norm if checked else None)
