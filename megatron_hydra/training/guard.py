"""The non-finite guard: a step whose loss or gradient norm is NaN or inf stops the run.

In the spirit of Megatron's ``check_for_nan_in_loss_and_grad``: training on after a NaN only
produces NaN weights, which a later save would write over the good checkpoints. The check reads
values every rank already holds identically, so the ranks agree without a collective of their own:
the logged loss is averaged over data-parallel ranks after the pipeline's all-reduce over stages,
and the gradient norm is summed over the model-parallel group (and over data-parallel ranks when
the optimizer is sharded), so one rank's NaN reaches every rank's norm. It costs one host read of
two scalars per step; on a GPU gradient clipping (on by default) has already waited for the norm
(``coef < 1``), and the
checkpoint callback reads its stop flag at the same boundary, so the read adds no stall of its own.

fp16's loss scaler skips a step whose gradients overflowed and lowers the scale: such a step's
norm is NaN by design and is not checked; its loss still is (a NaN forward is no overflow).
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_hydra.errors import MegatronHydraError


class NonFiniteError(MegatronHydraError):
    """The loss or the gradient norm of a step is NaN or inf."""


def check_finite(step: int, loss: torch.Tensor, grad_norm: Optional[torch.Tensor], skipped: bool) -> None:
    """Raise ``NonFiniteError`` naming ``step`` if ``loss`` or (unless the loss scaler ``skipped``
    the step) ``grad_norm`` is not finite."""
    checked = [loss.detach().double().reshape(())]
    if grad_norm is not None and not skipped:
        checked.append(grad_norm.detach().double().reshape(()).to(loss.device))
    values = torch.stack(checked)
    if bool(torch.isfinite(values).all()):
        return
    norm = f"{values[1].item():.4g}" if len(checked) > 1 else "not checked (fp16 step skipped)"
    raise NonFiniteError(
        f"training diverged at step {step}: loss {values[0].item():.4g}, grad norm {norm}; stopped before saving "
        "it (the checkpoints written so far are kept): lower optim.lr (or raise optim.warmup_steps), then resume with "
        "checkpoint.resume=auto"
    )
