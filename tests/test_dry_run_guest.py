"""The dry run brings what its stand-in GPU needs through torch's extension points, so the core
(activation recompute, the pipeline) knows nothing of it.

- Attention and RMSNorm take the GPU's fused kernels on the stand-in on *every* thread: autograd
  replays a recomputed region on the thread that runs the device's backward, where a
  torch-function mode of the forward's thread is not active. The reference is torch's own kernel
  names: the flash kernel, and no ``pow``/``rsqrt`` of the composite RMSNorm.
- A pipeline settles torch's start-up vote on the fake group without ``parallel/`` skipping it.
  The reference is ``mode=plan``'s analytic state bytes per rank.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_hydra.training import fake_gpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
in_this_process = pytest.mark.skipif(not fake_gpu.registered(),
                                     reason="a real accelerator is usable: the dry run runs in its own process")


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _ops_on_another_thread(fn, fake_mode):
    """The aten ops ``fn()`` runs on a fresh thread, as autograd's device thread runs a replay:
    the forward's dispatch modes (fake tensors) carried over, its torch-function modes not."""
    ops, failed = _Ops(), []

    def run():
        try:
            with fake_mode, ops:
                fn()
        except BaseException as e:  # handed to the test's thread
            failed.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive() and not failed, failed
    return ops.names


@in_this_process
def test_gpu_kernels_hold_on_a_thread_other_than_the_forwards():
    device = fake_gpu.register()
    with fake_gpu.fake_gpu():
        q, k, v = (torch.empty(1, 4, 64, 32, dtype=torch.bfloat16, device=device, requires_grad=True)
                   for _ in range(3))
        x = torch.empty(2, 64, 32, dtype=torch.bfloat16, device=device, requires_grad=True)
        weight = torch.empty(32, dtype=torch.bfloat16, device=device, requires_grad=True)
        attention = _ops_on_another_thread(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                                           q.fake_mode)
        norm = _ops_on_another_thread(lambda: F.rms_norm(x, (32,), weight, 1e-5), x.fake_mode)
    assert "aten._scaled_dot_product_flash_attention.default" in attention, attention
    assert not any("softmax" in op or "bmm" in op for op in attention), attention  # not the unfused kernel
    assert not any(op.startswith(("aten.pow", "aten.rsqrt", "aten.mean")) for op in norm), norm


def test_full_recompute_through_an_interleaved_pipeline_in_its_own_process():
    """Each recomputed layer is replayed on autograd's device thread, over the two virtual stages of
    the last pipeline rank (it holds the loss), on the fake group; run in a process of its own, so
    an abort fails this test only."""
    code = f"""
import sys
sys.path.insert(0, {os.path.join(ROOT, "tests")!r})
from conftest import compose_config
from megatron_hydra.config import derive
from megatron_hydra.training import dry_run as D
cfg = compose_config(["data=synthetic", "trainer=gpu", "trainer.devices=2", "parallel=pp2", "model.num_layers=4",
                      "parallel.pipeline_schedule=interleaved_1f1b", "parallel.virtual_pipeline_size=2",
                      "data.micro_batch_size=1", "data.global_batch_size=4", "precision=bf16",
                      "model.normalization=rmsnorm", "recompute.granularity=full"])
for r in D.dry_run(cfg, derive(cfg), [1]):
    print(r.position, r.static_bytes, r.plan_static_bytes, r.peak_bytes)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.rsplit(" ", 3) for line in done.stdout.splitlines() if line.startswith("pp")]
    assert [row[0] for row in rows] == ["pp1 tp0 dp0"], done.stdout
    for _, state, plan, peak in rows:
        assert abs(int(state) / int(plan) - 1) < 0.10 and int(peak) > int(state), rows
