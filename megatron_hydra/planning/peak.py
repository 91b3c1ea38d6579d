"""The peak a device's MFU is measured against: model TFLOP/s per rank over this number.

GPUs: the dense (not 2:4 sparse) bf16 tensor-core peak of the GPU, from the one table the layout
planner uses too, ``peak_tflops`` of ``conf/cluster/*.yaml`` (each with the datasheet it comes
from), keyed by the cluster file's ``gpu``; ``GPU_NAMES`` maps what
``torch.cuda.get_device_name`` reports to those keys. A GPU not in it gets no MFU, unless
``trainer.peak_tflops`` gives its peak (which replaces the table and the CPU measurement alike).

CPUs have no datasheet peak worth the name (it depends on the ISA, the clock under load and how
many cores the rank's threads get). The peak is measured at start-up instead: the best of several
timed runs of a square matmul at the model's hidden size (at most ``CPU_MATMUL_MAX``), in the
model's dtype, with this rank's thread count. The best, not the mean, so that a run measured
beside other load still finds what the cores do unhindered, which keeps CPU MFU stable run to run.
On a machine whose every core other processes keep busy the best of the threads together is not
enough: each matmul waits at its threads' barriers for a core, so the threads' best swings
widely from run to run, while one thread needs one free core at a time, not all of them, and
reads steadily. The peak is therefore the larger of the threads' best together and the thread
count times one thread's best.
"""

from __future__ import annotations

import re
import time
from functools import lru_cache
from importlib import resources
from typing import Dict, Optional, Tuple

import torch
from omegaconf import OmegaConf

from megatron_hydra.config.bundled import CONF_MODULE

# torch.cuda.get_device_name -> the ``gpu`` key of conf/cluster/*.yaml, first match wins. SXM
# parts report e.g. "NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA B200".
# PCIe and NVL parts of the H100 and H200 run lower clocks and power (lower peaks) and are left
# out; the A100's datasheet gives every form factor the same 312 TFLOP/s.
GPU_NAMES: Tuple[Tuple[str, str], ...] = (
    (r"A100", "A100-SXM4-80GB"),
    (r"H100 80GB HBM3|H100[ -]SXM", "H100-SXM5-80GB"),
    (r"H200$|H200[ -]SXM", "H200-SXM-141GB"),
    (r"B200$|B200[ -]SXM", "B200-SXM-180GB"),
)
CPU_MATMUL_MAX = 512  # larger hidden sizes measure at this size (2 x 512^3 FLOPs a matmul: quick, yet past the cache)
CPU_MATMUL_RUN_S = 0.001  # one timed run: the matmul repeated for about this long (one if it takes longer)
CPU_MATMUL_RUNS = 200  # timed runs, the best kept (fewer where the budget runs out)
CPU_MATMUL_SECONDS = 0.1  # the budget of each of its two measurements, paid once at start-up


@lru_cache(maxsize=None)
def gpu_peaks() -> Dict[str, float]:
    """Dense bf16 TFLOP/s by GPU, from ``conf/cluster/*.yaml``."""
    peaks: Dict[str, float] = {}
    for entry in (resources.files(CONF_MODULE) / "cluster").iterdir():
        if entry.name.endswith(".yaml"):
            cluster = OmegaConf.create(entry.read_text())
            peaks.setdefault(str(cluster.gpu), float(cluster.peak_tflops))
    return peaks


def gpu_peak_tflops(device_name: str) -> Optional[Tuple[float, str]]:
    """(dense bf16 TFLOP/s, the table's GPU name) for a name ``torch.cuda.get_device_name`` reported;
    None for a GPU the table lacks."""
    for pattern, gpu in GPU_NAMES:
        if re.search(pattern, device_name) and gpu in gpu_peaks():
            return gpu_peaks()[gpu], gpu
    return None


def measure_cpu_peak_tflops(size: int, dtype: torch.dtype = torch.float32, runs: int = CPU_MATMUL_RUNS,
                            seconds: float = CPU_MATMUL_SECONDS) -> float:
    """TFLOP/s of a ``size`` x ``size`` matmul (capped at ``CPU_MATMUL_MAX``) in ``dtype``: the
    larger of its best rate on this process's threads and the thread count times its best rate on
    one thread (module docstring), each the best of up to ``runs`` timed runs within ``seconds``."""
    threads = torch.get_num_threads()
    best = _best_matmul_tflops(size, dtype, runs, seconds)
    if threads > 1:
        torch.set_num_threads(1)
        try:
            best = max(best, threads * _best_matmul_tflops(size, dtype, runs, seconds))
        finally:
            torch.set_num_threads(threads)
    return best


def _best_matmul_tflops(size: int, dtype: torch.dtype, runs: int, seconds: float) -> float:
    """TFLOP/s of the best of up to ``runs`` timed runs (fewer where ``seconds`` runs out), each
    repeating the matmul for about ``CPU_MATMUL_RUN_S``: on a shared machine some of them fall
    where the cores are free."""
    n = max(16, min(size, CPU_MATMUL_MAX))
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=gen).to(dtype) for _ in range(2))
    out = torch.empty(n, n, dtype=dtype)
    torch.mm(a, b, out=out)  # warm-up: thread pool, packing buffers
    once = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        once = min(once, time.perf_counter() - start)
    reps = max(1, int(CPU_MATMUL_RUN_S / max(once, 1e-7)))
    best, deadline = float("inf"), time.perf_counter() + seconds
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b, out=out)
        end = time.perf_counter()
        best = min(best, end - start)
        if end > deadline:
            break
    return 2.0 * n**3 * reps / best / 1e12


def device_peak_tflops(device: torch.device, hidden_size: int, dtype: torch.dtype,
                       configured: Optional[float] = None) -> Tuple[Optional[float], str]:
    """(the peak TFLOP/s MFU is taken against, or None; where it comes from, one line).
    ``configured`` (``trainer.peak_tflops``) is taken as it is: nothing is looked up or measured."""
    if configured is not None:
        return configured, "trainer.peak_tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        found = gpu_peak_tflops(name)
        if found is None:
            known = ", ".join(sorted(gpu_peaks()))
            return None, f"no dense bf16 peak known for GPU {name!r} (conf/cluster/*.yaml has {known})"
        peak, gpu = found
        return peak, f"{name}: dense bf16 tensor-core peak of the {gpu} (conf/cluster/*.yaml)"
    if device.type == "cpu":
        n = max(16, min(hidden_size, CPU_MATMUL_MAX))
        peak = measure_cpu_peak_tflops(hidden_size, dtype)
        return peak, (f"CPU matmul peak measured at start-up ({n}x{n} {str(dtype).replace('torch.', '')}, "
                      f"{torch.get_num_threads()} threads, or that many times one thread's rate if higher, best of up to "
                      f"{CPU_MATMUL_RUNS} runs)")
    return None, f"no peak known for device type {device.type!r}"
