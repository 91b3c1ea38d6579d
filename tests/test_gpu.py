"""Checks only a CUDA GPU can run (``pytest -m gpu``; ``scripts/gpu_check.sh`` runs them with the
rest of the GPU acceptance). Without CUDA every test here is skipped, with the reason printed
under ``-rs``.

References: the same step on the CPU (bf16 within bf16's tolerance), and ``mode=plan``'s bytes
against what torch's CUDA allocator reports for the same run.
"""

from __future__ import annotations

import pytest
import torch

from conftest import SMALL, compose_config, run_training
from megatron_hydra.config import derive

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: run scripts/gpu_check.sh on a GPU")]

STEPS = ["trainer.max_steps=4", "trainer.val_check_interval=0", "checkpoint.save_last=false"]


def test_bf16_step_on_cuda_equals_the_cpu_step(tmp_path):
    """Same config, same seed: the GPU's bf16 losses follow the CPU's to bf16's precision (the
    kernels differ in accumulation order, not in what they compute)."""
    common = [*SMALL, *STEPS, "precision=bf16", "trainer.devices=1"]
    gpu = run_training(["trainer=gpu", *common], tmp_path / "gpu")
    cpu = run_training(["trainer=cpu", *common], tmp_path / "cpu")
    gpu_losses, cpu_losses = [m["loss"] for m in gpu], [m["loss"] for m in cpu]
    assert len(gpu_losses) == len(cpu_losses) == 4
    assert gpu_losses == pytest.approx(cpu_losses, rel=2e-2)


def test_plan_predicts_the_allocator_peak(tmp_path):
    """``mode=plan``'s weights + grads + main weights + optimizer + activations for a single GPU
    run, against ``torch.cuda.max_memory_allocated`` over two steps (the CUDA context, NCCL and
    the allocator's caching are outside both)."""
    from megatron_hydra.planning.memory import rank_memory

    overrides = ["trainer=gpu", "trainer.devices=1", "data=synthetic", "model=gpt_125m", "precision=bf16",
                 "data.micro_batch_size=4", "data.global_batch_size=8", "model.seq_length=1024",
                 "trainer.max_steps=2", "checkpoint.save_last=false", "trainer.enable_progress_bar=false"]
    torch.cuda.reset_peak_memory_stats()
    run_training(overrides, tmp_path)
    measured = torch.cuda.max_memory_allocated()
    cfg = compose_config(overrides)
    planned = rank_memory(cfg, derive(cfg), 0)
    planned_bytes = planned.static_bytes + planned.activation_bytes
    print(f"allocator peak {measured / 2**30:.2f} GiB, plan {planned_bytes / 2**30:.2f} GiB")
    assert measured == pytest.approx(planned_bytes, rel=0.10)


def test_peak_memory_and_profiler_on_cuda(tmp_path):
    """``peak_memory_gib`` is the allocator's peak (at least 16 bytes per parameter: weights,
    grads, main weights and AdamW moments; at most the device), and the profiled steps' trace
    holds CUDA kernels."""
    import json

    rows = run_training([*SMALL, "trainer=gpu", "trainer.devices=1", "trainer.log_every_n_steps=1",
                         "trainer.max_steps=3", "trainer.profile_steps=[1,2]", "checkpoint.save_last=false"], tmp_path)
    h, layers = 64, 2  # SMALL's GPT, counted as in test_observability.py
    params = 512 * h + 32 * h + layers * (12 * h * h + 13 * h) + 2 * h
    device_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    assert all(16 * params / 2**30 < r["peak_memory_gib"] < device_gib for r in rows)
    events = json.loads((tmp_path / "profile" / "rank0.json").read_text())["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events)
