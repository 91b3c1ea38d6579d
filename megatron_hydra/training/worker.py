"""One rank: bind its device, join the process group, train, leave cleanly.

A GPU rank makes its own GPU current before the process group exists and before any collective
(``parallel.device``), whichever way it was started: the local launcher, torchrun or SLURM.

``mode=generate`` and ``mode=evaluate`` run ``training.inference_job`` instead of training.

``python -m megatron_hydra.training.worker CONFIG`` is what the local launcher spawns per rank;
torchrun/SLURM workers and single-process runs call ``run_worker`` directly. A worker that fails
writes ``rank<N>.error`` into the run dir (one line, then the traceback) so the launcher can name
the error without a wall of tracebacks (a one-process run's launcher writes it for its rank); a
stale one from an earlier run in the same directory is removed when the rank starts.

A spawned worker dies with its launcher (``lifecycle.die_with_parent``). A SIGTERM that arrives
before training has started (the launcher spawns workers with it blocked, so it waits even through
``import torch``) is kept and delivered again once the checkpoint callback owns the signal: an
early stop request still ends in a save rather than in a killed rank.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from megatron_hydra import lifecycle
from megatron_hydra.config import Derived, RunConfig, derive
from megatron_hydra.config.inference import INFERENCE_MODES
from megatron_hydra.errors import MegatronHydraError, one_line
from megatron_hydra.parallel import device


def init_process_group(cfg: RunConfig, local_rank: int) -> torch.device:
    """env:// rendezvous (the variables come from our launcher, torchrun or SLURM), on this rank's
    device: on GPU it is bound first, so NCCL never sees two ranks on one GPU."""
    return device.init_process_group(cfg.trainer.accelerator, local_rank,
                                     timedelta(seconds=cfg.trainer.collective_timeout_s))


def set_tf32(enabled: bool) -> None:
    """TF32 tensor cores for float32 matmuls and convolutions (``precision.tf32``; GPU only). The
    legacy flags, not ``fp32_precision``: Lightning reads ``torch.get_float32_matmul_precision()``,
    which raises once the two APIs are mixed."""
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


def cpu_threads(num_threads: Optional[int], local_world_size: int) -> int:
    """Threads of one CPU rank: ``trainer.num_threads``; else ``OMP_NUM_THREADS`` where it is set
    (torchrun sets it to 1 when it starts several ranks per node); else the cores this process may
    run on (cgroups, SLURM and taskset shrink them), shared by the local ranks. More threads than
    cores is much slower than fewer: an OpenMP thread spins at every barrier while a peer waits for
    a core."""
    if num_threads:
        return num_threads
    omp = os.environ.get("OMP_NUM_THREADS", "")
    if omp.isdigit() and int(omp) > 0:
        return int(omp)
    return max(1, lifecycle.cpu_cores() // local_world_size)


def run_worker(cfg: RunConfig, derived: Derived, local_rank: int, local_world_size: int) -> None:
    if cfg.trainer.accelerator == "cpu":
        torch.set_num_threads(cpu_threads(cfg.trainer.num_threads, local_world_size))
    else:
        set_tf32(cfg.precision.tf32)
    init_process_group(cfg, local_rank)
    try:
        if dist.get_world_size() > 1:
            # Under torchrun/srun every rank composed its own Hydra config, and a timestamped
            # output dir can differ by a second between ranks: rank 0's dir is the run's.
            shared = [cfg.run_dir]
            dist.broadcast_object_list(shared, src=0)
            cfg.run_dir = shared[0]
        _run_mode(cfg, derived, local_rank)
    except BaseException:
        # With peers, leave the group as it is: destroying it waits on ranks that may be dead or
        # stopped, which kept a failed rank from exiting (and its launcher from noticing) for long.
        if dist.get_world_size() == 1:
            dist.destroy_process_group()
        raise
    dist.destroy_process_group()


def _run_mode(cfg: RunConfig, derived: Derived, local_rank: int) -> None:
    """Train, or run a checkpoint (``mode=generate``/``evaluate``: ``training.inference_job``,
    which needs no Lightning)."""
    if cfg.mode in INFERENCE_MODES:
        from megatron_hydra.training.inference_job import run_job

        run_job(cfg, derived, local_rank)
        return
    from megatron_hydra.training.train import train

    train(cfg, derived, local_rank)


def error_file(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, f"rank{rank}.error")


def _clear_error_file(run_dir: str, rank: int) -> None:
    """An error file left by an earlier run in this directory must not be read as this run's."""
    try:
        os.remove(error_file(run_dir, rank))
    except FileNotFoundError:
        pass


def write_error_file(run_dir: str, rank: int, exc: BaseException) -> str:
    """``rank<N>.error``: the one line a launcher reports, then the traceback, which stays out of
    the terminal. Returns the line."""
    line = one_line(exc) if isinstance(exc, MegatronHydraError) else f"{type(exc).__name__}: {one_line(exc)}"
    os.makedirs(run_dir, exist_ok=True)
    with open(error_file(run_dir, rank), "w") as f:
        f.write(line + "\n")
        f.write("".join(traceback.format_exception(exc)))
    return line


def _report(run_dir: str, rank: int, exc: BaseException) -> None:
    line = write_error_file(run_dir, rank, exc)
    print(f"[rank {rank}] {line}", file=sys.stderr, flush=True)


def run_worker_and_exit(cfg: RunConfig, derived: Derived, rank: int, local_rank: int, local_world_size: int) -> None:
    """Run this rank to the end, report a failure as one line (and ``rank<N>.error``), then leave
    with ``os._exit``: interpreter teardown after gloo point-to-point traffic can abort (SIGABRT)
    after correct results, which a launcher would count as a failed rank."""
    code = 0
    _clear_error_file(cfg.run_dir, rank)
    try:
        run_worker(cfg, derived, local_rank, local_world_size)
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the launcher as one line
        _report(cfg.run_dir, rank, exc)
        code = 2 if isinstance(exc, MegatronHydraError) else 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _hold_early_sigterm() -> None:
    """Until training starts, SIGTERM (a stop request the launcher forwards) would kill this rank
    mid-startup. Keep it instead, and send it again once the checkpoint callback has installed its
    own handler, which saves at the next step boundary and stops."""
    from megatron_hydra.training import checkpointing

    held = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: held.set())

    def redeliver() -> None:
        held.wait()
        while signal.getsignal(signal.SIGTERM) is not checkpointing.request_stop:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=redeliver, name="sigterm-redelivery", daemon=True).start()
    # The launcher spawned this process with SIGTERM/SIGINT blocked: one sent meanwhile is pending.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})


def main(argv=None) -> None:
    """Entry of a worker spawned by the local launcher: ``python -m megatron_hydra.training.worker CONFIG``."""
    parent = os.environ.get(lifecycle.LAUNCHER_PID_ENV)
    lifecycle.die_with_parent(int(parent) if parent else None)
    from megatron_hydra.config.io import read_config

    argv = sys.argv[1:] if argv is None else argv
    cfg = read_config(argv[0])  # a stop request meanwhile stays pending: the launcher blocked it
    if cfg.mode in INFERENCE_MODES:  # nothing to save: a stop request ends the rank
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})
    else:
        _hold_early_sigterm()
    run_worker_and_exit(cfg, derive(cfg), int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0")),
                        int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


if __name__ == "__main__":
    main()
