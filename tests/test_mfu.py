"""MFU: model TFLOP/s per rank over the device's peak. GPUs take the dense bf16 tensor-core peak
of their datasheet (matched from the name torch reports), CPUs a matmul peak measured at start-up."""

from __future__ import annotations

import logging
import time
from unittest import mock

import pytest
import torch

from conftest import SMALL, run_training

# Dense (not sparse) bf16 tensor-core TFLOP/s, from NVIDIA's datasheets: A100 (SXM and PCIe) 312,
# H100 SXM 989 (1,979 with sparsity), H200 SXM 989, HGX B200 2,250 (36 PFLOPS with sparsity per 8 GPUs).
DATASHEET = {
    "NVIDIA A100-SXM4-40GB": 312.0,
    "NVIDIA A100-SXM4-80GB": 312.0,
    "NVIDIA A100 80GB PCIe": 312.0,
    "NVIDIA H100 80GB HBM3": 989.0,
    "NVIDIA H200": 989.0,
    "NVIDIA B200": 2250.0,
}


@pytest.mark.parametrize("name,peak", list(DATASHEET.items()))
def test_gpu_peak_is_the_datasheets(name, peak):
    from megatron_hydra.planning.peak import device_peak_tflops

    with mock.patch.object(torch.cuda, "get_device_name", return_value=name):
        found, source = device_peak_tflops(torch.device("cuda", 0), 4096, torch.bfloat16)
    assert found == peak and name in source


@pytest.mark.parametrize("name", ["NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200 NVL", "NVIDIA GeForce RTX 4090"])
def test_unknown_gpus_get_no_mfu(name):
    from megatron_hydra.planning.peak import device_peak_tflops

    with mock.patch.object(torch.cuda, "get_device_name", return_value=name):
        found, source = device_peak_tflops(torch.device("cuda", 0), 4096, torch.bfloat16)
    assert found is None and name in source and "\n" not in source


def test_one_table_for_planner_and_mfu():
    """The peaks come from conf/cluster/*.yaml (the planner's table); every reported name maps to a
    GPU of that table."""
    from megatron_hydra.planning.peak import GPU_NAMES, gpu_peaks

    assert gpu_peaks() == {"A100-SXM4-40GB": 312.0, "A100-SXM4-80GB": 312.0, "H100-SXM5-80GB": 989.0,
                           "H200-SXM-141GB": 989.0, "B200-SXM-180GB": 2250.0}
    assert {gpu for _, gpu in GPU_NAMES} <= set(gpu_peaks())


def test_cpu_peak_is_a_matmul_rate():
    """Against the test's own timing of the same matmul (best of many runs, one thread): both are
    rates of the same kernel, so they agree to the noise of a shared machine."""
    from megatron_hydra.planning.peak import measure_cpu_peak_tflops

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        n = 256
        a, b = torch.randn(n, n), torch.randn(n, n)
        best = float("inf")
        for _ in range(100):
            start = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - start)
        reference = 2 * n**3 / best / 1e12
        measured = measure_cpu_peak_tflops(n)
    finally:
        torch.set_num_threads(threads)
    assert reference / 3 < measured < reference * 3, (measured, reference)


def test_a_cpu_run_logs_mfu(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="megatron_hydra"):
        rows = run_training([*SMALL, "trainer.max_steps=3", "trainer.peak_tflops=null"], tmp_path)
    assert all(r["mfu"] > 0 for r in rows)
    # One peak for the run: mfu is tflops_per_rank in percent of it, the same ratio on every row.
    ratios = [r["mfu"] / r["tflops_per_rank"] for r in rows]
    assert max(ratios) == pytest.approx(min(ratios), rel=1e-5)
    assert "mfu against" in caplog.text and "CPU matmul peak measured at start-up" in caplog.text


def test_configured_peak_replaces_the_table_and_the_measurement(tmp_path, caplog):
    """``trainer.peak_tflops``: a GPU the table lacks gets an MFU, a CPU run measures nothing, and
    every row's mfu is tflops_per_rank in percent of the given number."""
    from megatron_hydra.planning import peak

    with mock.patch.object(torch.cuda, "get_device_name", return_value="NVIDIA H100 PCIe"):
        assert peak.device_peak_tflops(torch.device("cuda", 0), 4096, torch.bfloat16, 756.0) == (
            756.0, "trainer.peak_tflops")
    with mock.patch.object(peak, "measure_cpu_peak_tflops", side_effect=AssertionError("measured")):
        assert peak.device_peak_tflops(torch.device("cpu"), 64, torch.float32, 0.5)[0] == 0.5
    with caplog.at_level(logging.INFO, logger="megatron_hydra"):
        rows = run_training([*SMALL, "trainer.max_steps=2", "trainer.peak_tflops=0.5"], tmp_path)
    # float32 in the logged metrics
    assert [r["mfu"] for r in rows] == pytest.approx([100 * r["tflops_per_rank"] / 0.5 for r in rows], rel=1e-5)
    assert "mfu against 0.5 TFLOP/s: trainer.peak_tflops" in caplog.text


@pytest.mark.parametrize("value", ["0", "-3"])
def test_configured_peak_must_be_positive(value):
    from conftest import compose_config
    from megatron_hydra.config import derive
    from megatron_hydra.errors import ConfigError

    with pytest.raises(ConfigError, match=f"trainer.peak_tflops={value}.* must be positive"):
        derive(compose_config([*SMALL, f"trainer.peak_tflops={value}"]))
