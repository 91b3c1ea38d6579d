"""Everything a rank does once the process group exists: mesh, data, model, Lightning Trainer."""

from __future__ import annotations

import logging
import os
import signal
import warnings
from functools import partial
from typing import Optional, Sequence

import pytorch_lightning as pl
import torch
from lightning_fabric.utilities.seed import pl_worker_init_function
from omegaconf import OmegaConf
from pytorch_lightning.callbacks import TQDMProgressBar
from torch.utils.data import DataLoader

from megatron_hydra.checkpoint.plan import start_point
from megatron_hydra.config import Derived, RunConfig
from megatron_hydra.data.arch_datasets import dataset_factory
from megatron_hydra.data.builders import build_datasets
from megatron_hydra.data.samplers import GlobalBatchSampler
from megatron_hydra.data.sequence_shards import ShardingCollate
from megatron_hydra.parallel.random import seed_model_parallel, stage_seed
from megatron_hydra.parallel.state import ParallelState, device_for
from megatron_hydra.training.checkpointing import CheckpointCallback
from megatron_hydra.training.evaluation import evaluation_callbacks
from megatron_hydra.training.loggers import build_loggers
from megatron_hydra.training.module import LMModule
from megatron_hydra.training.step_profiler import StepProfiler
from megatron_hydra.training.strategy import MegatronStrategy
from megatron_hydra.training.wandb_logger import finish_wandb

log = logging.getLogger("megatron_hydra")


def _setup_logging(run_dir: str, rank: int) -> list:
    """Only rank 0 talks: INFO to the console and ``train.log``; other ranks warnings only.
    Returns the handlers added here, for ``train`` to remove when the run ends."""
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*is smaller than the logging interval.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    warnings.filterwarnings("ignore", message=".*have no `val_dataloader`.*")
    # Validation metrics are reduced over data-parallel ranks before they are logged.
    warnings.filterwarnings("ignore", message=".*It is recommended to use `self.log\\(.*sync_dist=True.*")
    level = logging.INFO if rank == 0 else logging.WARNING
    for name in ("megatron_hydra", "pytorch_lightning", "lightning", "lightning_fabric"):
        logging.getLogger(name).setLevel(level)
    root = logging.getLogger()
    if rank != 0:
        root.setLevel(logging.WARNING)
        return []
    if any(isinstance(h, logging.FileHandler) for h in root.handlers):
        return []  # in the launching process, whose Hydra handlers already write the run's log
    # A spawned worker: Hydra's log handlers live in the launching process, not here.
    os.makedirs(run_dir, exist_ok=True)
    fmt = logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    added = [logging.FileHandler(os.path.join(run_dir, "train.log")), logging.StreamHandler()]
    for handler in added:
        handler.setFormatter(fmt)
        root.addHandler(handler)
    root.setLevel(logging.INFO)
    return added


def _write_derived(run_dir: str, derived: Derived) -> None:
    values = {k: v for k, v in derived.__dict__.items() if k != "transformer"}
    values["transformer"] = {k: str(v) if isinstance(v, torch.dtype) else v
                             for k, v in derived.transformer.__dict__.items()}
    values["layers_per_stage"] = list(derived.layers_per_stage)
    values["split_samples"] = list(derived.split_samples)
    with open(os.path.join(run_dir, "derived.yaml"), "w") as f:
        f.write(OmegaConf.to_yaml(OmegaConf.create(values)))


def build_dataloaders(cfg: RunConfig, derived: Derived, ps: ParallelState, consumed_samples: int = 0):
    """Train (and, when validation is on, valid) loaders yielding this DP rank's share of each
    global batch (this CP rank's chunks of its sequences); training starts after
    ``consumed_samples`` (a resumed run)."""
    tcfg = derived.transformer
    sizes = derived.split_samples
    train_ds, valid_ds, _ = build_datasets(cfg.data, seq_length=tcfg.seq_length, seed=cfg.data.seed,
                                           num_samples=sizes, vocab_size=tcfg.vocab_size,
                                           make_dataset=dataset_factory(cfg.data, tcfg, cfg.data.seed))

    workers = cfg.data.num_workers

    def loader(ds, total, consumed=0):
        sampler = GlobalBatchSampler(total, derived.global_batch_size, ps.dp_rank, ps.dp_size, consumed)
        # On GPU, batches land in pinned memory, so that Lightning's copy to the device
        # (``non_blocking=True`` for CUDA) overlaps with compute.
        # Context parallelism: each cp rank keeps its chunks of every sequence (data.sequence_shards).
        return DataLoader(ds, batch_sampler=sampler, num_workers=workers, persistent_workers=workers > 0,
                          pin_memory=cfg.trainer.accelerator == "gpu", collate_fn=collate,
                          worker_init_fn=partial(_loader_worker_init, rank=ps.rank) if workers else None)

    collate = ShardingCollate(ps.cp_size, ps.cp_rank) if ps.cp_size > 1 else None

    valid = loader(valid_ds, min(len(valid_ds), sizes[1])) if valid_ds is not None and sizes[1] else None
    return loader(train_ds, sizes[0], consumed_samples), valid


def _loader_worker_init(worker_id: int, rank: int) -> None:
    """A DataLoader worker ignores SIGINT: in a one-process run it shares the terminal's process
    group with the training process, and a Ctrl-C that ended it would fail the step boundary's save
    (the training process alone handles the stop request). Then Lightning's per-worker seeding,
    which it adds itself only to loaders without a ``worker_init_fn``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pl_worker_init_function(worker_id, rank=rank)


class _ProgressBar(TQDMProgressBar):
    """Lightning's bar with the module's latest step metrics (``LMModule.write_step_metrics``)."""

    def get_metrics(self, trainer, pl_module):
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        items.update(getattr(pl_module, "progress_metrics", {}))
        return items


def build_trainer(cfg: RunConfig, derived: Derived, strategy: MegatronStrategy, rank: int,
                  checkpoints: Optional[CheckpointCallback] = None,
                  callbacks: Sequence[pl.Callback] = ()) -> pl.Trainer:
    # A resumed run continues the metric history of its run directory from its start step.
    start = checkpoints.start if checkpoints is not None else None
    loggers = build_loggers(cfg, int(start["step"]) if start else 0, rank)
    val = cfg.trainer.val_check_interval
    return pl.Trainer(
        accelerator="gpu" if cfg.trainer.accelerator == "gpu" else "cpu",
        devices=1,
        strategy=strategy,
        max_steps=cfg.trainer.max_steps,
        logger=loggers,
        log_every_n_steps=cfg.trainer.log_every_n_steps,
        enable_progress_bar=cfg.trainer.enable_progress_bar and rank == 0,
        enable_model_summary=rank == 0,
        callbacks=([checkpoints] if checkpoints else []) + ([_ProgressBar()] if cfg.trainer.enable_progress_bar and rank == 0 else [])
                  + _profiler(cfg, rank) + list(callbacks),
        enable_checkpointing=False,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
        val_check_interval=val if val else None,
        limit_val_batches=cfg.trainer.limit_val_batches if val else 0,
        check_val_every_n_epoch=None if val else 1,
        default_root_dir=cfg.run_dir,
        precision="64-true" if derived.transformer.params_dtype == torch.float64 else "32-true",
    )


def _profiler(cfg: RunConfig, rank: int) -> list:
    """``trainer.profile_steps``: the step profiler callback of this rank, if asked for."""
    if cfg.trainer.profile_steps is None:
        return []
    first, last = cfg.trainer.profile_steps
    return [StepProfiler(first, last, cfg.run_dir, rank, cuda=cfg.trainer.accelerator == "gpu")]


def train(cfg: RunConfig, derived: Derived, local_rank: int) -> None:
    rank = torch.distributed.get_rank()
    handlers = _setup_logging(cfg.run_dir, rank)
    try:
        _train(cfg, derived, local_rank, rank)
    finally:
        for handler in handlers:
            logging.getLogger().removeHandler(handler)
            handler.close()


def _train(cfg: RunConfig, derived: Derived, local_rank: int, rank: int) -> None:
    device = device_for(cfg.trainer.accelerator, local_rank)
    ps = ParallelState.build(tp=derived.tp, pp=derived.pp, dp=derived.dp, cp=derived.cp, device_type=device.type,
                             ep=derived.ep, etp=derived.etp)
    if rank == 0:
        _write_derived(cfg.run_dir, derived)
        log.info("layout: world=%d tp=%d pp=%d cp=%d dp=%d, %d micro-batches of %d per step",
                 derived.world_size, derived.tp, derived.pp, derived.cp, derived.dp, derived.num_microbatches,
                 cfg.data.micro_batch_size)
    # Same seed on every DP replica; Megatron offsets it per pipeline stage. The default generator
    # is the same on every TP rank (replicated dropout); the TP-sharded stream differs per TP rank.
    seed = stage_seed(cfg.seed, ps.pp_rank)
    pl.seed_everything(seed, workers=True, verbose=False)
    seed_model_parallel(seed, ps.tp_rank)
    module = LMModule(cfg, derived, ps, device)  # built and initialised on its device
    if module.reference is not None:  # DPO's reference: the starting weights
        module.reference.load(cfg.checkpoint.load, cfg.peft.adapter)
    strategy = MegatronStrategy(ps, device, grad_bucket_size=cfg.parallel.grad_bucket_size,
                                distributed_optimizer=cfg.optim.distributed_optimizer,
                                overlap_grad_reduce=cfg.parallel.overlap_grad_reduce,
                                data_parallel=cfg.parallel.data_parallel, local_rank=local_rank, node_rank=rank // max(1, cfg.trainer.devices))
    start = start_point(cfg, derived)
    train_loader, valid_loader = build_dataloaders(cfg, derived, ps, start["consumed_samples"] if start else 0)
    checkpoints = CheckpointCallback(cfg, derived, ps, start)
    trainer = build_trainer(cfg, derived, strategy, rank, checkpoints, evaluation_callbacks(cfg, derived, ps))
    try:
        trainer.fit(module, train_dataloaders=train_loader, val_dataloaders=valid_loader)
    except BaseException:
        finish_wandb(trainer.loggers, failed=True)
        raise
    finish_wandb(trainer.loggers, failed=False)
    if (cfg.trainer.generate_sample_tokens and cfg.data.name != "synthetic" and cfg.model.arch == "gpt"
            and not checkpoints.stopped_by_signal):
        _print_sample(cfg, derived, module, ps)


def _print_sample(cfg: RunConfig, derived: Derived, module, ps: ParallelState) -> None:
    """Every rank generates (the inference engine runs the model at the run's layout); rank 0 talks."""
    from megatron_hydra.training.inference_job import no_sample_reason, training_sample

    reason = no_sample_reason(cfg, ps)
    if reason is not None:
        log.info("no sample (the inference engine does not run %s): run python -m megatron_hydra.generate "
                 "checkpoint=... on the saved checkpoint", reason)
        return
    sample = training_sample(module.model, cfg, derived.transformer, ps)
    if ps.rank == 0:
        log.info("sample from the trained model:\n%s", sample)
