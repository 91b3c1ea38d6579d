"""mode=dry_run as a guest: it says when a job does not fit a GPU, keeps torch's C++ warnings off
the screen, and importing the package registers no stand-in device.

References: the device size the test sets (``trainer.device_memory_gb``, a ``cluster=`` file),
the memory plan's own fixes (``planning.fit``), and torch's unrenamed PrivateUse1 backend.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megatron_hydra.config import derive
from megatron_hydra.errors import ConfigError
from megatron_hydra.training import dry_run as D
from conftest import compose_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["mode=dry_run", "data=synthetic", "trainer=gpu", "trainer.devices=4", "parallel=tp2_pp2",
        "data.global_batch_size=8", "precision=bf16", "dry_run.ranks=[0,3]"]


def test_ranks_over_the_device_are_named_with_the_plans_fixes(capsys):
    from megatron_hydra.planning.fit import fixes
    from megatron_hydra.planning.memory import plan_memory

    cfg = compose_config([*TINY, "trainer.device_memory_gb=0.01"])
    derived = derive(cfg)
    with pytest.raises(ConfigError) as raised:
        D.run_dry_run(cfg, derived)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith("mode=dry_run: ranks 0, 3 need up to ")
    assert "but a device has 0.01 GiB (trainer.device_memory_gb)" in message
    expected = fixes(cfg, derived, plan_memory(cfg, derived)) or ["a larger trainer.devices x trainer.num_nodes"]
    assert f"the memory plan suggests {'; or '.join(expected)}" in message
    out = capsys.readouterr().out  # the table comes first, each rank over the device marked
    rows = [line for line in out.splitlines() if line.lstrip().startswith(("0 pp", "3 pp"))]
    assert len(rows) == 2 and all(row.endswith(" !") for row in rows)
    assert "device memory 0.01 GiB (trainer.device_memory_gb)" in out and "2 of 2 ranks do NOT fit" in out


def test_the_cluster_gives_the_device_size_unless_the_trainer_sets_one():
    cfg = compose_config([*TINY, "cluster=h100_80g_x1024"])
    device = D.device_memory(cfg)
    assert device.bytes == 80 * 2**30 and device.source.startswith("cluster=h100_80g_x1024")
    assert device.cfg.trainer.device_memory_gb == 80.0 and cfg.trainer.device_memory_gb is None  # a copy is sized
    results = D.run_dry_run(cfg, derive(cfg))  # a tiny model fits an H100: no error
    assert all(0 < r.needed_bytes < device.bytes for r in results)
    sized = compose_config([*TINY, "cluster=h100_80g_x1024", "trainer.device_memory_gb=12"])
    assert D.device_memory(sized).bytes == 12 * 2**30


def test_launch_exits_2_after_the_table_without_torchs_cpp_warnings(tmp_path):
    """Through ``launch.py``: the table, then one error line, status 2. The fake group's C++
    teardown warning ("No backend of type 0 found ...", printed by C++ on stderr) is not there."""
    done = subprocess.run([sys.executable, os.path.join(ROOT, "launch.py"), *TINY, "trainer.device_memory_gb=0.01",
                           f"hydra.run.dir={tmp_path}"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2, done.stderr
    assert "dry run: model=gpt_tiny" in done.stdout and "do NOT fit" in done.stdout
    assert "No backend of type" not in done.stderr and "Warning" not in done.stderr, done.stderr
    assert [line for line in done.stderr.splitlines() if line.strip()] == [
        next(line for line in done.stderr.splitlines() if line.startswith("error: mode=dry_run: ranks 0, 3 need"))]


def test_importing_the_package_registers_no_device():
    """Every module of the launcher's and the model's path imported in a fresh process: torch's
    PrivateUse1 slot keeps its own name, so the stand-in GPU of the dry run is nowhere."""
    code = """
import importlib, pkgutil, torch
import megatron_hydra
guest = ("megatron_hydra.training.dry_run", "megatron_hydra.training.fake_gpu")
names = [m.name for m in pkgutil.walk_packages(megatron_hydra.__path__, "megatron_hydra.")
         if m.name not in guest and not m.name.endswith("__main__")]
for name in names:
    importlib.import_module(name)
import launch
assert "megatron_hydra.launcher" in names and "megatron_hydra.models.gpt" in names, names
assert torch._C._get_privateuse1_backend_name() == "privateuseone", torch._C._get_privateuse1_backend_name()
assert not hasattr(torch, "fakegpu")
print(len(names))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) > 50


FORBIDDEN = ("is_fake", "privateuse1", "FakeTensor", "_get_current_function_mode_stack", "_warmup_p2p")


def test_the_core_holds_no_dry_run_branch():
    """Model and parallel code carry no fake-tensor or stand-in-device checks (the dry run is a
    guest: what it needs it registers itself), no replay of the forward's torch-function modes (the
    stand-in's kernels are dispatcher registrations), and torch's pipeline warm-up vote is touched
    only by the one module that holds torch's private pipelining API, in a helper only the dry run
    enters (``pipeline_runtime.warmup_vote_settled``)."""
    found = []
    for folder in ("models", "parallel"):
        base = os.path.join(ROOT, "megatron_hydra", folder)
        for name in sorted(os.listdir(base)):
            if name.endswith(".py"):
                with open(os.path.join(base, name)) as f:
                    text = f.read()
                allowed = {"_warmup_p2p"} if (folder, name) == ("parallel", "pipeline_runtime.py") else set()
                found += [f"{folder}/{name}: {w}" for w in FORBIDDEN if w in text and w not in allowed]
    assert found == [], found
