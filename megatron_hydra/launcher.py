"""Turn one composed config into running workers.

- Under an external launcher (torchrun, or SLURM's srun with one task per device) this process is
  one worker: check the launcher's world size against the config, then train in-process.
- Otherwise spawn ``trainer.devices`` local workers with torch's elastic launch API. Each worker
  is a fresh ``python -m megatron_hydra.training.worker`` that reads the resolved config from the
  run dir. Lightning's own launcher is never used: it re-executes ``sys.argv``, which breaks Hydra's
  output dir and multirun. If any worker fails, the agent stops the others at once and ``run``
  raises ``WorkerFailed`` naming the rank and its error.

Config errors are raised before any process starts, and so is a run whose memory plan
(``megatron_hydra.planning``) exceeds a device; ``mode=plan`` prints that plan and starts nothing.
"""

from __future__ import annotations

import csv
import logging
import os
import signal
import sys
import uuid
from dataclasses import dataclass
from typing import Dict, Optional

from omegaconf import OmegaConf

from megatron_hydra import slurm
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
    node_rank: int = 0
    num_nodes: int = 1


def detect_external(env: Optional[Dict[str, str]] = None) -> Optional[ExternalLaunch]:
    """torchrun sets TORCHELASTIC_RUN_ID and RANK/WORLD_SIZE (GROUP_RANK: the node); an srun step
    sets SLURM_PROCID and SLURM_STEP_NUM_TASKS (``megatron_hydra.slurm``). A batch script running
    ``python launch.py`` itself is not an external launch: we spawn the local workers ourselves."""
    env = os.environ if env is None else env
    if "TORCHELASTIC_RUN_ID" in env and "RANK" in env:
        world, local_world = int(env["WORLD_SIZE"]), int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"]))
        return ExternalLaunch("torchrun", int(env["RANK"]), int(env["LOCAL_RANK"]), world, local_world,
                              int(env.get("GROUP_RANK", "0")), max(1, world // max(1, local_world)))
    if slurm.in_srun_step(env):
        return ExternalLaunch("slurm", **slurm.step_layout(env))
    return None


def slurm_rendezvous_env(env: Dict[str, str]) -> Dict[str, str]:
    """The variables torch.distributed's env:// init needs, derived from SLURM's."""
    return slurm.rendezvous_env(env)


def check_external_layout(cfg: RunConfig, derived: Derived, external: ExternalLaunch) -> None:
    """The ranks torchrun or SLURM started must be the ones the config describes: the parallel
    layout (and which ranks share a node, hence fast links) follows from trainer.devices x
    trainer.num_nodes, so a disagreement is a config error, not something to adapt to."""
    how = {"torchrun": "torchrun --nnodes/--nproc-per-node", "slurm": "SLURM --nodes/--ntasks-per-node"}[external.kind]
    if external.world_size != derived.world_size:
        raise ConfigError(
            f"the {external.kind} launch has {external.world_size} ranks but trainer.devices x trainer.num_nodes = "
            f"{cfg.trainer.devices}x{cfg.trainer.num_nodes} = {derived.world_size}: make them agree ({how})"
        )
    if external.local_world_size != cfg.trainer.devices:
        raise ConfigError(
            f"the {external.kind} launch runs {external.local_world_size} ranks on node {external.node_rank} but "
            f"trainer.devices={cfg.trainer.devices}: set trainer.devices={external.local_world_size} and "
            f"trainer.num_nodes={external.num_nodes}, or change {how}"
        )


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
    from megatron_hydra.planning.fit import check_fits

    check_fits(cfg, derived)  # the memory plan against the device: a run that cannot fit stops here
    start_point(cfg, derived)  # a missing, incomplete or mismatching checkpoint fails here, in one line
    if external is not None:
        check_external_layout(cfg, derived, external)
    if external is None and cfg.trainer.num_nodes > 1:
        raise ConfigError(
            f"trainer.num_nodes={cfg.trainer.num_nodes} needs an external launcher on every node "
            "(torchrun --nnodes ... or srun): this process can only spawn workers on its own node"
        )
    if cfg.data.name != "synthetic" and (external is None or external.rank == 0):
        # Build (or find cached) corpus and index arrays now: a bad file is a one-line DataError
        # before any worker starts, and workers then only open caches.
        from megatron_hydra.data.arch_datasets import dataset_factory
        from megatron_hydra.data.builders import build_datasets

        build_datasets(cfg.data, seq_length=derived.transformer.seq_length, seed=cfg.data.seed,
                       num_samples=derived.split_samples, vocab_size=derived.transformer.vocab_size,
                       make_dataset=dataset_factory(cfg.data, derived.transformer, cfg.data.seed))


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
    previous = {sig: signal.signal(sig, _forward_to_workers) for sig in (signal.SIGUSR1, signal.SIGUSR2)}
    try:
        elastic_launch(launch, sys.executable)("-m", "megatron_hydra.training.worker", config_path)
    except ChildFailedError as e:
        rank = root_cause_rank(cfg.run_dir, e.failures)
        summary = failure_summary(cfg.run_dir, rank, e.failures[rank].exitcode)
        raise WorkerFailed(f"rank {rank} failed: {summary}") from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _forward_to_workers(signum, frame) -> None:
    """SIGUSR1/SIGUSR2 to the launcher ask every local worker to save and stop (the workers run in their
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


def final_validation_loss(run_dir: str) -> Optional[float]:
    """The last ``val_loss`` rank 0 logged (``csv/metrics.csv``), or None without validation.
    Read from the run dir rather than passed back by the workers: it is the one record every
    way of launching shares, and it is complete once the workers have ended."""
    path = os.path.join(run_dir, "csv", "metrics.csv")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        values = [row["val_loss"] for row in csv.DictReader(f) if row.get("val_loss")]
    return float(values[-1]) if values else None


def run(cfg: RunConfig) -> Optional[float]:
    """Validate, then train with this process as a worker or with spawned local workers. Returns
    the final validation loss (the objective of a sweep) where this process can see the run end:
    always when it spawned the workers, on rank 0 of a submitit job; None without validation."""
    if cfg.mode == "plan_layouts":
        from megatron_hydra.planning.layouts import run_planner

        run_planner(cfg)  # plans for cfg.cluster, not for this config's own layout
        return None
    derived = derive(cfg)
    if cfg.mode == "plan":  # the per-rank memory table, no workers
        from megatron_hydra.planning.memory import plan_memory

        print(plan_memory(cfg, derived).table())
        return None
    external = detect_external()
    preflight(cfg, derived, external)
    from megatron_hydra.training.worker import run_worker, run_worker_and_exit

    config_path = write_config(cfg, cfg.run_dir)
    if external is not None:
        if external.kind == "slurm":
            os.environ.update(slurm_rendezvous_env(dict(os.environ)))
        if "SUBMITIT_EXECUTOR" not in os.environ:
            run_worker_and_exit(cfg, derived, external.rank, external.local_rank, external.local_world_size)
        # A submitit task returns, so that submitit records its result (rank 0's is the job's)...
        run_worker(cfg, derived, external.local_rank, external.local_world_size)
        if slurm.requeued():
            # ...unless rank 0 requeued the job: then no result, so that submitit's client waits
            # for the requeued run's instead of taking this partial run's as final.
            os._exit(0)
        return final_validation_loss(cfg.run_dir) if external.rank == 0 else None
    if derived.world_size == 1:
        # In this process; a fresh port per run, so multirun jobs never meet a stale store.
        from megatron_hydra.training.worker import free_port

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", LOCAL_RANK="0",
                          WORLD_SIZE="1")
        run_worker(cfg, derived, local_rank=0, local_world_size=1)
        return final_validation_loss(cfg.run_dir)
    _spawn_local(cfg, derived, config_path)
    return final_validation_loss(cfg.run_dir)
