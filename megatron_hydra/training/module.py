"""The LightningModule: one ``training_step`` is one optimizer step over one global batch.

The batch Lightning hands in is this data-parallel rank's share of the global batch
(``num_microbatches x micro_batch_size`` samples). It is cut into micro-batches whose gradients
accumulate; the strategy reduces them over data-parallel ranks (overlapped with the last
micro-batch's backward) and clips them when the optimizer steps. The logged loss is the mean over
the whole global batch, identical for every layout. A loss or gradient norm that is NaN or inf
stops the run (``training.guard``).

With pipeline parallelism (pp > 1) ``self.model`` is a ``ModuleList`` of this rank's model chunks
(one per virtual stage it holds, each a ``GPTModel`` keyed by logical layer names) and the
micro-batches run through the pipeline schedule (``parallel.pipeline``) instead of the loop.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Dict

import pytorch_lightning as pl
import torch

from megatron_hydra.config import Derived, RunConfig
from megatron_hydra.models.archs import ARCHS
from megatron_hydra.models.init import init_weights
from megatron_hydra.parallel import collectives as C
from megatron_hydra.parallel.optimizer import MegatronOptimizer
from megatron_hydra.parallel.pipeline import Pipeline, stage_indices, stage_layers
from megatron_hydra.parallel.state import ParallelState
from megatron_hydra.planning.flops import model_flops_per_step
from megatron_hydra.training.guard import check_finite
from megatron_hydra.training.lr_schedule import lr_at
from megatron_hydra.training.precision import DynamicLossScaler


def build_stage_chunks(cfg: RunConfig, derived: Derived, ps: ParallelState):
    """This pipeline rank's model chunks and their virtual stage indices, initialised from the
    logical parameter names (the same values as the whole model at pp=1)."""
    tcfg, per_stage = derived.transformer, derived.layers_per_stage
    stages = stage_indices(ps.pp_rank, ps.pp_size, derived.vpp, cfg.parallel.pipeline_schedule)
    chunks = []
    for stage in stages:
        chunk = ARCHS[tcfg.arch].build(tcfg, ps, layers=stage_layers(per_stage, stage), pre_process=stage == 0,
                         post_process=stage == len(per_stage) - 1)
        init_weights(chunk, tcfg, cfg.seed, ps.tp_rank, ps.tp_size)
        chunks.append(chunk)
    return chunks, stages


class LMModule(pl.LightningModule):
    def __init__(self, cfg: RunConfig, derived: Derived, ps: ParallelState):
        super().__init__()
        self.automatic_optimization = False
        self.cfg, self.derived, self.ps = cfg, derived, ps
        tcfg = derived.transformer
        self._pipeline, self._stages = None, None
        if derived.pp > 1:
            chunks, self._stages = build_stage_chunks(cfg, derived, ps)
            self.model = torch.nn.ModuleList(chunks)
        else:
            self.model = ARCHS[tcfg.arch].build(tcfg, ps)
            init_weights(self.model, tcfg, cfg.seed, ps.tp_rank, ps.tp_size)
        self.flops_per_step = model_flops_per_step(tcfg, cfg.data.global_batch_size)
        self.tokens_per_step = cfg.data.global_batch_size * tcfg.seq_length
        self._last_step_end = None
        # Samples trained on so far: carried as is through checkpoints (a resumed run may use
        # another global batch size, so it is not step x batch).
        self.consumed_samples = 0
        # fp16 only: the loss is multiplied by the scale before backward (parallel.optimizer
        # divides it out of the grads and skips overflowing steps).
        self.loss_scaler = DynamicLossScaler.from_config(cfg.precision) if tcfg.params_dtype == torch.float16 else None
        # Losses are summed in fp32 even when the model runs in 16 bits.
        self.loss_dtype = torch.float64 if tcfg.params_dtype == torch.float64 else torch.float32

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    # Loss ------------------------------------------------------------------------------------
    def microbatch_loss(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        """Mean loss over the micro-batch's unmasked tokens (``models.archs``: per model family)."""
        arch = ARCHS[self.derived.transformer.arch]
        return arch.loss(self.model(batch["tokens"], **{k: batch[k] for k in arch.inputs}), batch["loss_mask"])

    def _stage_inputs(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """The batch fields besides tokens, labels and loss mask that every pipeline stage reads."""
        return {k: batch[k] for k in ARCHS[self.derived.transformer.arch].inputs if k != "labels"}

    @property
    def pipeline(self) -> Pipeline:
        """Built on first use, once Lightning has moved the chunks to their device."""
        if self._pipeline is None:
            self._pipeline = Pipeline(list(self.model), self._stages, self.ps, self.cfg.parallel.pipeline_schedule,
                                      self.derived.num_microbatches, self._scaled_masked_mean, self.device)
        return self._pipeline

    def _scaled_masked_mean(self, per_token_loss: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
        """The pipeline's loss function: the micro-batch loss times the loss scale (1 unless fp16)."""
        return ARCHS[self.derived.transformer.arch].loss(per_token_loss, loss_mask) * self.loss_scale

    def _microbatches(self, batch: Dict[str, torch.Tensor]):
        n = self.derived.num_microbatches
        return [dict(zip(batch, values)) for values in zip(*(v.chunk(n) for v in batch.values()))]

    def _dp_mean(self, value: torch.Tensor) -> torch.Tensor:
        value = value.detach().clone()
        C.all_reduce(value, self.ps.dp_cp_group)
        return value / self.ps.dp_size

    # Training --------------------------------------------------------------------------------
    def on_train_batch_start(self, batch, batch_idx) -> None:
        if self._last_step_end is None:
            self._last_step_end = time.perf_counter()

    def training_step(self, batch: Dict[str, torch.Tensor], batch_idx: int) -> None:
        strategy = self.trainer.strategy
        opt = self.optimizers()
        strategy.zero_grad()
        if self.derived.pp > 1:
            # The schedule interleaves the micro-batches' backwards, so no bucket is final before it
            # ends: the data-parallel reduce then runs whole in the optimizer step (GradBuffer.finish).
            with strategy.block_backward_sync():
                scale = self.loss_scale
                loss = self.pipeline.train_step(batch["tokens"], batch["labels"], batch["loss_mask"],
                                                **self._stage_inputs(batch)) / scale
        else:
            loss = self._accumulate(batch, strategy)
        step = self.trainer.global_step
        lr = lr_at(step, self.cfg.optim, self.cfg.trainer.max_steps)
        for group in opt.param_groups:
            group["lr"] = lr
        skipped_before = self.loss_scaler.skipped_steps if self.loss_scaler is not None else 0
        opt.step()
        loss = self._dp_mean(loss)
        skipped = self.loss_scaler is not None and self.loss_scaler.skipped_steps > skipped_before
        check_finite(step, loss, strategy.last_grad_norm, skipped)
        self.consumed_samples += self.cfg.data.global_batch_size
        self._log_step(loss, lr, strategy.last_grad_norm)
        if self.loss_scaler is not None:
            self.log("loss_scale", self.loss_scaler.scale, on_step=True, on_epoch=False, rank_zero_only=True, batch_size=1)
            self.log("skipped_steps", float(self.loss_scaler.skipped_steps), on_step=True, on_epoch=False,
                     rank_zero_only=True, batch_size=1)

    def _accumulate(self, batch: Dict[str, torch.Tensor], strategy) -> torch.Tensor:
        """pp = 1: forward and backward micro-batch by micro-batch; returns the mean loss."""
        micro = self._microbatches(batch)
        total = torch.zeros((), dtype=self.loss_dtype, device=self.device)
        for i, mb in enumerate(micro):
            last = i == len(micro) - 1
            with strategy.block_backward_sync() if not last else nullcontext():
                loss = self.microbatch_loss(mb)
                self.manual_backward(loss * self.loss_scale / len(micro))
            total += loss.detach()
        return total / len(micro)

    def _log_step(self, loss: torch.Tensor, lr: float, grad_norm) -> None:
        # Wall time since the previous step ended: data loading, Lightning's loop and logging
        # included, so tokens/s is what the whole run achieves, not just the model's math.
        now = time.perf_counter()
        elapsed, self._last_step_end = now - self._last_step_end, now
        world = self.derived.world_size
        metrics = {
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": self.tokens_per_step / elapsed,
            "tflops_per_rank": self.flops_per_step / elapsed / world / 1e12,
            "consumed_samples": float(self.consumed_samples),
        }
        for name, value in metrics.items():
            self.log(name, value, prog_bar=name in ("loss", "lr", "tokens_per_s", "tflops_per_rank"),
                     on_step=True, on_epoch=False, rank_zero_only=True, batch_size=1)

    # Validation ------------------------------------------------------------------------------
    def on_validation_epoch_start(self) -> None:
        self._val_losses = []

    def validation_step(self, batch: Dict[str, torch.Tensor], batch_idx: int) -> None:
        if self.derived.pp > 1:
            loss = self.pipeline.eval_step(batch["tokens"], batch["labels"], batch["loss_mask"],
                                               **self._stage_inputs(batch)) / self.loss_scale
        else:
            loss = torch.stack([self.microbatch_loss(mb) for mb in self._microbatches(batch)]).mean()
        self._val_losses.append(self._dp_mean(loss))

    def on_validation_epoch_end(self) -> None:
        self._last_step_end = None  # validation time is not training throughput
        if self._val_losses:
            loss = torch.stack(self._val_losses).mean()
            self.log("val_loss", loss, prog_bar=True, rank_zero_only=True, batch_size=1)
            self.log("val_ppl", loss.exp(), rank_zero_only=True, batch_size=1)

    def configure_optimizers(self):
        return self.build_optimizer(self.trainer.strategy.grad_buffer)

    def build_optimizer(self, grad_buffer) -> MegatronOptimizer:
        """AdamW over the model through its gradient buffer (the strategy builds it before this
        hook): fp32 main weights for 16-bit models, sharded over DP with the distributed optimizer;
        ``optim.impl`` picks the kernel (torch fused or foreach, apex FusedAdam)."""
        o = self.cfg.optim
        return MegatronOptimizer(self.model, grad_buffer, self.ps, lr=o.lr,
                                 betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps, weight_decay=o.weight_decay,
                                 clip_grad=o.clip_grad, scaler=self.loss_scaler, impl=o.impl)
