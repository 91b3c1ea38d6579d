"""How the processes of one run live and end together.

- **Run lock.** ``fcntl.flock`` on ``.megatron_hydra.lock`` in the run directory and in
  ``checkpoint.dir``: two runs writing one checkpoint directory would prune and overwrite each
  other's checkpoints, so the second one is refused. The kernel drops the lock when its holder dies,
  however it dies, so a crashed run never leaves a stale lock behind.
- **Parent-death signal.** Local workers run in their own sessions (torch's elastic agent starts
  them that way), so a SIGKILL of the launcher's process group does not reach them. Each worker asks
  the kernel (``prctl(PR_SET_PDEATHSIG, SIGKILL)``) to be killed the moment its launcher is gone:
  no orphan trains on, saves or prunes after that.
- **Writable directories.** Checked before any worker starts, so an unwritable ``checkpoint.dir``
  is not found at the first save, after hours of training.
- **Stopping at once.** A one-process run trains in its launcher's process, so a second stop
  signal cannot kill a worker there: it raises ``StopAtOnce`` instead.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import signal
import tempfile
from contextlib import ExitStack, contextmanager
from typing import Iterator, Optional, Sequence, Tuple

from megatron_hydra.errors import ConfigError

LOCK_FILE = ".megatron_hydra.lock"
PR_SET_PDEATHSIG = 1
# The launcher's pid, handed to its workers: the parent-death signal is armed after the worker has
# started, so a launcher that died in between is found by comparing it with os.getppid().
LAUNCHER_PID_ENV = "MEGATRON_HYDRA_LAUNCHER_PID"


class StopAtOnce(BaseException):
    """A second SIGTERM/SIGINT to a run that trains in this process: leave now, without saving.
    A BaseException like KeyboardInterrupt, so that no ``except Exception`` on the way (a logging
    handler's, a retry loop's) swallows it; not a KeyboardInterrupt, which Lightning turns into
    ``sys.exit(1)``. The launcher reports it as ``Interrupted``."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def check_writable(path: str, key: str) -> None:
    """Create ``path`` if needed and write a probe file into it; a ConfigError naming ``key`` if
    either fails (a read-only file system, a missing permission, a file in the way)."""
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write_probe_"):
            pass
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise ConfigError(f"{key}={path} is not a writable directory ({reason}): point {key} at a directory "
                          "you can write to") from None


def _lock_one(path: str, key: str) -> int:
    fd = os.open(os.path.join(path, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            holder = _read_holder(path)
            raise ConfigError(f"{key}={path} is in use by another run{holder}: wait for it to end, or choose "
                              f"another {key}") from None
        raise
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def _read_holder(path: str) -> str:
    try:
        with open(os.path.join(path, LOCK_FILE)) as f:
            pid = f.read().strip()
    except OSError:
        return ""
    return f" (pid {pid})" if pid.isdigit() else ""


@contextmanager
def run_lock(dirs: Sequence[Tuple[str, str]]) -> Iterator[None]:
    """Hold an exclusive lock on every ``(directory, config key)`` for the life of the block; the
    same directory named twice (``checkpoint.dir`` inside the run dir is the default) is locked once."""
    with ExitStack() as stack:
        seen = set()
        for path, key in dirs:
            real = os.path.realpath(path)
            if real in seen:
                continue
            seen.add(real)
            check_writable(path, key)
            fd = _lock_one(path, key)
            stack.callback(os.close, fd)
        yield


def die_with_parent(expected_parent: Optional[int]) -> None:
    """Have the kernel SIGKILL this process when its parent (the launcher) dies; if the launcher is
    already gone (it died before this call), leave at once. Linux only; elsewhere a no-op."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(1)


def cpu_cores() -> int:
    """The cores this process may run on (cgroups, SLURM and taskset shrink them)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
