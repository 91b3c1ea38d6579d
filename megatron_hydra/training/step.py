"""One global batch's life, owned by one object: ``TrainStep``.

Everything between two optimizer steps happens here, in this order, and nowhere else:

1. zero the gradients: the data-parallel buffer in place (its views are the grads), or, under
   FSDP, drop each chunk's sharded grads (the next reduce-scatter assigns new ones);
2. scale the MoE routers' losses as the main loss is scaled (loss scale, context-parallel share,
   micro-batch count);
   with ``objective=dpo``, the reference model's forward-only pass over the whole batch
   (``training.dpo``): each row's reference document sums, carried with the micro-batches;
3. forward and backward over this rank's share of the global batch:
   - pp = 1: micro-batch by micro-batch, the loss times ``loss_scale / num_microbatches``; the
     data-parallel reduce stays off until the last micro-batch's backward, whose finished buckets
     start reducing while backward goes on;
   - pp > 1: the pipeline schedule (``parallel.pipeline``) with the step's reduce off; its
     backwards interleave, so the pipeline itself tells the buffer when each chunk's grads are
     final (its last backward or W pass), and those buckets start reducing during the schedule
     (``parallel.overlap_grad_reduce``); then FSDP's reduce-scatter and its grads divided by the
     micro-batch count, and the tied embedding's copies summed;
4. finish the data-parallel reduce (``GradBuffer.finish``: the remaining buckets, then means;
   with a pipeline also divided by the micro-batch count there, after the reduce, since buckets
   are in flight before: the schedule's own ``scale_grads`` would not see the buffered fp32
   grads of a 16-bit model either);
5. set the learning rate (``training.lr_schedule``);
6. the optimizer step (``parallel.optimizer.MegatronOptimizer.step``): sequence-parallel grads
   summed over TP, fp16's unscale and overflow check (a skipped step on every rank), clipping by
   the global norm, AdamW, the main weights written back;
7. the aux-loss-free MoE bias update;
8. the result (``StepResult``): the loss averaged over data- and context-parallel ranks, the
   learning rate, the gradient norm and whether fp16 skipped the step, recorded by the
   non-finite guard (``training.guard``) on the device.

Nothing here reads a device value on the host (fp16's overflow flag inside the optimizer aside).

Lightning. The step knows nothing of Lightning; it reaches Lightning through two callables, the
one seam between them: ``backward`` (under a Trainer ``LightningModule.manual_backward``, which
runs the ``on_before_backward``/``on_after_backward`` hooks of callbacks and module around
``loss.backward()``) and ``step_optimizer`` (under a Trainer ``LightningOptimizer.step``, which
counts the step in ``trainer.global_step`` and runs ``on_before_optimizer_step``). Without a
Trainer (the dry run, tests) they default to ``loss.backward()`` and the optimizer's ``step``.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch
from torch import nn

from megatron_hydra.parallel import collectives as C
from megatron_hydra.parallel import fsdp
from megatron_hydra.parallel.data_parallel import main_grad
from megatron_hydra.parallel.state import ParallelState
from megatron_hydra.training.lr_schedule import lr_at


@dataclass(frozen=True)
class StepResult:
    """One optimizer step's outcome. ``loss`` and ``grad_norm`` stay device tensors (reading them
    is a host sync); ``grad_norm`` is NaN on a step fp16 skipped, None where no norm exists."""

    loss: torch.Tensor
    lr: float
    grad_norm: Optional[torch.Tensor]
    skipped: bool


def model_chunks(model: nn.Module) -> List[nn.Module]:
    """The model's chunks: the pipeline chunks of a ``ModuleList``, else the model itself."""
    return list(model) if isinstance(model, nn.ModuleList) else [model]


def split_microbatches(batch: Dict[str, torch.Tensor], n: int) -> List[Dict[str, torch.Tensor]]:
    """This rank's batch cut into ``n`` micro-batches along the sample dimension."""
    return [dict(zip(batch, values)) for values in zip(*(v.chunk(n) for v in batch.values()))]


def dp_mean(value: torch.Tensor, ps: ParallelState) -> torch.Tensor:
    """The mean over data- and context-parallel ranks: a cp rank's loss is its share times cp
    (``models.archs.masked_mean``), so the mean over dp x cp is the global batch's loss."""
    value = value.detach().clone()
    C.all_reduce(value, ps.dp_cp_group)
    return value / C.group_size(ps.dp_cp_group)


def _backward(loss: torch.Tensor) -> None:
    loss.backward()


class TrainStep:
    """Calling it trains one global batch (see the module docstring). ``module``: the
    ``LMModule`` (model, loss, pipeline, loss scaler, guard, config); ``optimizer``: its
    ``MegatronOptimizer``, built after the strategy wrapped the model (its gradient buffer, or
    none under FSDP, is where the grads live)."""

    def __init__(self, module, optimizer, *, backward: Optional[Callable[[torch.Tensor], None]] = None,
                 step_optimizer: Optional[Callable[[], object]] = None):
        self.module, self.optimizer = module, optimizer
        self.backward = backward or _backward
        self.step_optimizer = step_optimizer or optimizer.step
        self.buffer = optimizer.buffer  # None: FSDP holds the grads on its sharded parameters
        self.chunks = model_chunks(module.model)
        if module.derived.pp > 1 and self.buffer is not None:
            module.pipeline.overlap_grad_reduce(self.buffer)

    def __call__(self, batch: Dict[str, torch.Tensor], step: int) -> StepResult:
        m = self.module
        self.zero_grad()
        self._scale_aux_losses()
        if m.dpo is not None:  # the reference model's pass first; the step's reward sums start at zero
            batch = m.with_reference(batch)
            m.dpo.start_step(m.loss_dtype, m.home_device)
        loss = self._pipeline(batch) if m.derived.pp > 1 else self._accumulate(batch)
        if self.buffer is not None:  # FSDP finished its reduce-scatters at the end of backward
            self.buffer.finish(m.derived.num_microbatches if m.derived.pp > 1 else 1)
        lr = lr_at(step, m.cfg.optim, m.cfg.trainer.max_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        scaler = m.loss_scaler
        skipped_before = scaler.skipped_steps if scaler is not None else 0
        self.step_optimizer()
        for layer in m.moe_layers:  # aux-loss-free balancing: every rank holding the layer moves its bias alike
            layer.update_expert_bias(m.ps.group("amax"))
        skipped = scaler is not None and scaler.skipped_steps > skipped_before
        result = StepResult(dp_mean(loss, m.ps), lr, self.optimizer.last_grad_norm, skipped)
        m.guard.record(step, result.loss, result.grad_norm, result.skipped)
        return result

    # Gradients -------------------------------------------------------------------------------
    def zero_grad(self) -> None:
        """The buffer zeroed in place (the optimizer's zero_grad would drop its views); FSDP: the
        sharded grads dropped."""
        if self.buffer is None:
            for chunk in self.chunks:
                chunk.zero_grad(set_to_none=True)
        else:
            self.buffer.zero()

    @contextmanager
    def no_sync(self):
        """Backward that only accumulates: the data-parallel reduce waits."""
        self._set_sync(False)
        try:
            yield
        finally:
            self._set_sync(True)

    def _set_sync(self, enabled: bool) -> None:
        if self.buffer is None:
            fsdp.set_gradient_sync(self.chunks, enabled)
        else:
            self.buffer.sync_enabled = enabled

    @torch.no_grad()
    def _average_microbatches(self) -> None:
        """FSDP under a pipeline: its reduced grads summed over micro-batches, made their mean."""
        n = self.module.derived.num_microbatches
        for chunk in self.chunks:
            for p in chunk.parameters():
                grad = main_grad(p)
                if grad is not None:
                    grad.div_(n)

    # Forward and backward --------------------------------------------------------------------
    def _scale_aux_losses(self) -> None:
        """The routers' losses are scaled as the main loss is (``models.moe.AuxLossScaler``); with a
        pipeline the grads are divided by the micro-batch count afterwards instead."""
        m = self.module
        per_microbatch = 1 if m.derived.pp > 1 else m.derived.num_microbatches
        for layer in m.moe_layers:
            layer.aux_loss_scale = m.loss_scale * m.ps.cp_size / per_microbatch

    def _accumulate(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        """pp = 1: forward and backward micro-batch by micro-batch; returns the mean loss."""
        m = self.module
        micro = split_microbatches(batch, m.derived.num_microbatches)
        total = None
        for i, mb in enumerate(micro):
            with self.no_sync() if i < len(micro) - 1 else nullcontext():
                loss = m.microbatch_loss(mb)
                self.backward(loss * m.loss_scale / len(micro))
            if total is None:  # summed in the loss dtype (fp32 for 16-bit models)
                total = torch.zeros((), dtype=m.loss_dtype, device=loss.device)
            total += loss.detach()
        return total / len(micro)

    def _pipeline(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        """pp > 1: the schedule (during which the buckets of final grads start reducing), then
        FSDP's reduce-scatter and mean over micro-batches, and the tied embedding's sum, before
        its buckets start."""
        m = self.module
        with self.no_sync():
            loss = m.pipeline.train_step(batch["tokens"], batch["labels"], m.pipeline_target(batch),
                                         **m.stage_inputs(batch)) / m.loss_scale
            if self.buffer is None:
                fsdp.finish_backward(self.chunks)  # reduce-scatter the accumulated grads now
                self._average_microbatches()
            m.pipeline.reduce_tied_grads()
        return loss
