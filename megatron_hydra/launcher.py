"""Turn one composed config into running workers.

- Under an external launcher (torchrun, or SLURM's srun with one task per device) this process is
  one worker: check the launcher's world size against the config, then train in-process.
- Otherwise spawn ``trainer.devices`` local workers with torch's elastic launch API. Each worker
  is a fresh ``python -m megatron_hydra.training.worker`` that reads the resolved config from the
  run dir. Lightning's own launcher is never used: it re-executes ``sys.argv``, which breaks Hydra's
  output dir and multirun. If any worker fails, the agent stops the others at once and ``run``
  raises ``WorkerFailed`` naming the rank and its error.

First the config's ``auto`` values are chosen for this machine (``config.machine.resolve``: its
visible GPUs, the ranks torchrun/srun started). Config errors are raised before any process starts,
and so are a run whose memory plan (``megatron_hydra.planning``) exceeds a device and a GPU run
with fewer visible GPUs than local ranks; ``mode=plan`` prints that plan and starts nothing.
``mode=generate`` and ``mode=evaluate`` (a checkpoint's text or lm-eval scores, at any layout)
run their workers the same way; their checkpoint, tokenizer, prompts and tasks are checked first
(``training.inference_job.preflight``), and they save nothing.

Process lifecycle (``megatron_hydra.lifecycle``): the run directory and ``checkpoint.dir`` are
checked writable and locked before any worker starts; spawned workers die with this process. The
first SIGTERM or SIGINT (Ctrl-C) is forwarded to the workers as SIGTERM, so that they save at the
next step boundary and stop; a second one kills them at once (``Interrupted``). A one-process run
trains in this process and behaves the same: the first signal saves at the next step boundary, a
second one ends the run where it is, and an error that is not one of ours is reported as a failed
rank (``WorkerFailed``, its traceback in ``rank0.error``). A Ctrl-C before any of that (while the
config is checked or the data prepared) is ``Interrupted`` too: one line, never a traceback.
"""

from __future__ import annotations

import csv
import glob
import logging
import os
import signal
import sys
import threading
import uuid
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional


from megatron_hydra import lifecycle, slurm
from megatron_hydra.config import Derived, RunConfig, derive
from megatron_hydra.config.inference import INFERENCE_MODES, eval_output_dir, evaluating_during_training
from megatron_hydra.config.io import free_port, write_config
from megatron_hydra.config.machine import resolve
from megatron_hydra.config.observability import check_logger_packages
from megatron_hydra.errors import ConfigError, MegatronHydraError, one_line

# Local CPU ranks per core beyond which a run is refused: gloo ranks time-share cores well up to a
# handful each (the tests run 8 on 2), but hundreds only thrash and exhaust memory.
MAX_RANKS_PER_CORE = 8
# Errors a rank reports when a peer died or stopped first: never the root cause while another
# rank has a different error or was killed by a signal.
PEER_LOSS = ("connection closed by peer", "connection reset by peer", "broken pipe", "timed out",
             "socket timeout", "distnetworkerror", "communicator was aborted", "remote process exited")


class WorkerFailed(MegatronHydraError):
    """A worker process failed; the message names the first failing rank and its error."""


class Interrupted(MegatronHydraError):
    """The run was stopped by a signal before it could save (a second SIGTERM/SIGINT, or one that
    arrived before training started); ``exit_code`` follows the shell's 128 + signal number."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


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


def check_local_cpu_ranks(cfg: RunConfig, external: Optional[ExternalLaunch]) -> None:
    """Spawning far more CPU workers than cores only thrashes (``trainer.devices=1000`` on a laptop);
    an external launcher (torchrun, srun) decides its own placement and is not checked."""
    if external is not None or cfg.trainer.accelerator != "cpu":
        return
    cores = lifecycle.cpu_cores()
    if cfg.trainer.devices > MAX_RANKS_PER_CORE * cores:
        raise ConfigError(
            f"trainer.devices={cfg.trainer.devices} local CPU workers on {cores} cores (at most {MAX_RANKS_PER_CORE} "
            f"per core, {MAX_RANKS_PER_CORE * cores} here): lower trainer.devices, or start the ranks with torchrun"
        )


def run_dirs(cfg: RunConfig) -> List[tuple]:
    """The directories a run writes, with the key that sets each (for error messages). A run of a
    checkpoint (generate, evaluate) saves none."""
    from megatron_hydra.checkpoint.plan import checkpoint_dir

    if cfg.mode in INFERENCE_MODES:
        return [(cfg.run_dir, "run_dir (hydra.run.dir)")]
    return [(cfg.run_dir, "run_dir (hydra.run.dir)"), (checkpoint_dir(cfg), "checkpoint.dir")]


def check_gpus(cfg: RunConfig, external: Optional[ExternalLaunch], visible: int) -> None:
    """One GPU per rank, decided identically on every rank before any of them binds a device.
    Spawned locally or by torchrun, a node's ranks share the visible GPUs (local rank i takes
    ``cuda:i``); SLURM may instead give each task its own (one visible GPU per task)."""
    if cfg.trainer.accelerator != "gpu":
        return
    if visible == 0:
        raise ConfigError("trainer.accelerator=gpu but no CUDA device is visible: use trainer=cpu "
                          "(or trainer.accelerator=auto), or check CUDA_VISIBLE_DEVICES")
    if external is None and visible < cfg.trainer.devices:
        raise ConfigError(f"trainer.devices={cfg.trainer.devices} but this machine has {visible} GPUs: lower it "
                          "(trainer.devices=auto uses every visible GPU)")
    shared = external is not None and (external.kind == "torchrun" or visible > 1)
    if shared and visible < external.local_world_size:
        how = {"torchrun": "torchrun --nproc-per-node", "slurm": "srun --ntasks-per-node"}[external.kind]
        raise ConfigError(
            f"the {external.kind} launch runs {external.local_world_size} ranks on node {external.node_rank} but "
            f"{visible} GPUs are visible there: one GPU per rank; lower {how} and trainer.devices to {visible}, "
            "or make more GPUs visible (CUDA_VISIBLE_DEVICES)"
        )


def check_gpu_switches(cfg: RunConfig) -> None:
    """Transformer Engine (model.transformer_impl, precision.fp8) and apex (optim.impl) must be
    installed here, and run on GPUs (docs/gpu.md). Found without importing them."""
    from importlib.util import find_spec

    wanted = []
    if cfg.model.transformer_impl == "transformer_engine":
        wanted.append(("model.transformer_impl=transformer_engine", ("transformer_engine",),
                       "NVIDIA Transformer Engine", "model.transformer_impl=local"))
    if cfg.optim.impl == "apex":  # amp_C: apex's CUDA extensions (PyPI's "apex" is another package)
        wanted.append(("optim.impl=apex", ("apex", "amp_C"), "NVIDIA apex with its CUDA extensions (amp_C)",
                       "optim.impl=auto"))
    for switch, modules, package, fix in wanted:
        if not all(find_spec(m) is not None for m in modules):
            raise ConfigError(f"{switch} needs {package}, which this environment lacks (NVIDIA's NGC PyTorch image "
                              f"has it, see the Dockerfile): use {fix}")
        if cfg.trainer.accelerator != "gpu":
            raise ConfigError(f"{switch} runs on GPUs: use trainer=gpu, or {fix}")


def preflight(cfg: RunConfig, derived: Derived, external: Optional[ExternalLaunch]) -> None:
    """Checks that need the machine (not just the config), still before any worker starts."""
    from megatron_hydra.parallel.device import visible_gpus

    check_gpu_switches(cfg)
    check_logger_packages(cfg)
    check_local_cpu_ranks(cfg, external)
    check_gpus(cfg, external, visible_gpus() if cfg.trainer.accelerator == "gpu" else 0)
    if cfg.mode in INFERENCE_MODES:  # the checkpoint, tokenizer, prompts and tasks (training.inference_job)
        from megatron_hydra.training import inference_job

        if cfg.mode == "evaluate":
            lifecycle.check_writable(eval_output_dir(cfg), "trainer.eval.output")
        inference_job.preflight(cfg, derived)
    else:
        _check_training_start(cfg, derived)
    if external is not None:
        check_external_layout(cfg, derived, external)
    if external is None and cfg.trainer.num_nodes > 1:
        raise ConfigError(
            f"trainer.num_nodes={cfg.trainer.num_nodes} needs an external launcher on every node "
            "(torchrun --nnodes ... or srun): this process can only spawn workers on its own node"
        )
    if cfg.data.name != "synthetic" and cfg.mode == "train" and (external is None or external.rank == 0):
        # Build (or find cached) corpus and index arrays now: a bad file is a one-line DataError
        # before any worker starts, and workers then only open caches.
        from megatron_hydra.data.arch_datasets import dataset_factory
        from megatron_hydra.data.builders import build_datasets

        build_datasets(cfg.data, seq_length=derived.transformer.seq_length, seed=cfg.data.seed,
                       num_samples=derived.split_samples, vocab_size=derived.transformer.vocab_size,
                       make_dataset=dataset_factory(cfg.data, derived.transformer, cfg.data.seed))


def _check_training_start(cfg: RunConfig, derived: Derived) -> None:
    from megatron_hydra.checkpoint.plan import start_point
    from megatron_hydra.planning.fit import check_fits

    check_fits(cfg, derived)  # the memory plan against the device: a run that cannot fit stops here
    start_point(cfg, derived)  # a missing, incomplete or mismatching checkpoint fails here, in one line
    if evaluating_during_training(cfg):  # trainer.eval.tasks: an unknown task or a broken task file
        from megatron_hydra.inference.lm_eval_adapter import check_tasks

        check_tasks(list(cfg.trainer.eval.tasks))


def _spawn_local(cfg: RunConfig, derived: Derived, config_path: str) -> None:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    clear_error_files(cfg.run_dir)
    stops = _StopRequests(saves=cfg.mode == "train")
    with _environ({lifecycle.LAUNCHER_PID_ENV: str(os.getpid())}), stops.installed(), _kill_after_failure(cfg.run_dir):
        launch = LaunchConfig(
            min_nodes=1, max_nodes=1, nproc_per_node=derived.world_size,
            run_id=uuid.uuid4().hex, rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0",
            max_restarts=0, monitor_interval=0.1, shutdown_timeout=5,
            logs_specs=DefaultLogsSpecs(log_dir=os.path.join(cfg.run_dir, "workers")),
            # The elastic agent turns the signals named here into an exception that kills the
            # workers at once; SIGTERM and SIGINT are left to ``_StopRequests``, which lets them save.
            signals_to_handle="SIGHUP,SIGQUIT",
        )
        try:
            elastic_launch(launch, sys.executable)("-m", "megatron_hydra.training.worker", config_path)
        except ChildFailedError as e:
            stops.raise_if_stopped()
            rank = root_cause_rank(cfg.run_dir, e.failures)
            summary = failure_summary(cfg.run_dir, rank, e.failures[rank].exitcode)
            raise WorkerFailed(f"rank {rank} failed: {summary}") from None


@contextmanager
def _kill_after_failure(run_dir: str, grace_s: float = 5.0) -> Iterator[None]:
    """Once a rank has reported a failure (its ``rank<N>.error``), kill the workers still running
    after ``grace_s``. The elastic agent would wait 30 s for them (it does not pass its
    ``shutdown_timeout`` on when a worker fails), and a stopped (SIGSTOP) or hung rank ignores
    the SIGTERM it sends; nothing of a failed run is worth waiting for."""
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.2):
            if glob.glob(os.path.join(glob.escape(run_dir), "rank*.error")):
                if not done.wait(grace_s):
                    _forward_to_workers(signal.SIGKILL, None)
                return

    watcher = threading.Thread(target=watch, name="failure-watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


@contextmanager
def _environ(values: Dict[str, str]) -> Iterator[None]:
    """Set environment variables (inherited by the workers) for the life of the block."""
    previous = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in previous.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _StopRequests:
    """The launcher's side of stopping a run. SIGUSR1/SIGUSR2 go to the workers as they are (save,
    and requeue inside SLURM). The first SIGTERM/SIGINT goes to them as SIGTERM: each saves at the
    next step boundary and stops, and the launcher ends with status 0 once they have. A second
    one kills them at once.

    Spawned workers: SIGTERM and SIGINT stay blocked in the spawning (main) thread while the
    workers start: they inherit the blocked mask through exec, so a stop request that arrives while
    they are still importing stays pending until they can act on it. A helper thread keeps them
    unblocked, so the kernel always has a thread to deliver them to; Python then runs the handler in
    the main thread.

    A one-process run (``in_process``) is the same conversation inside one process: a request sets
    the checkpoint callback's flag (``checkpointing.request_stop``), this handler keeps SIGTERM while
    training (``checkpointing.launcher_keeps_stop_signals``; Lightning would exit mid-step, and would
    turn a KeyboardInterrupt into status 1 without a save), and a second signal raises
    ``lifecycle.StopAtOnce`` where the run is, as SIGKILL ends a spawned worker where it is."""

    STOP = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, in_process: bool = False, saves: bool = True):
        self.received: List[int] = []
        self.in_process = in_process
        self.saves = saves  # false: a run of a checkpoint (generate, evaluate), which a signal just ends

    @contextmanager
    def installed(self) -> Iterator[None]:
        with ExitStack() as stack:
            if self.in_process:
                from megatron_hydra.training import checkpointing

                self._forward = checkpointing.request_stop
                stack.enter_context(checkpointing.launcher_keeps_stop_signals(self._on_stop))
            else:
                self._forward = _forward_to_workers
            stack.enter_context(self._handlers())
            if not self.in_process:
                stack.enter_context(self._blocked_in_main_thread())
            yield

    @contextmanager
    def _handlers(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():  # only the main thread may set them
            yield
            return
        handlers = {signal.SIGUSR1: self._forward, signal.SIGUSR2: self._forward,
                    signal.SIGTERM: self._on_stop, signal.SIGINT: self._on_stop}
        previous = {sig: signal.signal(sig, handler) for sig, handler in handlers.items()}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    @contextmanager
    def _blocked_in_main_thread(self) -> Iterator[None]:
        done = threading.Event()
        receiver = threading.Thread(target=self._receive, args=(done,), name="stop-signals", daemon=True)
        receiver.start()
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, self.STOP)
        try:
            yield
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            done.set()
            receiver.join()

    def _receive(self, done: threading.Event) -> None:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, self.STOP)
        done.wait()

    def _on_stop(self, signum: int, frame) -> None:
        self.received.append(signum)
        name = signal.Signals(signum).name
        if len(self.received) == 1:
            _notice(f"{name}: every rank saves a checkpoint at the next step boundary and stops "
                    f"(send {name} again to stop at once, without saving)" if self.saves else f"{name}: stopping")
            self._forward(signal.SIGTERM, frame)
        elif self.in_process:
            raise lifecycle.StopAtOnce(signum)
        else:
            _forward_to_workers(signal.SIGKILL, frame)

    def raise_if_stopped(self) -> None:
        """Workers failed after a stop request: say so in one line instead of blaming a rank."""
        if not self.received:
            return
        name = signal.Signals(self.received[-1]).name
        if not self.saves:
            raise Interrupted(f"stopped by {name}", self.received[-1])
        if len(self.received) > 1:
            raise Interrupted(f"stopped at once by a second {name} (the newest complete checkpoint is kept; "
                              "resume with checkpoint.resume=auto)", self.received[-1])
        raise Interrupted(f"stopped by {name} before every rank could save (e.g. during start-up): no checkpoint "
                          "written by this run", self.received[-1])


def _notice(line: str) -> None:
    """One line to stderr from a signal handler, written to the file descriptor itself: the
    handler may run while the main thread is inside a write to ``sys.stderr`` (the progress bar, a
    log line), and a buffered stream refuses such a reentrant call with an exception."""
    try:
        os.write(2, (line + "\n").encode())
    except OSError:
        pass


def _forward_to_workers(signum, frame) -> None:
    """Send ``signum`` to every child of this process: the local workers run in their own sessions,
    so a signal to the launcher alone would not reach them."""
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


def clear_error_files(run_dir: str) -> None:
    """Error files of an earlier run in a reused directory must not be read as this run's."""
    for path in glob.glob(os.path.join(glob.escape(run_dir), "rank*.error")):
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


def _first_line(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.readline().strip()
    except OSError:
        return None


def root_cause_rank(run_dir: str, failures: Dict[int, object]) -> int:
    """The rank whose failure came first. When one rank dies, its peers then fail in their
    collectives ("connection closed by peer", a timeout), often before the agent notices the death;
    so a rank's own error outranks a death by a signal (which writes no error file), and that
    outranks an error that only reports a lost peer. Within a kind, the earliest error file wins."""
    def order(rank: int):
        path = os.path.join(run_dir, f"rank{rank}.error")
        line = _first_line(path)
        if line is None:
            return (1 if failures[rank].exitcode < 0 else 3, 0, rank)
        kind = 2 if any(p in line.lower() for p in PEER_LOSS) else 0
        return (kind, os.stat(path).st_mtime_ns, rank)

    return min(failures, key=order)


def failure_summary(run_dir: str, rank: int, exitcode: int) -> str:
    """The one-line error a worker left in ``rank<N>.error`` (its traceback follows in the file)."""
    path = os.path.join(run_dir, f"rank{rank}.error")
    first = _first_line(path)
    if first is not None:
        return f"{first} (traceback: {path})"
    if exitcode < 0:
        return f"killed by signal {-exitcode} ({signal.Signals(-exitcode).name})"
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


def resolve_for_machine(cfg: RunConfig, external: Optional[ExternalLaunch]) -> RunConfig:
    """``cfg`` with its ``auto`` values chosen for this machine (``config.machine``): its visible
    GPUs and, under torchrun or srun, the ranks they started on this node."""
    from megatron_hydra.parallel.device import visible_gpus

    return resolve(cfg, visible_gpus(), external.local_world_size if external is not None else None)


def run(cfg: RunConfig) -> Optional[float]:
    """Validate, then train with this process as a worker or with spawned local workers. Returns
    the final validation loss (the objective of a sweep) where this process can see the run end:
    always when it spawned the workers, on rank 0 of a submitit job; None without validation."""
    try:
        return _run(cfg)
    except KeyboardInterrupt:  # Ctrl-C before the stop handlers took SIGINT (config checks, data preparation)
        raise Interrupted("stopped by SIGINT before training started: nothing was saved", signal.SIGINT) from None


def _run(cfg: RunConfig) -> Optional[float]:
    external = detect_external()
    cfg = resolve_for_machine(cfg, external)
    if cfg.mode == "plan_layouts":
        from megatron_hydra.planning.layouts import run_planner

        if cfg.data.global_batch_size is None:
            raise ConfigError("mode=plan_layouts needs data.global_batch_size: the global batch every layout "
                              "trains with (e.g. data.global_batch_size=1536)")
        run_planner(cfg)  # plans for cfg.cluster, not for this config's own layout
        return None
    if cfg.mode == "verify":  # verify sits above the launcher and starts its runs through it
        raise ConfigError("mode=verify runs from launch.py: call megatron_hydra.verify.verify_job, not launcher.run")
    if cfg.mode in ("generate", "evaluate") and cfg.peft.adapter is not None:
        from megatron_hydra.checkpoint.adapters import adopt

        cfg = adopt(cfg, cfg.peft.adapter)  # a checkpoint's adapters bring their own peft settings
    derived = derive(cfg)
    if cfg.mode == "plan":  # the per-rank memory table, no workers
        from megatron_hydra.planning.memory import plan_memory

        print(plan_memory(cfg, derived).table())
        return None
    if cfg.mode == "dry_run":  # one step of chosen ranks on a fake group and fake GPU (training.dry_run)
        from megatron_hydra.training.dry_run import run_dry_run

        run_dry_run(cfg, derived)
        return None
    for path, key in run_dirs(cfg):  # every rank writes there: found now, not at the first save
        lifecycle.check_writable(path, key)
    # One run per directory: rank 0 holds the lock for the run (the kernel drops it when it dies).
    lock = lifecycle.run_lock(run_dirs(cfg)) if external is None or external.rank == 0 else nullcontext()
    with lock:
        preflight(cfg, derived, external)
        return _run_locked(cfg, derived, external)


def _run_in_process(cfg: RunConfig, derived: Derived) -> None:
    """The only rank of a one-process run, in this process (a fresh port per run, so multirun jobs
    never meet a stale store). It stops and fails as a spawned rank does: a first SIGTERM/SIGINT
    saves at the next step boundary, a second one is ``Interrupted``, and an error that is not one
    of ours is ``WorkerFailed``, with its traceback in ``rank0.error`` rather than on the terminal."""
    from megatron_hydra.training.worker import run_worker, write_error_file

    rendezvous = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", LOCAL_RANK="0",
                      WORLD_SIZE="1")  # for this run only: the caller's environment is given back
    clear_error_files(cfg.run_dir)
    stops = _StopRequests(in_process=True)
    try:  # a run of a checkpoint saves nothing: a signal ends it where it is
        with _environ(rendezvous), stops.installed() if cfg.mode == "train" else nullcontext():
            run_worker(cfg, derived, local_rank=0, local_world_size=1)
    except lifecycle.StopAtOnce:
        stops.raise_if_stopped()
        raise
    except MegatronHydraError:
        raise
    except Exception as exc:  # noqa: BLE001 - reported as a spawned rank's failure is, in one line
        write_error_file(cfg.run_dir, 0, exc)
        raise WorkerFailed(f"rank 0 failed: {failure_summary(cfg.run_dir, 0, 1)}") from None


def _run_locked(cfg: RunConfig, derived: Derived, external: Optional[ExternalLaunch]) -> Optional[float]:
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
        _run_in_process(cfg, derived)
        return final_validation_loss(cfg.run_dir)
    _spawn_local(cfg, derived, config_path)
    return final_validation_loss(cfg.run_dir)


def run_tool(usage: str, build: Callable[[List[str]], RunConfig], argv: List[str]) -> int:
    """A command-line tool that runs through the launcher (``python -m megatron_hydra.generate``,
    ``.evaluate``): ``build`` makes its RunConfig from ``argv``; the exit status is launch.py's
    (2: a bad config, data or checkpoint, in one line; 1: a failed worker; 128 + N: signal N)."""
    if not argv or argv[0] in ("-h", "--help"):
        print(usage, file=sys.stderr)
        return 2
    try:
        run(build(argv))
    except Interrupted as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except MegatronHydraError as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 1 if isinstance(e, WorkerFailed) else 2
    return 0
