"""The LightningModule: one ``training_step`` is one optimizer step over one global batch.

The batch Lightning hands in is this data-parallel rank's share of the global batch
(``num_microbatches x micro_batch_size`` samples). The step itself (zeroing, micro-batches or the
pipeline schedule, the data-parallel reduce, the optimizer step, the gradient norm) is owned by
``training.step.TrainStep``; this module holds the model, its loss, and what a run reports. The
logged loss is the mean over the whole global batch, identical for every layout. A loss or
gradient norm that is NaN or inf stops the run (``training.guard``).

Lightning serves the loop, callbacks, loggers, progress bar and validation. Three of its features
are bypassed, each in one place: automatic optimisation (``TrainStep`` runs the step; it reaches
Lightning only through ``manual_backward`` and the wrapped optimizer's ``step``, so hooks and
``trainer.global_step`` work as usual), ``self.log`` for step metrics (``write_step_metrics``:
Lightning's result record costs more host time per metric than a small model's step), and
resuming (``training.checkpointing.set_resumed_step``: Lightning resumes only from its own
checkpoint format).

No host sync per step. A GPU step is a queue of kernels the host runs ahead of; anything that
reads a device value on the host (``.item()``, ``float(t)``, ``if t < x``, logging a tensor that
Lightning converts) makes the host wait for the queue to drain. Such reads happen only at the
steps ``host_sync_step`` names, the same on every rank: the logging steps
(``trainer.log_every_n_steps``) and the steps after which a checkpoint is due. There the guard
reads its flag, the metrics are read in one transfer and logged as host tensors, and the
checkpoint callback agrees on a stop request. Throughput and MFU are averaged over the steps since
the previous logging step (a single step's wall time means nothing when the host runs ahead).
fp16 is the exception: its loss scaler decides on the host whether to skip a step, one read per
step (``parallel.optimizer``).

With pipeline parallelism (pp > 1) ``self.model`` is a ``ModuleList`` of this rank's model chunks
(one per virtual stage it holds, each a ``GPTModel`` keyed by logical layer names) and the
micro-batches run through the pipeline schedule (``parallel.pipeline``) instead of the loop.

With ``objective=dpo`` (``training.dpo``) the module also holds the DPO loss and the reference
model (``reference``, outside ``self.model``: never in the optimizer or a checkpoint); a batch
gains its rows' reference sums before the micro-batches run (``with_reference``), in training and
validation alike, and the logged steps add the rewards' metrics.
"""

from __future__ import annotations

import logging
import time
from typing import Dict, Optional

import numpy as np
import pytorch_lightning as pl
import torch

from megatron_hydra.config import Derived, RunConfig
from megatron_hydra.models.archs import ARCHS
from megatron_hydra.models.moe import MoELayer
from megatron_hydra.models.stages import build_model, build_stage_chunks
from megatron_hydra.parallel import collectives as C
from megatron_hydra.parallel.muon import MuonSettings
from megatron_hydra.parallel.optimizer import MegatronOptimizer
from megatron_hydra.parallel.pipeline import Pipeline
from megatron_hydra.parallel.state import ParallelState
from megatron_hydra.planning.flops import model_flops_per_step
from megatron_hydra.planning.peak import device_peak_tflops
from megatron_hydra.training.compile import compile_for_training
from megatron_hydra.training.dpo import METRICS as DPO_METRICS
from megatron_hydra.training.dpo import REFERENCE, DPOLoss, Reference
from megatron_hydra.training.guard import FiniteGuard
from megatron_hydra.training.memory_peak import peak_memory_bytes, reset_peak_memory
from megatron_hydra.training.precision import DynamicLossScaler
from megatron_hydra.training.step import StepResult, TrainStep, dp_mean, split_microbatches

log = logging.getLogger("megatron_hydra")
# The step metrics shown on the progress bar (all of them go to the loggers).
PROGRESS_BAR_METRICS = ("loss", "lr", "tokens_per_s", "tflops_per_rank", "mfu")


def _rounded(value: float, dtype: torch.dtype) -> float:
    """``value`` as a tensor of ``dtype`` holds it (what a logged tensor's ``.item()`` gives),
    computed on the host: no tensor, so nothing that reads like a device sync."""
    if dtype in (torch.float32, torch.float16):
        return float(np.dtype(str(dtype).removeprefix("torch.")).type(value))
    return float(value)


def host_sync_step(step: int, cfg: RunConfig) -> bool:
    """Whether the step just trained (``step``, 0-based) is one at which every rank reads device
    values on the host: a step Lightning logs (it logs step ``step`` when ``step + 1`` is a multiple
    of ``trainer.log_every_n_steps``) or one after which a checkpoint is due (``step + 1`` a multiple
    of ``checkpoint.every_n_steps``). A function of the step and the config alone, so every rank
    picks the same steps without communicating."""
    every = cfg.checkpoint.every_n_steps
    return (step + 1) % cfg.trainer.log_every_n_steps == 0 or bool(every and (step + 1) % every == 0)


class LMModule(pl.LightningModule):
    """``device``: where the model's storage is allocated and initialised (None: torch's default
    device, which the dry run sets to its fake GPU)."""

    def __init__(self, cfg: RunConfig, derived: Derived, ps: ParallelState, device=None):
        super().__init__()
        # Where the step's own tensors go (the pipeline's buffers): the model's device, known
        # without Lightning (which records a device only when it moves the module).
        self.home_device = torch.device(device) if device is not None else torch.get_default_device()
        self.automatic_optimization = False
        self.cfg, self.derived, self.ps = cfg, derived, ps
        tcfg = derived.transformer
        self._pipeline, self._stages = None, None
        if derived.pp > 1:
            chunks, self._stages = build_stage_chunks(cfg, derived, ps, device)
            self.model = torch.nn.ModuleList(chunks)
        else:
            self.model = build_model(cfg, derived, ps, device)
        self.compile_clock = compile_for_training(cfg, self.model, ps.rank == 0)  # trainer.compile
        self.flops_per_step = model_flops_per_step(tcfg, derived.global_batch_size, cfg.objective.name == "dpo")
        self.tokens_per_step = derived.global_batch_size * tcfg.seq_length
        # Throughput window: when it started (None: at the next step) and the steps it holds.
        self._window_start: Optional[float] = None
        self.progress_metrics: Dict[str, float] = {}  # the latest logged step's, for the progress bar
        self._window_steps = 0
        # Dense peak TFLOP/s of this rank's device for MFU (``on_train_start``); None: no MFU.
        self.peak_tflops: Optional[float] = None
        self.guard = FiniteGuard()
        self._moe_layers: Optional[list] = None
        self.train_step: Optional[TrainStep] = None  # built when training starts (``on_train_start``)
        # Samples trained on so far: carried as is through checkpoints (a resumed run may use
        # another global batch size, so it is not step x batch).
        self.consumed_samples = 0
        # fp16 only: the loss is multiplied by the scale before backward (parallel.optimizer
        # divides it out of the grads and skips overflowing steps).
        self.loss_scaler = DynamicLossScaler.from_config(cfg.precision) if tcfg.params_dtype == torch.float16 else None
        # Losses are summed in fp32 even when the model runs in 16 bits.
        self.loss_dtype = torch.float64 if tcfg.params_dtype == torch.float64 else torch.float32
        # objective=dpo (``training.dpo``): its loss and the reference model; None for the lm objective.
        self.dpo: Optional[DPOLoss] = None
        self.reference: Optional[Reference] = None
        if cfg.objective.name == "dpo":
            o = cfg.objective
            self.dpo = DPOLoss(o.beta, o.label_smoothing, tcfg.seq_length, ps.cp_group)
            self.reference = Reference(self, device)

    @property
    def moe_layers(self) -> list:
        """This rank's Mixture-of-Experts layers (``models.moe``)."""
        if self._moe_layers is None:
            self._moe_layers = [m for m in self.model.modules() if isinstance(m, MoELayer)]
        return self._moe_layers

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    # Loss ------------------------------------------------------------------------------------
    def _loss(self, output: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
        """The family's micro-batch loss (``models.archs``); under context parallelism this rank's
        share of it, against the token count of the whole sequences."""
        loss = ARCHS[self.derived.transformer.arch].loss
        return loss(output, loss_mask) if self.ps.cp_size == 1 else loss(output, loss_mask, self.ps.cp_group)

    def model_inputs(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """The batch fields the model reads besides tokens (``models.archs``), labels included."""
        return {k: batch[k] for k in ARCHS[self.derived.transformer.arch].inputs if k in batch}

    def microbatch_loss(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        """The micro-batch's loss: the mean over its unmasked tokens (``models.archs``: per model
        family), or with ``objective=dpo`` over its pairs (the batch carries the rows' reference sums)."""
        output = self.model(batch["tokens"], **self.model_inputs(batch))
        if self.dpo is not None:
            return self.dpo(output, batch["loss_mask"], batch["document_ids"], batch[REFERENCE])
        return self._loss(output, batch["loss_mask"])

    def with_reference(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """``objective=dpo``: the batch with its rows' reference document sums (the reference
        model's forward-only pass, ``training.dpo``); the batch itself otherwise."""
        return batch if self.reference is None else {**batch, REFERENCE: self.reference(batch)}

    def stage_inputs(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """The batch fields besides tokens, labels and loss mask that every pipeline stage reads."""
        return {k: v for k, v in self.model_inputs(batch).items() if k != "labels"}

    def pipeline_target(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        """What the pipeline schedule cuts into micro-batches for the last stage's loss function
        (``_pipeline_loss``): the loss mask; with ``objective=dpo`` the loss mask, document ids and
        reference sums side by side (the schedule splits the target along rows alone)."""
        if self.dpo is None:
            return batch["loss_mask"]
        parts = (batch["loss_mask"], batch["document_ids"], batch[REFERENCE])
        return torch.cat([t.to(self.loss_dtype) for t in parts], dim=1)

    @property
    def pipeline(self) -> Pipeline:
        """Built on first use, once Lightning has moved the chunks to their device."""
        if self._pipeline is None:
            self._pipeline = Pipeline(list(self.model), self._stages, self.ps, self.cfg.parallel.pipeline_schedule,
                                      self.derived.num_microbatches, self._pipeline_loss, self.home_device,
                                      stage_io=self._stage_io)
        return self._pipeline

    def _stage_io(self, stage: int):
        """(input, output) of virtual stage ``stage`` for one micro-batch, as meta tensors: token
        ids into the first stage, the hidden state between stages (this rank's sequence slice
        under sequence parallelism), the per-token loss out of the last (BERT appends a column:
        each sample's sentence-order loss)."""
        tcfg, mb = self.derived.transformer, self.cfg.data.micro_batch_size
        seq = tcfg.seq_length // self.ps.cp_size  # this rank's chunks under context parallelism
        local_seq = seq // self.ps.tp_size if tcfg.sequence_parallel else seq
        hidden = torch.empty(mb, local_seq, tcfg.hidden_size, dtype=tcfg.params_dtype, device="meta", requires_grad=True)
        tokens = torch.empty(mb, seq, dtype=torch.int64, device="meta")
        loss = torch.empty(mb, seq + (tcfg.arch == "bert"), dtype=self.loss_dtype, device="meta", requires_grad=True)
        last = len(self.derived.layers_per_stage) - 1
        return (tokens if stage == 0 else hidden), (loss if stage == last else hidden)

    def _pipeline_loss(self, per_token_loss: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The pipeline's loss function: the micro-batch loss (of ``pipeline_target``'s target)
        times the loss scale (1 unless fp16)."""
        if self.dpo is None:
            return self._loss(per_token_loss, target) * self.loss_scale
        s = per_token_loss.shape[1]
        return self.dpo(per_token_loss, target[:, :s], target[:, s:2 * s], target[:, 2 * s:]) * self.loss_scale

    # Training --------------------------------------------------------------------------------
    def on_train_start(self) -> None:
        # The one place the step meets Lightning: its backward (hooks) and its wrapped optimizer
        # (``trainer.global_step``, ``on_before_optimizer_step``); see ``training.step``.
        self.train_step = TrainStep(self, self.optimizers(use_pl_optimizer=False), backward=self.manual_backward,
                                    step_optimizer=self.optimizers().step)
        if self.ps.rank != 0:  # only rank 0 logs
            return
        tcfg = self.derived.transformer
        self.peak_tflops, source = device_peak_tflops(self.device, tcfg.hidden_size, tcfg.params_dtype,
                                                      self.cfg.trainer.peak_tflops)
        if self.peak_tflops is None:
            log.info("mfu not logged: %s", source)
        else:
            log.info("mfu against %.4g TFLOP/s: %s", self.peak_tflops, source)

    def on_train_batch_start(self, batch, batch_idx) -> None:
        if self._window_start is None:
            self._window_start, self._window_steps = time.perf_counter(), 0

    def training_step(self, batch: Dict[str, torch.Tensor], batch_idx: int) -> None:
        step = self.trainer.global_step
        if self.compile_clock is not None:
            self.compile_clock.start()
        result = self.train_step(batch, step)
        if self.compile_clock is not None:
            self.compile_clock.stop()
        self.consumed_samples += self.derived.global_batch_size
        self._window_steps += 1
        if host_sync_step(step, self.cfg):
            self.guard.verify()  # before anything of a non-finite step is logged
            self._log_step(step, result)

    def _log_step(self, step: int, result: StepResult) -> None:
        """Log this step's metrics: the device values are read in one transfer, and the numbers go
        to the loggers directly (``write_step_metrics``)."""
        loss, lr, grad_norm = result.loss, result.lr, result.grad_norm
        read = [loss.detach().double().reshape(())]
        if grad_norm is not None:
            read.append(grad_norm.detach().to(loss.device, torch.float64).reshape(()))
        moe = self._moe_metrics(loss.device)
        dpo = self.dpo.metrics(self.ps, loss.device) if self.dpo is not None else []
        peak = self._peak_memory(loss.device)
        values = torch.stack(read + moe + dpo + peak).tolist()  # the host read of this logging step
        moe_values = values[len(read):len(read) + len(moe)]
        dpo_values = values[len(read) + len(moe):len(read) + len(moe) + len(dpo)]
        # Wall time since the window began: data loading, Lightning's loop, logging and saves
        # included, so tokens/s is what the whole run achieves, not just the model's math.
        now = time.perf_counter()
        elapsed, steps = now - self._window_start, self._window_steps
        self._window_start, self._window_steps = now, 0
        tflops = steps * self.flops_per_step / elapsed / self.derived.world_size / 1e12
        metrics = {"loss": (values[0], loss.dtype), "lr": lr}
        if grad_norm is not None:
            metrics["grad_norm"] = (values[1], grad_norm.dtype)
        metrics.update(tokens_per_s=steps * self.tokens_per_step / elapsed, tflops_per_rank=tflops,
                       consumed_samples=float(self.consumed_samples))
        if moe_values:
            metrics.update(moe_aux_loss=moe_values[0], moe_load_imbalance=moe_values[1])
            if self.derived.transformer.moe.capacity_factor is not None:
                metrics["moe_dropped_fraction"] = moe_values[2]
        metrics.update(zip(DPO_METRICS, dpo_values))
        if peak:
            metrics["peak_memory_gib"] = values[-1] / 2**30
        if self.peak_tflops is not None:
            metrics["mfu"] = 100.0 * tflops / self.peak_tflops  # percent of the device's dense peak
        if self.loss_scaler is not None:
            metrics.update(loss_scale=self.loss_scaler.scale, skipped_steps=float(self.loss_scaler.skipped_steps))
        self.write_step_metrics(step, metrics)

    def write_step_metrics(self, step: int, metrics: Dict[str, object]) -> None:
        """Hand one step's metrics (``name: value`` or ``name: (value, dtype)``; the default dtype
        otherwise) to every logger, as Lightning's own logging would at this step: the value
        rounded to its dtype, the epoch added, rank 0 only, on the steps of
        ``trainer.log_every_n_steps`` (and a stopping step). ``self.log`` would cost a few
        milliseconds per metric on the host (Lightning moves its whole result record on every
        call), longer than a small model's step. The progress bar reads ``progress_metrics``."""
        values = {}
        for name, value in metrics.items():
            value, dtype = value if isinstance(value, tuple) else (value, torch.get_default_dtype())
            values[name] = _rounded(value, dtype)
        self.progress_metrics = {k: v for k, v in values.items() if k in PROGRESS_BAR_METRICS}
        trainer = self.trainer
        if trainer.global_rank != 0 or not ((step + 1) % trainer.log_every_n_steps == 0 or trainer.should_stop):
            return
        for logger in trainer.loggers:
            logger.log_metrics({**values, "epoch": trainer.current_epoch}, step=step)
            logger.save()

    def _peak_memory(self, device) -> list:
        """The largest peak memory of any rank since the previous logging step (see
        ``training.memory_peak``; the worst rank is the one that runs out first), as one scalar on
        ``device`` (a max over the model group, then dp x cp: every rank; read with this step's
        other values); then a new window starts. Empty where the peak cannot be measured."""
        peak = peak_memory_bytes(self.device)
        reset_peak_memory(self.device)
        if peak is None:
            return []
        value = torch.tensor(float(peak), dtype=torch.float64, device=device)
        for group in (self.ps.group("model"), self.ps.dp_cp_group):  # together: every rank
            C.all_reduce(value, group, op=torch.distributed.ReduceOp.MAX)
        return [value]

    def _moe_metrics(self, device) -> list:
        """The last micro-batch's router losses summed over the MoE layers (aux + z, coefficients
        applied), and the worst layer's load imbalance: max / mean routed tokens per expert (1 =
        balanced); over every pipeline stage (a sum and a max over the pp group). With a capacity
        factor, also the fraction of (token, choice) assignments dropped, over every rank's last
        micro-batch (the dropped and routed counts are summed over the same ranks: TP ranks that count
        the same tokens alike, or whole experts' TP ranks each counting its own slice)."""
        if self.derived.transformer.moe is None:
            return []
        aux = torch.zeros((), dtype=torch.float64, device=device)
        imbalance = torch.zeros((), dtype=torch.float64, device=device)
        for m in (m for m in self.moe_layers if m.tokens_per_expert is not None):
            aux += (m.aux_loss + m.z_loss).double().to(device)
            counts = m.tokens_per_expert.double().to(device)
            imbalance = torch.maximum(imbalance, counts.max() / counts.mean().clamp_min(1e-12))
        C.all_reduce(aux, self.ps.pp_group)
        C.all_reduce(imbalance, self.ps.pp_group, op=torch.distributed.ReduceOp.MAX)
        if self.derived.transformer.moe.capacity_factor is None:
            return [aux, imbalance]
        counts = torch.tensor([float(sum(m.dropped for m in self.moe_layers)), float(sum(m.assigned for m in self.moe_layers))],
                              dtype=torch.float64, device=device)
        C.all_reduce(C.all_reduce(counts, self.ps.group("amax")), self.ps.pp_group)  # every rank, every stage
        return [aux, imbalance, counts[0] / counts[1].clamp_min(1.0)]

    # Validation ------------------------------------------------------------------------------
    def on_validation_epoch_start(self) -> None:
        self._val_losses = []

    def validation_step(self, batch: Dict[str, torch.Tensor], batch_idx: int) -> None:
        if self.dpo is not None:
            self.dpo.stats = None  # the rewards logged are the training step's
        batch = self.with_reference(batch)
        if self.derived.pp > 1:
            loss = self.pipeline.eval_step(batch["tokens"], batch["labels"], self.pipeline_target(batch),
                                           **self.stage_inputs(batch)) / self.loss_scale
        else:
            micro = split_microbatches(batch, self.derived.num_microbatches)
            loss = torch.stack([self.microbatch_loss(mb) for mb in micro]).mean()
        self._val_losses.append(dp_mean(loss, self.ps))

    def on_validation_epoch_end(self) -> None:
        self._window_start = None  # validation time is not training throughput
        if self._val_losses:
            loss = torch.stack(self._val_losses).mean()
            self.log("val_loss", loss, prog_bar=True, rank_zero_only=True, batch_size=1)
            if self.dpo is None:  # a DPO loss is no token loss: no perplexity
                self.log("val_ppl", loss.exp(), rank_zero_only=True, batch_size=1)

    def configure_optimizers(self):
        return self.build_optimizer(self.trainer.strategy.grad_buffer)

    def build_optimizer(self, grad_buffer) -> MegatronOptimizer:
        """AdamW over the model through its gradient buffer (the strategy builds it before this
        hook): fp32 main weights for 16-bit models, sharded over DP with the distributed optimizer;
        ``optim.impl`` picks the kernel (torch fused or foreach, apex FusedAdam); ``optim=muon``
        hands the hidden matrices to Muon (``parallel.muon``)."""
        o = self.cfg.optim
        muon = (MuonSettings(o.muon_momentum, o.muon_nesterov, o.muon_ns_steps, o.muon_split_qkv)
                if o.name == "muon" else None)
        return MegatronOptimizer(self.model, grad_buffer, self.ps, lr=o.lr,
                                 betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps, weight_decay=o.weight_decay,
                                 clip_grad=o.clip_grad, scaler=self.loss_scaler, impl=o.impl, muon=muon,
                                 adam_lr=o.muon_adam_lr if muon is not None else None,
                                 overlap_param_gather=self.cfg.parallel.overlap_param_gather)
