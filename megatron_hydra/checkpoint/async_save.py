"""Saving a checkpoint while training goes on: copy the state to host memory, write it on a thread.

A synchronous save stops training for the whole write: DCP's planning, the file writes, the
checksums, the commit. Training only needs to wait until the values it is about to change have
been copied away, so an asynchronous save is split in two:

- ``HostStager.stage`` (training thread): the state dict's local shards copied into host memory.
  On a GPU the copies land in pinned buffers (fast device-to-host transfers), which are kept and
  reused by the next save when the shapes match, so a run allocates them once; on a CPU it is a
  plain copy, so that the next optimizer step cannot change what is being written.
- ``BackgroundWriter`` (one thread): runs the rest of the save. At most one save is in flight: a
  new one, and every point that needs the checkpoint on disk (the end of training, a stop
  signal's save, teardown), first waits for the previous one. An exception in the thread is
  kept and raised at that wait as a one-line ``CheckpointError``: a failed save is never lost.

The state dict's values are tensors (step counts) and ``checkpoint.chunks.Chunks`` (everything
else); staging keeps each as it is, with host tensors inside (``Chunks.map_local``).
A SIGKILL while the thread writes leaves a ``.tmp``
directory that no reader takes for a checkpoint (``store``): the previous one stays the newest.
"""

from __future__ import annotations

import threading
from typing import Callable, Dict, Optional

import torch
from torch.distributed.checkpoint.api import CheckpointException

from megatron_hydra.checkpoint.chunks import Chunks
from megatron_hydra.checkpoint.safe_reader import dcp_failure
from megatron_hydra.errors import CheckpointError


class HostStager:
    """Copies state dicts into host memory, reusing the buffers of the previous copy."""

    def __init__(self) -> None:
        self._buffers: Dict[str, torch.Tensor] = {}
        self._key = ""
        self._device_copies = False

    def _buffer(self, t: torch.Tensor) -> torch.Tensor:
        index = self._count
        self._count += 1
        key = f"{self._key}#{index}"
        buf = self._buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype or buf.stride() != t.stride():
            pin = t.device.type == "cuda"
            buf = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu", pin_memory=pin)
            self._buffers[key] = buf
        return buf

    def _copy(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        buf = self._buffer(t)
        if t.device.type != "cpu":
            self._device_copies = True
        buf.copy_(t, non_blocking=buf.is_pinned())
        return buf

    def _stage_value(self, v):
        return v.map_local(self._copy) if isinstance(v, Chunks) else self._copy(v)

    @torch.no_grad()
    def stage(self, sd: dict) -> dict:
        """A copy of ``sd`` whose tensors live in host memory, complete when this returns."""
        out = {}
        self._device_copies = False
        for key, value in sd.items():
            self._key, self._count = key, 0
            out[key] = self._stage_value(value)
        if self._device_copies and torch.cuda.is_available():
            torch.cuda.synchronize()  # the non-blocking copies have landed before anyone reads them
        return out


class BackgroundWriter:
    """One background thread per save, at most one at a time; failures kept for the next wait."""

    def __init__(self) -> None:
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._what = ""

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, what: str, fn: Callable[[], None]) -> None:
        """Run ``fn`` in the background, after the previous save has finished (``wait``)."""
        self.wait()
        self._what = what

        def run() -> None:
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - every failure is raised again by ``wait``
                self._error = e

        # A daemon: a process that dies of an error elsewhere does not hang on a write; what the
        # thread left unfinished is a .tmp directory, removed by the next run (store.clean).
        self._thread = threading.Thread(target=run, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Block until the save in flight (if any) has finished; raise its failure, one line."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is None:
            return
        if isinstance(error, CheckpointException):  # its message names only the failed ranks
            error = dcp_failure(error)
        if isinstance(error, CheckpointError):
            raise error
        first = (str(error).strip().splitlines() or [""])[0]
        raise CheckpointError(f"saving {self._what} failed in the background ({type(error).__name__}: {first}); "
                              "the newer checkpoint was not written, the older ones are kept") from error
