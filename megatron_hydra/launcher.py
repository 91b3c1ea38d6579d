"""Turn one composed config into running workers.

- Under an external launcher (torchrun, or SLURM's srun with one task per device) this process is
  one worker: check the launcher's world size against the config, then train in-process.
- Otherwise spawn ``trainer.devices`` local workers with torch's elastic launch API. Each worker
  is a fresh ``python -m megatron_hydra.training.worker`` that reads the resolved config from the
  run dir. Lightning's own launcher is never used: it re-executes ``sys.argv``, which breaks Hydra's
  output dir and multirun. If any worker fails, the agent stops the others at once and ``run``
  raises ``WorkerFailed`` naming the rank and its error.

Config errors are raised before any process starts.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import uuid
from dataclasses import dataclass
from typing import Dict, Optional

from omegaconf import OmegaConf

from megatron_hydra.config import Derived, RunConfig, derive
from megatron_hydra.errors import ConfigError, MegatronHydraError

CONFIG_FILE = "resolved_config.yaml"


class WorkerFailed(MegatronHydraError):
    """A worker process failed; the message names the first failing rank and its error."""


@dataclass(frozen=True)
class ExternalLaunch:
    """Ranks handed to this process by torchrun or SLURM."""

    kind: str
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int


def _slurm_master_addr(nodelist: str) -> str:
    """First host of a SLURM nodelist such as ``gpu[003-005,007],login1`` -> ``gpu003``."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    prefix, ranges = match.group(1), match.group(2)
    return prefix if not ranges else prefix + ranges.split(",")[0].split("-")[0]


def detect_external(env: Optional[Dict[str, str]] = None) -> Optional[ExternalLaunch]:
    """torchrun sets TORCHELASTIC_RUN_ID and RANK/WORLD_SIZE; an srun step sets SLURM_PROCID and
    SLURM_STEP_NUM_TASKS. A batch script running ``python launch.py`` itself is not an external
    launch: we spawn the local workers ourselves."""
    env = os.environ if env is None else env
    if "TORCHELASTIC_RUN_ID" in env and "RANK" in env:
        return ExternalLaunch("torchrun", int(env["RANK"]), int(env["LOCAL_RANK"]), int(env["WORLD_SIZE"]),
                              int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])))
    # SLURM_STEP_NUM_TASKS exists only inside an srun step: a batch script that runs python
    # directly under --ntasks>1 is not a worker of a launch, and must not wait for peers.
    if int(env.get("SLURM_STEP_NUM_TASKS", "1")) > 1 and "SLURM_PROCID" in env:
        return ExternalLaunch("slurm", int(env["SLURM_PROCID"]), int(env.get("SLURM_LOCALID", "0")),
                              int(env["SLURM_STEP_NUM_TASKS"]),
                              int(env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_NTASKS_PER_NODE", "1")).split("(")[0]))
    return None


def slurm_rendezvous_env(env: Dict[str, str]) -> Dict[str, str]:
    """The variables torch.distributed's env:// init needs, derived from SLURM's."""
    return {
        "RANK": env["SLURM_PROCID"],
        "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
        "WORLD_SIZE": env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS", "1")),
        "MASTER_ADDR": env.get("MASTER_ADDR") or _slurm_master_addr(env.get("SLURM_JOB_NODELIST", "127.0.0.1")),
        "MASTER_PORT": env.get("MASTER_PORT") or str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000),
    }


def preflight(cfg: RunConfig, derived: Derived, external: Optional[ExternalLaunch]) -> None:
    """Checks that need the machine (not just the config), still before any worker starts."""
    if cfg.trainer.accelerator == "gpu":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("trainer.accelerator=gpu but no CUDA device is visible: use trainer=cpu")
        if external is None and torch.cuda.device_count() < cfg.trainer.devices:
            raise ConfigError(
                f"trainer.devices={cfg.trainer.devices} but this machine has {torch.cuda.device_count()} GPUs: lower it"
            )
    from megatron_hydra.checkpoint.callback import start_point

    start_point(cfg, derived)  # a missing, incomplete or mismatching checkpoint fails here, in one line
    if external is not None and external.world_size != derived.world_size:
        raise ConfigError(
            f"the {external.kind} launch has {external.world_size} ranks but trainer.devices x trainer.num_nodes = "
            f"{cfg.trainer.devices}x{cfg.trainer.num_nodes} = {derived.world_size}: make them agree"
        )
    if external is None and cfg.trainer.num_nodes > 1:
        raise ConfigError(
            f"trainer.num_nodes={cfg.trainer.num_nodes} needs an external launcher on every node "
            "(torchrun --nnodes ... or srun): this process can only spawn workers on its own node"
        )
    if cfg.data.name != "synthetic" and (external is None or external.rank == 0):
        # Build (or find cached) corpus and index arrays now: a bad file is a one-line DataError
        # before any worker starts, and workers then only open caches.
        from megatron_hydra.data.builders import build_datasets

        build_datasets(cfg.data, seq_length=derived.transformer.seq_length, seed=cfg.data.seed,
                       num_samples=derived.split_samples, vocab_size=derived.transformer.vocab_size)


def write_config(cfg: RunConfig, run_dir: str) -> str:
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, CONFIG_FILE)
    with open(path, "w") as f:
        f.write(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    return path


def read_config(path: str) -> RunConfig:
    loaded = OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.load(path))
    return OmegaConf.to_object(loaded)


def _spawn_local(cfg: RunConfig, derived: Derived, config_path: str) -> None:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    launch = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=derived.world_size,
        run_id=uuid.uuid4().hex, rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0",
        max_restarts=0, monitor_interval=0.1, shutdown_timeout=5,
        logs_specs=DefaultLogsSpecs(log_dir=os.path.join(cfg.run_dir, "workers")),
    )
    previous = signal.signal(signal.SIGUSR1, _forward_to_workers)
    try:
        elastic_launch(launch, sys.executable)("-m", "megatron_hydra.training.worker", config_path)
    except ChildFailedError as e:
        rank = root_cause_rank(cfg.run_dir, e.failures)
        summary = failure_summary(cfg.run_dir, rank, e.failures[rank].exitcode)
        raise WorkerFailed(f"rank {rank} failed: {summary}") from None
    finally:
        signal.signal(signal.SIGUSR1, previous)


def _forward_to_workers(signum, frame) -> None:
    """SIGUSR1 to the launcher asks every local worker to save and stop (the workers run in their
    own sessions, so a signal to the launcher alone would not reach them)."""
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                children = [int(pid) for pid in f.read().split()]
        except OSError:
            continue
        for pid in children:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass


def root_cause_rank(run_dir: str, failures: Dict[int, object]) -> int:
    """When one rank dies, its peers then fail in their collectives; the root cause is the rank
    that wrote its error file first (a rank killed by a signal writes none)."""
    written = {r: os.stat(p).st_mtime_ns for r in failures
               if os.path.exists(p := os.path.join(run_dir, f"rank{r}.error"))}
    return min(written, key=written.get) if written else min(failures)


def failure_summary(run_dir: str, rank: int, exitcode: int) -> str:
    """The one-line error a worker left in ``rank<N>.error`` (its traceback follows in the file)."""
    path = os.path.join(run_dir, f"rank{rank}.error")
    if os.path.exists(path):
        with open(path) as f:
            first = f.readline().strip()
        return f"{first} (traceback: {path})"
    if exitcode < 0:
        return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def run(cfg: RunConfig) -> None:
    """Validate, then train with this process as a worker or with spawned local workers."""
    derived = derive(cfg)
    external = detect_external()
    preflight(cfg, derived, external)
    from megatron_hydra.training.worker import run_worker, run_worker_and_exit

    config_path = write_config(cfg, cfg.run_dir)
    if external is not None:
        if external.kind == "slurm":
            os.environ.update(slurm_rendezvous_env(dict(os.environ)))
        run_worker_and_exit(cfg, derived, external.rank, external.local_rank, external.local_world_size)
    if derived.world_size == 1:
        # In this process; a fresh port per run, so multirun jobs never meet a stale store.
        from megatron_hydra.training.worker import free_port

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", LOCAL_RANK="0",
                          WORLD_SIZE="1")
        run_worker(cfg, derived, local_rank=0, local_world_size=1)
        return
    _spawn_local(cfg, derived, config_path)
