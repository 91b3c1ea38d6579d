"""Where checkpoints live on disk, and when a directory counts as one.

A checkpoint is a directory ``<dir>/step_NNNNNNN`` holding

- the tensors, written by ``torch.distributed.checkpoint`` (``.metadata`` + ``__*.distcp`` files),
- ``meta.json``: step, consumed samples, the layout that wrote it, logical tensor shapes, the
  resolved config, and the size and SHA-256 of every other file (``checksums``),
- ``rng/rank_NNNNN.pt``: each rank's random generator states (tensors and numbers only),
- ``COMPLETE``: the marker, written last.

Writes are atomic at the directory level: every rank writes into ``step_NNNNNNN.tmp``, and only
once all ranks are done does rank 0 write the marker and rename the directory. A save killed half
way leaves a ``.tmp`` directory that readers ignore, so the previous checkpoint stays the newest
complete one; ``clean`` removes such leftovers when the next run starts. Everything here is plain
file handling: no torch.distributed, so the launcher can check a checkpoint before any worker starts.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from typing import Dict, Iterable, List, Optional

from megatron_hydra.errors import CheckpointError

MARKER = "COMPLETE"
META = "meta.json"
DCP_METADATA = ".metadata"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_DIR = re.compile(r"^step_(\d+)\.tmp$")
# What every meta.json holds, and the type each value must have (bool is not an int here).
REQUIRED_META = {"format_version": int, "step": int, "consumed_samples": int, "shapes": dict, "has_optimizer": bool}


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
    """The metadata of the checkpoint at ``path``; a one-line ``CheckpointError`` if there is none.
    Cheap (no file is read but ``meta.json``): every file it lists is checked for presence and size
    only; their contents are hashed when the tensors are loaded (``sharded.load``)."""
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
    meta = read_meta(path)
    problem = check_files(path, meta.get("checksums", {}), meta.get("checksums", {}), hash_contents=False)
    if problem:
        raise CheckpointError(problem)
    return meta


def read_meta(path: str, required: Dict[str, type] = REQUIRED_META) -> dict:
    """``meta.json`` of the checkpoint at ``path``, with its ``required`` keys checked: a file that
    is missing, not JSON or lacks a key is a one-line ``CheckpointError`` naming the file and key."""
    file = os.path.join(path, META)
    try:
        with open(file, encoding="utf-8") as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{file}: missing; {path} is not a complete checkpoint: load another one") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file}: not valid JSON ({str(e).splitlines()[0]}): the checkpoint is damaged; "
                              "load an earlier one") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{file}: holds a {type(meta).__name__}, not a JSON object: the checkpoint is damaged")
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint.load={path} has format version {meta.get('format_version')}, this code "
                              f"reads {FORMAT_VERSION}: convert it or use a matching megatron-hydra")
    for key, kind in required.items():
        value = meta.get(key)
        if key not in meta or not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            found = "missing" if key not in meta else f"a {type(value).__name__}"
            raise CheckpointError(f"{file}: key {key!r} is {found}, expected a {kind.__name__}: the checkpoint is "
                                  "damaged or not from megatron-hydra; load another one")
    if not isinstance(meta.get("checksums", {}), dict):
        raise CheckpointError(f"{file}: key 'checksums' is not a JSON object: the checkpoint is damaged")
    return meta


# Integrity: size and SHA-256 of every file ---------------------------------------------------------
def checkpoint_files(path: str) -> List[str]:
    """Every file of a checkpoint directory that ``meta.json`` records a checksum for (all but
    ``meta.json`` and the marker), as sorted paths relative to ``path``."""
    found = []
    for dirpath, _, names in os.walk(path):
        for name in names:
            rel = os.path.relpath(os.path.join(dirpath, name), path)
            if rel not in (META, MARKER):
                found.append(rel)
    return sorted(found)


def digest(file: str) -> str:
    with open(file, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def checksums(path: str, files: Iterable[str]) -> Dict[str, dict]:
    """``{relative path: {"bytes": size, "sha256": hex}}`` of ``files`` in ``path``."""
    return {rel: {"bytes": os.path.getsize(os.path.join(path, rel)), "sha256": digest(os.path.join(path, rel))}
            for rel in files}


def check_files(path: str, recorded: Dict[str, dict], files: Iterable[str],
                hash_contents: bool = True) -> Optional[str]:
    """The first of ``files`` that is missing, truncated or (``hash_contents``) altered against
    ``recorded``, as a one-line message naming it; ``None`` when they all match."""
    for rel in files:
        expected = recorded[rel]
        file = os.path.normpath(os.path.join(path, rel))
        inside = os.path.relpath(file, path)
        if os.path.isabs(rel) or inside == os.pardir or inside.startswith(os.pardir + os.sep):
            return f"{path}/{META} lists {rel!r}, which is outside the checkpoint directory: refused"
        if not isinstance(expected, dict) or not {"bytes", "sha256"} <= expected.keys():
            return f"{path}/{META}: the checksum of {rel} is malformed: the checkpoint is damaged"
        if not os.path.isfile(file):
            return f"checkpoint file {file} is missing: the checkpoint is incomplete; load an earlier one"
        size = os.path.getsize(file)
        if size != expected["bytes"]:
            return (f"checkpoint file {file} has {size} bytes, {expected['bytes']} were written: it is truncated "
                    "or damaged; load an earlier checkpoint")
        if hash_contents and digest(file) != expected["sha256"]:
            return (f"checkpoint file {file} does not match its SHA-256 in {META}: it is corrupted; "
                    "load an earlier checkpoint")
    return None


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
    os.makedirs(tmp)
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
    _move_into_place(tmp, final)


def _move_into_place(tmp: str, final: str) -> None:
    if os.path.exists(final):  # the same step saved again (a run resumed from an earlier one)
        _remove(final)
    os.replace(tmp, final)


def _remove(path: str) -> None:
    """Delete a checkpoint directory, its marker first: a crash half way leaves a directory that
    no reader takes for a checkpoint (and that ``clean`` removes)."""
    marker = os.path.join(path, MARKER)
    if os.path.isfile(marker):
        os.remove(marker)
    shutil.rmtree(path)


def clean(root: str) -> List[str]:
    """Remove what interrupted saves and prunes left under ``root`` (rank 0, before training):
    ``step_N`` directories without the marker, and ``step_N.tmp`` directories. A ``.tmp`` that
    has its marker was completely written and only missed its rename: it is moved into place
    instead, unless a complete ``step_N`` already exists. Returns the removed paths."""
    if not os.path.isdir(root):
        return []
    removed = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if not os.path.isdir(path):
            continue
        if _TMP_DIR.match(name):
            final = path[:-len(".tmp")]
            if is_complete(path) and not is_complete(final):
                _move_into_place(path, final)
                continue
            shutil.rmtree(path)
            removed.append(path)
        elif _STEP_DIR.match(name) and not is_complete(path):
            shutil.rmtree(path)
            removed.append(path)
    return removed


def prune(root: str, keep_last: int) -> List[str]:
    """Delete all but the newest ``keep_last`` complete checkpoints (0 keeps all); returns the
    deleted paths. Only finite checkpoints are ever written (``sharded.save`` refuses the others),
    so the newest one kept is always a finite one to resume from."""
    done = complete_checkpoints(root)
    if keep_last <= 0 or len(done) <= keep_last:
        return []
    doomed = done[:-keep_last]
    for path in doomed:
        _remove(path)
    return doomed
