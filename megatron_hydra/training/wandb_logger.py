"""``trainer.logger=[...,wandb]``: rank 0's metrics and the resolved config in a W&B run.

wandb is optional (``pip install '.[wandb]'``); the launcher refuses the logger before any worker
starts when it is missing (``config.observability``). ``WANDB_MODE=offline`` (or
``trainer.wandb.mode=offline``) keeps everything in ``<wandb dir>/wandb/offline-run-*`` (``wandb
sync`` uploads it later). Only rank 0 builds the logger, so only rank 0 starts a W&B run. The run is finished explicitly when training ends,
successfully or not: workers leave with ``os._exit``, which skips wandb's exit hook, and a run
left open would lose its last records.
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

from omegaconf import OmegaConf
from pytorch_lightning.loggers import WandbLogger

from megatron_hydra.config import RunConfig


def default_names(run_dir: str) -> Tuple[str, str]:
    """(name, group) of the run in ``run_dir``: its last two path parts (``<date>/<time>`` of a
    single run, ``<time>/<job>`` of a sweep's job) and its parent directory's name (shared by the
    jobs of one sweep)."""
    parts = os.path.normpath(os.path.abspath(run_dir)).split(os.sep)
    return "/".join(parts[-2:]), parts[-2]


def build_wandb_logger(cfg: RunConfig) -> WandbLogger:
    import wandb

    w = cfg.trainer.wandb
    name, group = default_names(cfg.run_dir)
    save_dir = w.dir or cfg.run_dir
    os.makedirs(save_dir, exist_ok=True)
    config = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    # console="off": rank 0's log is already in the run dir (train.log / launch.log), and wandb's
    # capture would wrap this process's stdout and stderr.
    return WandbLogger(project=w.project, name=w.name or name, group=w.group or group, save_dir=save_dir,
                       tags=list(w.tags) or None, config=config, settings=wandb.Settings(console="off"),
                       **({"mode": w.mode} if w.mode else {}))


def finish_wandb(loggers, failed: bool) -> None:
    """Close the W&B run of any ``WandbLogger`` in ``loggers`` (exit code 1 when ``failed``)."""
    for logger in loggers:
        run: Optional[object] = getattr(logger, "_experiment", None) if isinstance(logger, WandbLogger) else None
        if run is not None:
            run.finish(exit_code=1 if failed else 0)
