"""Which device a rank computes on, picked once and bound before its process group exists.

NCCL pins each communicator to the current CUDA device when the process group is created, and it
refuses two ranks on one GPU. So a worker must make its own GPU current before
``init_process_group``, and every later CUDA call (the memory plan's device query, the model, the
strategy, pinned-memory loaders) must use that same device. Nothing here touches another rank's
GPU: the pick is arithmetic on counts, the bind touches only the picked device.

``pick_device`` is pure (the dry run calls it with fake CUDA and no GPU); ``bind_device`` adds the
side effect (``torch.cuda.set_device``); ``init_process_group`` binds, then creates the group with
``device_id`` so NCCL initialises its communicator on that device at once.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Mapping, Optional

import torch
import torch.distributed as dist

from megatron_hydra import slurm
from megatron_hydra.errors import ConfigError


def visible_gpus() -> int:
    """CUDA devices this process may use (``CUDA_VISIBLE_DEVICES`` and SLURM's binding already
    applied by the driver); 0 without CUDA. Creates no CUDA context."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pick_device(accelerator: str, local_rank: int, visible: int) -> torch.device:
    """This rank's device. One visible GPU is the rank's own (SLURM ``--gpus-per-task=1``, or
    ``CUDA_VISIBLE_DEVICES`` set to one id per task): ``cuda:0``. Several visible GPUs are shared
    by the node's ranks (our local launcher, torchrun, ``srun`` without per-task binding): local
    rank i takes ``cuda:i``."""
    if accelerator != "gpu":
        return torch.device("cpu")
    if visible < 1:
        raise ConfigError("trainer.accelerator=gpu but no CUDA device is visible to this process: use "
                          "trainer.accelerator=cpu, or check CUDA_VISIBLE_DEVICES and the job's GPU allocation")
    if visible == 1:
        return torch.device("cuda", 0)
    if local_rank >= visible:
        raise ConfigError(
            f"local rank {local_rank} has no GPU of its own: this process sees {visible} GPUs "
            f"(CUDA_VISIBLE_DEVICES): run at most {visible} ranks per node (trainer.devices, torchrun "
            "--nproc-per-node, srun --ntasks-per-node) or give each task its own GPU (srun --gpus-per-task=1)"
        )
    return torch.device("cuda", local_rank)


def local_rank_from_env(env: Optional[Mapping[str, str]] = None) -> int:
    """This process's rank on its node before the process group exists: ``LOCAL_RANK`` (our
    launcher, torchrun), else ``SLURM_LOCALID`` inside an srun step, else 0."""
    env = os.environ if env is None else env
    if "LOCAL_RANK" in env:
        return int(env["LOCAL_RANK"])
    if slurm.in_srun_step(env):
        return slurm.step_layout(env)["local_rank"]
    return 0


def this_rank_device(accelerator: str) -> torch.device:
    """``pick_device`` for this process, from its environment and the visible GPUs."""
    return pick_device(accelerator, local_rank_from_env(), visible_gpus() if accelerator == "gpu" else 0)


def bind_device(accelerator: str, local_rank: int) -> torch.device:
    """Pick this rank's device and make it the current CUDA device; idempotent."""
    device = pick_device(accelerator, local_rank, visible_gpus() if accelerator == "gpu" else 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def init_process_group(accelerator: str, local_rank: int, timeout: timedelta) -> torch.device:
    """Bind this rank's device, then join the ``env://`` process group on it (NCCL on GPU, gloo on
    CPU). Returns the device. Must come before any collective."""
    device = bind_device(accelerator, local_rank)
    if device.type == "cuda":
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        dist.init_process_group("gloo", timeout=timeout)
    return device
