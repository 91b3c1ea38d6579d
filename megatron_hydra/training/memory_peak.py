"""A rank's peak memory since the last reset: the ``peak_memory_gib`` metric.

On a GPU it is what the caching allocator handed out at most (``torch.cuda.max_memory_allocated``):
tensors, not the allocator's cached but free blocks, nor the CUDA context. On a CPU it is the
process's resident-set high-water mark (``VmHWM`` of ``/proc/self/status``), which also counts the
interpreter, torch's libraries and the data loader; writing ``5`` to ``/proc/self/clear_refs``
resets it to the current RSS (Linux). Where that file cannot be written the peak is the one since
the process started, and where ``/proc`` is missing (not Linux) there is no CPU peak.
"""

from __future__ import annotations

from typing import Optional

import torch


def _status_bytes(field: str) -> Optional[int]:
    """``field`` (VmHWM, VmRSS) of ``/proc/self/status`` in bytes; None without ``/proc``."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        pass
    return None


def _vm_hwm_bytes() -> Optional[int]:
    return _status_bytes("VmHWM")


def peak_memory_bytes(device: torch.device) -> Optional[int]:
    """This rank's peak bytes since the last ``reset_peak_memory`` (None: not measurable here)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return _vm_hwm_bytes()


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak window (cheap: no device sync, no page walk)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def resident_peak_added(fn) -> int:
    """Bytes of resident memory ``fn()`` adds to this process at its peak, on Linux: the heap's
    free pages handed back first (so that reusing them shows), the high-water mark reset, then
    ``VmHWM`` after ``fn`` minus ``VmRSS`` before it. For tests and benchmarks of host memory."""
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)
    reset_peak_memory(torch.device("cpu"))
    before = _status_bytes("VmRSS")
    fn()
    return _status_bytes("VmHWM") - before
