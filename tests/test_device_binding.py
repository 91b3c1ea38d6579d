"""A GPU rank binds its own GPU before its process group exists, however it was launched; proven
without a GPU by recording the CUDA and torch.distributed calls a worker makes.

NCCL pins a communicator to the current device when the group is created and refuses two ranks on
one GPU, so for each launch kind (our local spawn, torchrun, SLURM with and without one GPU per
task) the record must show ``set_device(i)`` for this rank's GPU first, then
``init_process_group(device_id=cuda:i)``, then the first collective, and no CUDA call on any other
device (the memory plan's device query included).
"""

from __future__ import annotations

import os
import sys
import types
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from conftest import CONF, SMALL
from megatron_hydra.config import derive
from megatron_hydra.config.io import read_config, write_config
from megatron_hydra.config.machine import resolve
from megatron_hydra.errors import ConfigError
from megatron_hydra.parallel.device import local_rank_from_env, pick_device

GIB = 1024 ** 3


# The pure pick ---------------------------------------------------------------------------------------

def test_pick_device_one_gpu_per_local_rank():
    assert pick_device("cpu", 3, 8) == torch.device("cpu")
    assert pick_device("gpu", 3, 8) == torch.device("cuda", 3)
    assert pick_device("gpu", 0, 8) == torch.device("cuda", 0)
    # One visible GPU is the task's own (srun --gpus-per-task=1, or CUDA_VISIBLE_DEVICES=<one id>).
    assert pick_device("gpu", 5, 1) == torch.device("cuda", 0)


@pytest.mark.parametrize("local_rank,visible,key", [(4, 4, "trainer.devices"), (0, 0, "trainer.accelerator")])
def test_pick_device_refuses_a_rank_without_its_own_gpu(local_rank, visible, key):
    with pytest.raises(ConfigError) as info:
        pick_device("gpu", local_rank, visible)
    assert key in str(info.value) and "\n" not in str(info.value)


def test_local_rank_before_the_process_group():
    assert local_rank_from_env({"LOCAL_RANK": "3"}) == 3
    srun = {"SLURM_PROCID": "6", "SLURM_LOCALID": "2", "SLURM_STEP_NUM_TASKS": "8", "SLURM_NTASKS": "8"}
    assert local_rank_from_env(srun) == 2
    assert local_rank_from_env({"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "8"}) == 0  # no srun step
    assert local_rank_from_env({}) == 0


# The record of a worker's start ------------------------------------------------------------------------

class _Exited(Exception):
    def __init__(self, code):
        super().__init__(code)
        self.code = code


class _Recorder:
    """Stands in for the CUDA runtime of a node with ``visible`` GPUs and for torch.distributed."""

    def __init__(self, monkeypatch, visible: int, world: int):
        self.events = []
        self.current = None
        self.visible = visible
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "is_available", lambda: True)
        monkeypatch.setattr(cuda, "device_count", lambda: visible)
        monkeypatch.setattr(cuda, "set_device", self.set_device)
        monkeypatch.setattr(cuda, "get_device_properties", self.get_device_properties)
        monkeypatch.setattr(dist, "init_process_group", self.init_process_group)
        monkeypatch.setattr(dist, "broadcast_object_list", self.broadcast_object_list)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: world)
        monkeypatch.setattr(dist, "destroy_process_group", lambda group=None: None)
        monkeypatch.setattr(torch.backends.cuda, "matmul", _FlagRecorder(self.events, "cuda.matmul"))
        monkeypatch.setattr(torch.backends, "cudnn", _FlagRecorder(self.events, "cudnn"))
        monkeypatch.setattr(os, "_exit", self.exit)
        # The worker's training: record the device current when it starts (Lightning stays unimported).
        fake_train = types.ModuleType("megatron_hydra.training.train")
        fake_train.train = lambda cfg, derived, local_rank: self.events.append(("train", self.current))
        monkeypatch.setitem(sys.modules, "megatron_hydra.training.train", fake_train)

    def _index(self, device) -> int:
        index = device.index if isinstance(device, torch.device) else int(device)
        assert 0 <= index < self.visible, f"CUDA call on cuda:{index}, but only {self.visible} GPUs are visible"
        return index

    def set_device(self, device):
        self.current = self._index(device)
        self.events.append(("set_device", self.current))

    def get_device_properties(self, device=None):
        index = self._index(device) if device is not None else 0
        self.events.append(("get_device_properties", index))
        return SimpleNamespace(total_memory=80 * GIB, name="recorded GPU")

    def init_process_group(self, backend=None, **kwargs):
        self.events.append(("init_process_group", backend, kwargs.get("device_id")))

    def broadcast_object_list(self, objects, src=0, group=None, device=None):
        assert any(e[0] == "init_process_group" for e in self.events), "a collective before the process group"
        self.events.append(("broadcast_object_list", self.current))

    def exit(self, code):
        raise _Exited(code)

    def assert_bound_first(self, index: int) -> None:
        """set_device(index) before init_process_group(device_id=cuda:index) before any collective;
        every CUDA call on cuda:index only."""
        names = [e[0] for e in self.events]
        assert names.index("set_device") < names.index("init_process_group") < names.index("train"), self.events
        touched = {e[1] for e in self.events if e[0] in ("set_device", "get_device_properties")}
        assert touched == {index}, self.events
        init = self.events[names.index("init_process_group")]
        assert init[1:] == ("nccl", torch.device("cuda", index)), init
        if "broadcast_object_list" in names:
            assert names.index("init_process_group") < names.index("broadcast_object_list")
            assert self.events[names.index("broadcast_object_list")][1] == index
        assert self.events[names.index("train")] == ("train", index)


class _FlagRecorder:
    def __init__(self, events, name):
        object.__setattr__(self, "_events", events)
        object.__setattr__(self, "_name", name)

    def __setattr__(self, key, value):
        self._events.append((f"{self._name}.{key}", value))


def _composed(*overrides):
    """The config as launch.py composes it, before the launcher resolves ``auto`` for the machine."""
    from megatron_hydra.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return OmegaConf.to_object(compose(config_name="config", overrides=[*overrides]))


TORCHRUN = {"TORCHELASTIC_RUN_ID": "t", "RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
            "GROUP_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
SLURM = {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_NTASKS": "8",
         "SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_STEP_NUM_NODES": "2",
         "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_JOB_ID": "77"}
TWO_NODES = ["trainer.num_nodes=2", "data.global_batch_size=16"]  # 8 ranks, micro-batches of 2
LAUNCH_VARS = ("TORCHELASTIC_", "SLURM_", "SUBMITIT_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
               "GROUP_RANK", "MASTER_")


def _launch_env(extra):
    """This process's environment as the launch kind sets it (restored afterwards)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCH_VARS)}
    return mock.patch.dict(os.environ, {**clean, **extra}, clear=True)


@pytest.mark.parametrize("kind,env,visible,index", [
    ("torchrun", TORCHRUN, 4, 1),
    ("slurm, tasks share the node's GPUs", SLURM, 4, 1),
    ("slurm, --gpus-per-task=1", SLURM, 1, 0),
])
def test_external_worker_binds_its_gpu_before_the_process_group(tmp_path, monkeypatch, kind, env, visible, index):
    """launch.py under torchrun or srun: launcher.run resolves ``auto`` (gpu, the launcher's 4 ranks
    per node, bf16), checks the memory plan on this rank's GPU, then runs the worker."""
    from megatron_hydra import launcher

    cfg = _composed(*SMALL, *TWO_NODES, f"run_dir={tmp_path}")
    assert (cfg.trainer.accelerator, cfg.trainer.devices, cfg.precision.params_dtype) == ("auto", "auto", "auto")
    rec = _Recorder(monkeypatch, visible, world=8)
    with _launch_env(env), pytest.raises(_Exited) as exited:
        launcher.run(cfg)
    assert exited.value.code == 0, (tmp_path / "rank5.error").read_text()
    rec.assert_bound_first(index)
    assert ("cuda.matmul.allow_tf32", True) in rec.events and ("cudnn.allow_tf32", True) in rec.events
    assert rec.events.index(("cuda.matmul.allow_tf32", True)) < [e[0] for e in rec.events].index("train")
    ran = read_config(str(tmp_path / "resolved_config.yaml"))  # what the worker got
    assert (ran.trainer.accelerator, ran.trainer.devices, ran.precision.params_dtype) == ("gpu", 4, "bfloat16")


def test_locally_spawned_worker_binds_its_gpu_before_the_process_group(tmp_path, monkeypatch):
    """``python -m megatron_hydra.training.worker CONFIG`` as our launcher spawns it (local rank 3
    of 8 on an 8-GPU node), from the resolved config the launcher wrote."""
    from megatron_hydra.training import worker

    cfg = resolve(_composed(*SMALL, "data.global_batch_size=16", f"run_dir={tmp_path}"), visible_gpus=8)
    assert (cfg.trainer.accelerator, cfg.trainer.devices, cfg.precision.params_dtype) == ("gpu", 8, "bfloat16")
    path = write_config(cfg, str(tmp_path))
    rec = _Recorder(monkeypatch, visible=8, world=8)
    monkeypatch.setattr(worker.lifecycle, "die_with_parent", lambda pid: None)
    monkeypatch.setattr(worker, "_hold_early_sigterm", lambda: None)
    env = {"RANK": "3", "LOCAL_RANK": "3", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29500"}
    with _launch_env(env), pytest.raises(_Exited) as exited:
        worker.main([path])
    assert exited.value.code == 0, (tmp_path / "rank3.error").read_text()
    rec.assert_bound_first(3)


def test_single_process_gpu_run_binds_cuda0(tmp_path, monkeypatch):
    """``python launch.py`` on a one-GPU machine: the launcher runs the only rank in-process."""
    from megatron_hydra import launcher

    rec = _Recorder(monkeypatch, visible=1, world=1)
    with _launch_env({}):
        launcher.run(_composed(*SMALL, f"run_dir={tmp_path}"))
    rec.assert_bound_first(0)


def test_tf32_follows_the_precision_preset(tmp_path, monkeypatch):
    from megatron_hydra.training import worker

    rec = _Recorder(monkeypatch, visible=1, world=1)
    for preset, expected in (("precision=fp32", False), ("precision=auto", True), ("precision=bf16", True)):
        cfg = resolve(_composed(*SMALL, preset, f"run_dir={tmp_path}"), visible_gpus=1)
        rec.events.clear()
        worker.run_worker(cfg, derive(cfg), 0, 1)
        assert ("cuda.matmul.allow_tf32", expected) in rec.events and ("cudnn.allow_tf32", expected) in rec.events
    cpu = resolve(_composed(*SMALL, f"run_dir={tmp_path}"), visible_gpus=0)
    rec.events.clear()
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    worker.run_worker(cpu, derive(cpu), 0, 1)  # CPU: gloo, no device bound, TF32 flags untouched
    assert [e for e in rec.events if e[0] != "train"] == [("init_process_group", "gloo", None)]


@pytest.mark.parametrize("env,visible,key", [
    (TORCHRUN, 2, "torchrun --nproc-per-node"),  # 4 ranks per node, 2 GPUs
    (TORCHRUN, 1, "torchrun --nproc-per-node"),  # torchrun shares one GPU: never "one GPU per task"
    (SLURM, 2, "srun --ntasks-per-node"),
])
def test_fewer_gpus_than_local_ranks_is_one_line_before_any_binding(tmp_path, monkeypatch, env, visible, key):
    from megatron_hydra import launcher

    rec = _Recorder(monkeypatch, visible, world=8)
    with _launch_env(env), pytest.raises(ConfigError) as info:
        launcher.run(_composed(*SMALL, *TWO_NODES, f"run_dir={tmp_path}"))
    assert key in str(info.value) and "trainer.devices" in str(info.value) and "\n" not in str(info.value)
    assert not [e for e in rec.events if e[0] in ("set_device", "init_process_group")]


# Host-to-device copies -------------------------------------------------------------------------------

class _CopyRecorder(torch.Tensor):
    """A tensor that records the keyword arguments of ``.to`` instead of copying."""

    calls = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.to:
            cls.calls.append((args[1:], dict(kwargs or {})))
            return args[0]
        return super().__torch_function__(func, types, args, kwargs)


def test_batches_are_copied_to_the_gpu_without_blocking():
    """Lightning's own ``batch_to_device`` (which ``MegatronStrategy`` keeps) passes
    ``non_blocking=True`` for CUDA targets and nothing for CPU ones."""
    from megatron_hydra.parallel.state import ParallelState
    from megatron_hydra.training.strategy import MegatronStrategy

    batch = {"tokens": torch.zeros(2, 4, dtype=torch.long).as_subclass(_CopyRecorder)}
    for device, expected in ((torch.device("cuda", 3), {"non_blocking": True}), (torch.device("cpu"), {})):
        _CopyRecorder.calls.clear()
        strategy = MegatronStrategy(ParallelState.single(), device, grad_bucket_size=1000)
        strategy.batch_to_device(batch)
        assert _CopyRecorder.calls == [((device,), expected)]


def test_gpu_loaders_pin_memory_and_read_ahead(tmp_path):
    from megatron_hydra.parallel.state import ParallelState
    from megatron_hydra.training.train import build_dataloaders

    for visible, (workers, pinned) in ((1, (2, True)), (0, (0, False))):
        cfg = resolve(_composed(*SMALL, "trainer.max_steps=2", f"run_dir={tmp_path}"), visible_gpus=visible)
        train_loader, _ = build_dataloaders(cfg, derive(cfg), ParallelState.single())
        assert (train_loader.num_workers, train_loader.pin_memory) == (workers, pinned)


@pytest.mark.parametrize("overrides,visible,fragment", [
    (["trainer=gpu"], 4, "trainer.devices=8 but this machine has 4 GPUs"),  # local spawn: one GPU per rank
    (["trainer=gpu"], 0, "no CUDA device is visible"),
])
def test_local_gpu_run_without_a_gpu_per_rank_is_one_line(overrides, visible, fragment):
    from conftest import compose_config
    from megatron_hydra.launcher import check_gpus

    with pytest.raises(ConfigError, match=fragment) as info:
        check_gpus(compose_config([*SMALL, *overrides]), None, visible)
    assert "\n" not in str(info.value)
    check_gpus(compose_config([*SMALL, *overrides]), None, 8)  # eight GPUs for eight ranks


def test_cpu_threads_are_the_setting_then_omp_num_threads_then_the_cores_per_rank(monkeypatch):
    from megatron_hydra import lifecycle
    from megatron_hydra.training.worker import cpu_threads

    monkeypatch.setattr(lifecycle, "cpu_cores", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert (cpu_threads(None, 1), cpu_threads(None, 2), cpu_threads(None, 16), cpu_threads(3, 2)) == (8, 4, 1, 3)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # torchrun's choice for several ranks per node
    assert (cpu_threads(None, 2), cpu_threads(3, 2)) == (1, 3)
    monkeypatch.setenv("OMP_NUM_THREADS", "")
    assert cpu_threads(None, 2) == 4
