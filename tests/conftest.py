"""Shared test helpers: compose configs as launch.py does, run training, start gloo ranks."""

from __future__ import annotations

import copy
import csv
import functools
import logging
import multiprocessing
import os
import pickle
import runpy
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Dict, List, Tuple
from unittest import mock

# One thread per process, set before torch is imported: two xdist workers share two cores, each
# with its own ranks and launched runs. Several threads per process on a core they do not have
# to themselves spin at every OpenMP barrier while a peer waits for its turn (a tiny model's step
# measured 1 s instead of 0.06 s). Ranks forked from the server below, launched runs (whose
# workers read OMP_NUM_THREADS: training.worker.cpu_threads) and this process all run one.
os.environ["OMP_NUM_THREADS"] = "1"

import pytest
import torch
import torch.multiprocessing as mp
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from megatron_hydra.config.io import free_port

torch.set_num_threads(1)  # where a plugin imported torch before this file

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"

# The files that take most of the suite's time, longest first (summed durations of a full run).
# Handed out in this order to the two xdist workers (--dist loadfile), with the many short files
# filling in behind them, both workers end at about the same time. xdist itself would hand out the
# files with the most tests first, which left the few long launch tests for the end of one worker.
LONG_FILES = ("test_kill.py", "test_training_eval.py", "test_generate_cli.py", "test_model_presets.py", "test_hf_families.py", "test_dry_run.py", "test_launcher.py", "test_cluster_launch.py", "test_launcher_trust.py",
              "test_checkpoint_errors.py", "test_lora_checkpoint.py", "test_dpo.py", "test_hf_lora.py", "test_dry_run_fit.py", "test_verify.py", "test_trust_interrupt.py", "test_distributed_optimizer.py",
              "test_tensor_parallel_model.py", "test_moe_model.py", "test_memory_plan.py", "test_context_parallel_model.py", "test_pipeline_parallel.py",
              "test_config.py", "test_memory_plan_archs.py", "test_checkpoint_resume.py", "test_planner.py",
              "test_mixed_precision.py", "test_bert_t5_data.py", "test_fsdp.py", "test_docs_commands.py",
              "test_checkpoint_sharded.py", "test_checkpoint_async.py", "test_parallel_state.py",
              "test_document_masks.py", "test_data_parallel.py", "test_bert.py", "test_t5.py", "test_observability.py",
              "test_recompute.py", "test_layering.py", "test_expert_gradients.py", "test_compile.py",
              "test_dp_overlap.py", "test_muon.py", "test_tp_overlap.py")


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False  # keep the order below, not xdist's most-tests-first


def pytest_collection_modifyitems(session, config, items):
    def rank(item) -> int:
        name = item.path.name
        return LONG_FILES.index(name) if name in LONG_FILES else len(LONG_FILES)

    items.sort(key=rank)  # stable: the order within a file is kept


# A model small enough that a multi-rank run of 10 steps takes seconds on 2 cores. Its MFU is taken
# against a given peak: the CPU matmul measured at start-up (0.1 s of rank 0, a tenth of such a run)
# is test_mfu.py's, and the default run's (test_launcher.py).
SMALL = [
    "data=synthetic", "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.seq_length=32",
    "model.vocab_size=500", "data.micro_batch_size=2", "data.global_batch_size=8",
    "optim.warmup_steps=2", "trainer.enable_progress_bar=false", "trainer.peak_tflops=1",
]


def compose_config(overrides: List[str] = (), run_dir: str = "unused", visible_gpus: int = 0):
    """The typed RunConfig that ``launch.py`` would run for these command-line overrides on a
    machine with ``visible_gpus`` GPUs (``auto`` values resolved; a CPU machine by default, so that
    the suite runs the same wherever it runs)."""
    from megatron_hydra.config.machine import resolve

    cfg = copy.deepcopy(_composed(tuple(overrides)))
    cfg.run_dir = str(run_dir)  # what ${run_dir} (checkpoint.dir, ...) resolves to below
    return resolve(OmegaConf.to_object(cfg), visible_gpus)


@functools.lru_cache(maxsize=None)
def _register_schema() -> None:
    """The schema into Hydra's ConfigStore, once per process: storing it again (Hydra rebuilds
    the typed node) costs about a fifth of a composition."""
    from megatron_hydra.config import register_configs

    register_configs()


@functools.lru_cache(maxsize=None)
def _composed(overrides: Tuple[str, ...]):
    """Hydra's composition of ``conf/`` with these overrides, interpolations unresolved. Composing
    takes Hydra 0.1 to 0.2 s; one in seven compositions of a suite run repeats an earlier one (the
    run dir aside), e.g. a resumed run's or a reference run's."""
    _register_schema()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose(config_name="config", overrides=["run_dir=unused", *overrides])


def run_training(overrides: List[str], run_dir: Path) -> List[Dict[str, float]]:
    """Run the launch path (config -> launcher -> workers -> Lightning); return rank 0's logged
    metrics, one dict per logged step.

    Everything is the launcher's (validation, preflight, run lock, the worker entry, failure
    reports) except how a multi-rank run's workers start: they are forked from the session's
    preloaded server (see ``spawn_ranks``) instead of being fresh interpreters that each import
    torch and Lightning (about 7 s of CPU per rank, most of a small run's time). The launcher's own
    process handling is tested on its own (test_launcher*.py, test_kill.py, test_cluster_launch.py)."""
    from megatron_hydra import launcher

    with mock.patch.object(launcher, "_spawn_local", _spawn_forked):
        launcher.run(compose_config(list(overrides), str(run_dir)))
    return read_metrics(run_dir)


def _forked_worker(cfg, derived, rank: int, world: int, port: int) -> None:
    from megatron_hydra.training.worker import run_worker_and_exit

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    run_worker_and_exit(cfg, derived, rank, rank, world)


def _spawn_forked(cfg, derived, config_path: str, grace_s: float = 5.0) -> None:
    """The launcher's ``_spawn_local`` with forked workers: the same worker entry, and the same
    report when one fails (the first failing rank, its one line; the others killed ``grace_s``
    after the first failure)."""
    from megatron_hydra.launcher import WorkerFailed, clear_error_files, failure_summary, root_cause_rank

    clear_error_files(cfg.run_dir)
    ctx = multiprocessing.get_context("forkserver")
    port, world = free_port(), derived.world_size
    procs = [ctx.Process(target=_forked_worker, args=(cfg, derived, rank, world, port)) for rank in range(world)]
    for proc in procs:
        proc.start()
    failed_at = None
    while any(proc.is_alive() for proc in procs):
        if failed_at is None and any(proc.exitcode for proc in procs):
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > grace_s:
            for proc in procs:
                proc.kill()
        time.sleep(0.05)
    for proc in procs:
        proc.join()
    failures = {rank: SimpleNamespace(exitcode=proc.exitcode) for rank, proc in enumerate(procs) if proc.exitcode}
    if failures:
        rank = root_cause_rank(cfg.run_dir, failures)
        raise WorkerFailed(f"rank {rank} failed: {failure_summary(cfg.run_dir, rank, failures[rank].exitcode)}")


def read_metrics(run_dir: Path) -> List[Dict[str, float]]:
    with open(Path(run_dir) / "csv" / "metrics.csv") as f:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


def assert_reloads_bitwise(original, reloaded) -> None:
    """``reloaded`` (a model ``from_pretrained`` read back from our export) holds exactly the
    tensors of ``original``: the same names, dtypes and bits."""
    assert type(reloaded) is type(original)
    theirs, ours = original.state_dict(), reloaded.state_dict()
    assert sorted(theirs) == sorted(ours)
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and torch.equal(ours[name], tensor), name


def assert_same_trajectory(rows: List[Dict[str, float]], reference: List[Dict[str, float]], rel: float,
                           keys=("loss", "grad_norm")) -> None:
    """Per-step agreement of two runs' logged metrics: the same number of rows and the same steps
    (``zip`` alone would silently drop a missing tail), then each of ``keys`` within relative
    tolerance ``rel`` (0: bitwise equal)."""
    assert len(rows) == len(reference), f"{len(rows)} logged rows against the reference's {len(reference)}"
    for ours, ref in zip(rows, reference):
        step = ref.get("step")
        assert ours.get("step") == step, f"step {ours.get('step')} against the reference's {step}"
        for key in keys:
            if rel == 0:
                assert ours[key] == ref[key], f"step {step}: {key} {ours[key]!r} != {ref[key]!r}"
            else:
                assert ours[key] == pytest.approx(ref[key], rel=rel), f"step {step}: {key} beyond rel {rel}"


def _rank_entry(rank: int, fn: Callable, world: int, port: int, args, queue) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        # As bytes: a queue would share a tensor's storage through a file descriptor that this
        # process serves from a helper thread, and the process exits right below.
        queue.put((rank, pickle.dumps(result)))
    finally:
        dist.destroy_process_group()
    # Skip interpreter teardown: gloo ranks that used point-to-point ops sometimes abort there
    # (SIGABRT after correct results). The result is already in the pipe: SimpleQueue writes
    # synchronously.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# Ranks are forked from one server process that imported these once for the whole session,
# instead of each rank importing torch, Lightning and the package anew (seconds per rank on 2
# cores). The server never runs torch code, so its forks start clean, as spawned ranks would; they
# get the server's environment, not the test's (no rank test depends on its environment).
# torch.utils.tensorboard is imported by every run's default logger (with its S3 client, half a
# second per rank).
multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "pytorch_lightning", "hydra", "omegaconf",
                                        "torch.utils.tensorboard", "megatron_hydra.training.train",
                                        "megatron_hydra.training.worker"])


def spawn_ranks(fn: Callable, world: int, *args) -> Dict[int, object]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return each rank's result.
    ``fn`` must be a module-level function of a test module (it is pickled by reference)."""
    queue = mp.get_context("forkserver").SimpleQueue()
    procs = mp.start_processes(_rank_entry, args=(fn, world, free_port(), args, queue), nprocs=world,
                               start_method="forkserver", join=False)
    results = {}
    done = False
    while not done:
        # Drain while waiting: a rank's put blocks once its result fills the pipe (64 KiB), so
        # reading only after join would deadlock on larger results.
        done = procs.join(timeout=0.05)
        while not queue.empty():
            rank, value = queue.get()
            results[rank] = pickle.loads(value)  # this suite's own ranks' results
    return results


def launch_cmd(*overrides: str) -> List[str]:
    return [sys.executable, str(ROOT / "launch.py"), *overrides]


def launch_py(argv: List[str], env: Dict[str, str]) -> int:
    """``python launch.py *argv`` (from the repository root, in environment ``env``) run as the
    interpreter runs a script, but in this process: the script's own ``__main__`` block, Hydra's
    command-line parsing, output dir and logging included. Returns the exit status. A fresh
    interpreter would add seconds of importing torch and Lightning, and no test using this one is
    about the process boundary (test_launcher*.py are). The environment, working directory, argv and
    the root logger's handlers (Hydra's, writing to this test's captured streams) are restored
    after."""
    root = logging.getLogger()
    handlers, level, cwd = root.handlers[:], root.level, os.getcwd()
    try:
        os.chdir(ROOT)
        with mock.patch.dict(os.environ, env, clear=True), mock.patch.object(sys, "argv", ["launch.py", *argv]):
            runpy.run_path(str(ROOT / "launch.py"), run_name="__main__")
    except SystemExit as stop:  # launch.py always ends with sys.exit(cli())
        return stop.code
    finally:
        os.chdir(cwd)
        for handler in root.handlers:
            if handler not in handlers:
                handler.close()
        root.handlers[:] = handlers
        root.setLevel(level)
    raise AssertionError("launch.py returned without sys.exit")


@pytest.fixture
def env_no_launcher():
    """Environment of a plain shell: no torchrun or SLURM variables from the test runner."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC_", "MASTER_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return env


@pytest.fixture(scope="session")
def small_checkpoint(tmp_path_factory):
    """A 2-step checkpoint of the SMALL model (2 layers), with optimizer state; tests only read it
    (or copy it before changing anything)."""
    run_dir = tmp_path_factory.mktemp("small_run")
    run_training([*SMALL, "trainer.max_steps=2"], run_dir)
    return run_dir / "checkpoints" / "step_0000002"


def preflight_error(tmp_path, *overrides) -> str:
    """The one-line CheckpointError a SMALL run starting from a checkpoint stops with, before
    training starts."""
    from megatron_hydra.errors import CheckpointError
    from megatron_hydra.launcher import run

    with pytest.raises(CheckpointError) as err:
        run(compose_config([*SMALL, "trainer.max_steps=3", *overrides], str(tmp_path / "new")))
    message = str(err.value)
    assert "\n" not in message
    assert not (tmp_path / "new" / "csv").exists()  # failed before training started
    return message


def rank1_failure_injector(tmp_path) -> Path:
    """A directory whose ``sitecustomize.py`` makes rank 1 raise right after joining the process
    group (put it on the workers' PYTHONPATH), while its peers wait for it in a collective."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('RANK') == '1':\n"
        "    import torch.distributed as dist\n"
        "    _init = dist.init_process_group\n"
        "    def _boom(*a, **k):\n"
        "        _init(*a, **k)\n"
        "        raise RuntimeError('injected failure')\n"
        "    dist.init_process_group = _boom\n"
    )
    return inject


class StubGroup:
    """Stands for rank ``rank`` of a process group of ``size`` (answers the collectives' size/rank)."""

    def __init__(self, size: int, rank: int):
        self.size, self.rank = size, rank


@contextmanager
def stub_groups():
    """Collectives' ``group_size``/``group_rank`` read ``StubGroup``s: layers built for rank r of a
    group, in one process, without a process group."""
    from megatron_hydra.parallel import collectives as C

    with mock.patch.object(C, "group_size", lambda g: 1 if g is None else g.size), \
            mock.patch.object(C, "group_rank", lambda g: 0 if g is None else g.rank):
        yield
