"""Where checkpoints live on disk, and when a directory counts as one.

A checkpoint is a directory ``<dir>/step_NNNNNNN`` holding

- the tensors, written by ``torch.distributed.checkpoint`` (``.metadata`` + ``__*.distcp`` files),
- ``meta.json``: step, consumed samples, the layout that wrote it, logical tensor shapes, the
  resolved config,
- ``rng/rank_NNNNN.pt``: each rank's random generator states (tensors and numbers only),
- ``COMPLETE``: the marker, written last.

Writes are atomic at the directory level: every rank writes into ``step_NNNNNNN.tmp``, and only
once all ranks are done does rank 0 write the marker and rename the directory. A save killed half
way leaves a ``.tmp`` directory that readers ignore (and the next save of that step replaces), so
the previous checkpoint stays the newest complete one. Everything here is plain file handling: no
torch.distributed, so the launcher can check a checkpoint before any worker starts.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import List, Optional

from megatron_hydra.errors import CheckpointError

MARKER = "COMPLETE"
META = "meta.json"
DCP_METADATA = ".metadata"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:07d}")


def tmp_dir(final: str) -> str:
    return final.rstrip(os.sep) + ".tmp"


def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MARKER))


def complete_checkpoints(root: str) -> List[str]:
    """Complete checkpoints under ``root``, oldest first (by step). ``.tmp`` directories and
    directories without the marker are ignored: they are saves that never finished."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = _STEP_DIR.match(name)
        path = os.path.join(root, name)
        if match and is_complete(path):
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def latest(root: str) -> Optional[str]:
    done = complete_checkpoints(root)
    return done[-1] if done else None


def validate(path: str) -> dict:
    """The metadata of the checkpoint at ``path``; a one-line ``CheckpointError`` if there is none."""
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint.load={path}: no such file or directory; give the path of a step_NNNNNNN "
                              "checkpoint directory")
    if not os.path.isdir(path) or not (os.path.isfile(os.path.join(path, META))
                                       or os.path.isfile(os.path.join(path, DCP_METADATA))):
        inner = latest(path) if os.path.isdir(path) else None
        hint = f" (did you mean {inner}?)" if inner else ""
        raise CheckpointError(f"checkpoint.load={path} is not a checkpoint: expected a directory with {META} and "
                              f"{DCP_METADATA}{hint}")
    if not is_complete(path):
        raise CheckpointError(f"checkpoint.load={path} is incomplete (no {MARKER} marker: its save was "
                              "interrupted); load an older checkpoint")
    with open(os.path.join(path, META)) as f:
        meta = json.load(f)
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint.load={path} has format version {meta.get('format_version')}, this code "
                              f"reads {FORMAT_VERSION}: convert it or use a matching megatron-hydra")
    return meta


def resolve(root: Optional[str], resume: str, load: Optional[str]) -> Optional[str]:
    """The checkpoint a run starts from: with ``resume=auto`` the newest complete one in ``root``
    (a run continuing after a stop), else ``load`` (a run started from a given checkpoint)."""
    if resume == "auto" and root:
        found = latest(root)
        if found:
            return found
    return load


def prepare(final: str) -> str:
    """The empty temporary directory to write ``final`` into (rank 0, before the others write)."""
    tmp = tmp_dir(final)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(os.path.join(tmp, "rng"))
    return tmp


def write_meta(tmp: str, meta: dict) -> None:
    with open(os.path.join(tmp, META), "w") as f:
        json.dump({"format_version": FORMAT_VERSION, **meta}, f, indent=1)


def commit(final: str) -> None:
    """Mark the fully written temporary directory complete and move it into place (rank 0, after
    every rank has finished writing)."""
    tmp = tmp_dir(final)
    with open(os.path.join(tmp, MARKER), "w") as f:
        f.write("ok\n")
    if os.path.exists(final):  # the same step saved again (a run resumed from an earlier one)
        shutil.rmtree(final)
    os.replace(tmp, final)


def prune(root: str, keep_last: int) -> List[str]:
    """Delete all but the newest ``keep_last`` complete checkpoints (0 keeps all); returns the
    deleted paths. Incomplete directories are left for the next save of their step to replace."""
    done = complete_checkpoints(root)
    if keep_last <= 0 or len(done) <= keep_last:
        return []
    doomed = done[:-keep_last]
    for path in doomed:
        os.remove(os.path.join(path, MARKER))  # never leave a half-deleted directory looking complete
        shutil.rmtree(path)
    return doomed
