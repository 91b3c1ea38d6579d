"""Where checkpoints live on disk, and when a directory counts as one.

A checkpoint is a directory ``<dir>/step_NNNNNNN`` holding

- the tensors, written by ``torch.distributed.checkpoint`` (``.metadata`` + ``__*.distcp`` files),
- ``meta.json``: step, consumed samples, the layout that wrote it, logical tensor shapes, the
  resolved config, and the size and SHA-256 of every other file (``checksums``); ``adapter_only``
  when it holds a LoRA run's adapters alone (``checkpoint.selection``), whose base is another
  checkpoint,
- ``rng/rank_NNNNN.pt``: each rank's random generator states (tensors and numbers only),
- ``COMPLETE``: the marker, written last.

Writes are atomic at the directory level: every rank writes into ``step_NNNNNNN.tmp``, and only
once all ranks are done does rank 0 write the marker and rename the directory. A save killed half
way leaves a ``.tmp`` directory that readers ignore, so the previous checkpoint stays the newest
complete one; ``clean`` removes such leftovers when the next run starts. Everything here is plain
file handling: no torch.distributed, so the launcher can check a checkpoint before any worker starts.

A checkpoint directory is read as hostile data: ``meta.json`` through ``megatron_hydra.untrusted``
(a regular file, bounded size and nesting), its values range-checked, and no symbolic link is
followed, neither when a file is read nor when a directory is deleted. ``checkpoint.dir`` holds
the step directories of one run only: a link there is refused, never deleted through, and
retention deletes only checkpoints older than the one just written.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import stat
from typing import Dict, Iterable, List, Optional, Tuple

from megatron_hydra import untrusted
from megatron_hydra.errors import CheckpointError

MARKER = "COMPLETE"
META = "meta.json"
DCP_METADATA = ".metadata"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_DIR = re.compile(r"^step_(\d+)\.tmp$")
# What every meta.json holds, and the type each value must have (bool is not an int here).
REQUIRED_META = {"format_version": int, "step": int, "consumed_samples": int, "shapes": dict, "has_optimizer": bool}
# Ranges no real run leaves: a trillion steps; 2**53 samples (where a float counter stops being exact).
MAX_STEP = 10**12
MAX_CONSUMED_SAMPLES = 2**53
MAX_META_BYTES = 64 * untrusted.MiB  # shapes, checksums of every rank's files and the config


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step_{step:07d}")


def tmp_dir(final: str) -> str:
    return final.rstrip(os.sep) + ".tmp"


def step_of(path: str) -> Optional[int]:
    """The step a ``step_NNNNNNN`` directory's name says; ``None`` for any other name."""
    match = _STEP_DIR.match(os.path.basename(os.path.normpath(path)))
    return int(match.group(1)) if match else None


def is_complete(path: str) -> bool:
    return not os.path.islink(path) and os.path.isfile(os.path.join(path, MARKER))


def _step_entries(root: str) -> List[Tuple[int, str]]:
    """``(step, path)`` of every ``step_NNNNNNN`` entry under ``root``, by step, links included."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = _STEP_DIR.match(name)
        if match:
            found.append((int(match.group(1)), os.path.join(root, name)))
    return sorted(found)


def complete_checkpoints(root: str) -> List[str]:
    """Complete checkpoints under ``root``, oldest first (by step). ``.tmp`` directories and
    directories without the marker are ignored: they are saves that never finished. Symbolic links
    are never checkpoints of this directory (``check_no_links`` refuses them at the start)."""
    return [path for _, path in _step_entries(root) if is_complete(path)]


def latest(root: str) -> Optional[str]:
    done = complete_checkpoints(root)
    return done[-1] if done else None


def unrenamed(root: str) -> List[str]:
    """Completely written saves under ``root`` that missed only their rename (``step_N.tmp`` with
    the marker): ``clean`` moves them into place when the next run starts, so they count as
    checkpoints of the directory."""
    if not os.path.isdir(root):
        return []
    return sorted(os.path.join(root, n) for n in os.listdir(root)
                  if _TMP_DIR.match(n) and is_complete(os.path.join(root, n)))


def check_no_links(root: str) -> None:
    """A one-line ``CheckpointError`` for a symbolic link named like a step directory in
    ``checkpoint.dir``: the run would resume from, replace or prune what it points to, which is
    no checkpoint this run wrote."""
    if not os.path.isdir(root):
        return
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if (_STEP_DIR.match(name) or _TMP_DIR.match(name)) and os.path.islink(path):
            raise CheckpointError(f"{path} is a symbolic link (to {os.path.realpath(path)}): checkpoint.dir={root} "
                                  "holds this run's own step directories only; remove the link (to start from what "
                                  "it points to, give checkpoint.load=<that directory>)")


def validate(path: str, key: str = "checkpoint.load") -> dict:
    """The metadata of the checkpoint at ``path``; a one-line ``CheckpointError`` naming ``key`` (the
    setting that gave ``path``) if there is none. Cheap (no file is read but ``meta.json``): every
    file it lists is checked for presence and size only; their contents are hashed when the
    tensors are loaded (``sharded.load``)."""
    if os.path.islink(path.rstrip(os.sep) or path):
        raise CheckpointError(f"{key}={path} is a symbolic link: give the checkpoint directory itself, "
                              f"{key}={os.path.realpath(path)}")
    if not os.path.exists(path):
        raise CheckpointError(f"{key}={path}: no such file or directory; give the path of a step_NNNNNNN "
                              "checkpoint directory")
    if not os.path.isdir(path) or not (os.path.lexists(os.path.join(path, META))
                                       or os.path.lexists(os.path.join(path, DCP_METADATA))):
        inner = latest(path) if os.path.isdir(path) else None
        hint = f" (did you mean {inner}?)" if inner else ""
        raise CheckpointError(f"{key}={path} is not a checkpoint: expected a directory with {META} and "
                              f"{DCP_METADATA}{hint}")
    if not is_complete(path):
        raise CheckpointError(f"{key}={path} is incomplete (no {MARKER} marker: its save was "
                              "interrupted); load an older checkpoint")
    meta = read_meta(path, key=key)
    problem = check_files(path, meta.get("checksums", {}), meta.get("checksums", {}), hash_contents=False)
    if problem:
        raise CheckpointError(problem)
    return meta


def adapter_only(meta: dict) -> bool:
    """Whether a checkpoint's metadata says it holds LoRA adapters alone (no base weights)."""
    return meta.get("adapter_only") is True


def read_meta(path: str, required: Dict[str, type] = REQUIRED_META, key: str = "checkpoint.load") -> dict:
    """``meta.json`` of the checkpoint at ``path``, with its ``required`` keys checked: a file that
    is missing, not JSON or lacks a key is a one-line ``CheckpointError`` naming the file and key.
    It is hostile input: a regular file of bounded size and nesting (a FIFO would block the
    reader forever), and every value a run acts on is range-checked (``check_meta``)."""
    file = os.path.join(path, META)
    if not os.path.lexists(file):
        raise CheckpointError(f"{file}: missing; {path} is not a complete checkpoint: load another one")
    if os.path.islink(file):
        raise CheckpointError(f"{file}: is a symbolic link, which no checkpoint holds: refused")
    meta = untrusted.load_json(file, MAX_META_BYTES, "checkpoint metadata file", CheckpointError)
    if not isinstance(meta, dict):
        raise CheckpointError(f"{file}: holds a {type(meta).__name__}, not a JSON object: the checkpoint is damaged")
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{key}={path} has format version {meta.get('format_version')}, this code "
                              f"reads {FORMAT_VERSION}: convert it or use a matching megatron-hydra")
    for field, kind in required.items():
        value = meta.get(field)
        if field not in meta or not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            found = "missing" if field not in meta else f"a {type(value).__name__}"
            raise CheckpointError(f"{file}: key {field!r} is {found}, expected a {kind.__name__}: the checkpoint is "
                                  "damaged or not from megatron-hydra; load another one")
    if not isinstance(meta.get("checksums", {}), dict):
        raise CheckpointError(f"{file}: key 'checksums' is not a JSON object: the checkpoint is damaged")
    if not isinstance(meta.get("adapter_only", False), bool):
        raise CheckpointError(f"{file}: key 'adapter_only' is not true or false: the checkpoint is damaged")
    check_meta(path, meta)
    return meta


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_meta(path: str, meta: dict) -> None:
    """The values of ``meta.json`` that a run acts on, in range: a negative step would run the
    learning-rate schedule backwards (gradient ascent), a huge one or a huge sample count would
    end the run before its first step; the step must be the one the directory is named after."""
    file = os.path.join(path, META)
    for key, bound in (("step", MAX_STEP), ("consumed_samples", MAX_CONSUMED_SAMPLES)):
        value = meta.get(key, 0)
        if not _is_int(value) or not 0 <= value <= bound:
            raise CheckpointError(f"{file}: key {key!r} is {str(value)[:40]}, outside 0..{bound}: the checkpoint is "
                                  "damaged or crafted; load another one")
    named = step_of(path)
    if "step" in meta and named is not None and meta["step"] != named:
        raise CheckpointError(f"{file}: key 'step' is {meta['step']}, but the directory is step_{named:07d}: the "
                              "checkpoint is damaged or crafted; load another one")
    for name, shape in (meta.get("shapes") or {}).items():
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise CheckpointError(f"{file}: the shape of {str(name)[:80]!r} is not a list of sizes: the checkpoint is "
                                  "damaged or crafted; load another one")
    scaler = meta.get("loss_scaler")
    if scaler is not None and not (isinstance(scaler, dict) and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
            for v in scaler.values())):
        raise CheckpointError(f"{file}: key 'loss_scaler' is not a mapping of finite non-negative numbers: the "
                              "checkpoint is damaged or crafted; load another one")


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
    fd = untrusted.open_regular(file, "checkpoint file", CheckpointError, follow_links=False)
    with os.fdopen(fd, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def checksums(path: str, files: Iterable[str]) -> Dict[str, dict]:
    """``{relative path: {"bytes": size, "sha256": hex}}`` of ``files`` in ``path``."""
    return {rel: {"bytes": os.path.getsize(os.path.join(path, rel)), "sha256": digest(os.path.join(path, rel))}
            for rel in files}


def _file_problem(path: str, rel, expected) -> Optional[str]:
    """What is wrong with the recorded file ``rel`` before its size is compared, if anything."""
    if not isinstance(rel, str) or "\0" in rel or not isinstance(expected, dict) \
            or not {"bytes", "sha256"} <= expected.keys():
        return f"{path}/{META}: the checksum of {str(rel)[:80]!r} is malformed: the checkpoint is damaged"
    file = os.path.normpath(os.path.join(path, rel))
    inside = os.path.relpath(file, path)
    if os.path.isabs(rel) or inside == os.pardir or inside.startswith(os.pardir + os.sep):
        return f"{path}/{META} lists {rel!r}, which is outside the checkpoint directory: refused"
    if not os.path.lexists(file):
        return f"checkpoint file {file} is missing: the checkpoint is incomplete; load an earlier one"
    if not stat.S_ISREG(os.lstat(file).st_mode):
        return (f"checkpoint file {file} is not a regular file (a link, FIFO or device, which no checkpoint "
                "holds): refused")
    return None


def check_files(path: str, recorded: Dict[str, dict], files: Iterable[str],
                hash_contents: bool = True) -> Optional[str]:
    """The first of ``files`` that is missing, truncated or (``hash_contents``) altered against
    ``recorded``, as a one-line message naming it; ``None`` when they all match."""
    for rel in files:
        expected = recorded[rel]
        problem = _file_problem(path, rel, expected)
        if problem:
            return problem
        file = os.path.normpath(os.path.join(path, rel))
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
    if os.path.islink(tmp):
        os.unlink(tmp)  # the link, never what it points to
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    return tmp


def write_meta(tmp: str, meta: dict) -> None:
    with open(os.path.join(tmp, META), "w") as f:
        json.dump({"format_version": FORMAT_VERSION, **meta}, f, indent=1)


def _mark(path: str) -> None:
    with open(os.path.join(path, MARKER), "w") as f:
        f.write("ok\n")


def seal(path: str, meta: dict, sums: Optional[Dict[str, dict]] = None) -> None:
    """Finish the checkpoint written into the directory ``path``: ``meta.json`` with ``sums``
    (``checksums``; default: those of every file now in ``path``), then the marker, last, so
    that a directory without it is never taken for a checkpoint."""
    sums = checksums(path, checkpoint_files(path)) if sums is None else sums
    write_meta(path, {**meta, "checksums": sums})
    _mark(path)


def commit(final: str) -> None:
    """Mark the fully written temporary directory complete and move it into place (rank 0, after
    every rank has finished writing)."""
    tmp = tmp_dir(final)
    _mark(tmp)
    _move_into_place(tmp, final)


def _move_into_place(tmp: str, final: str) -> None:
    if os.path.lexists(final):  # the same step saved again (a run resumed from an earlier one)
        _remove(final)
    os.replace(tmp, final)


def _remove(path: str) -> None:
    """Delete a checkpoint directory, its marker first: a crash half way leaves a directory that
    no reader takes for a checkpoint (and that ``clean`` removes). A symbolic link is never
    deleted through: what it points to is not this run's."""
    if os.path.islink(path):
        raise CheckpointError(f"{path} is a symbolic link, not a checkpoint directory of this run: left as it is; "
                              "remove the link, then run again")
    marker = os.path.join(path, MARKER)
    if os.path.isfile(marker) and not os.path.islink(marker):
        os.remove(marker)
    shutil.rmtree(path)


def clean(root: str) -> List[str]:
    """Remove what interrupted saves and prunes left under ``root`` (rank 0, before training):
    ``step_N`` directories without the marker, and ``step_N.tmp`` directories. A ``.tmp`` that
    has its marker was completely written and only missed its rename: it is moved into place
    instead, unless a complete ``step_N`` already exists. Symbolic links are left alone.
    Returns the removed paths."""
    if not os.path.isdir(root):
        return []
    removed = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if os.path.islink(path) or not os.path.isdir(path):
            continue
        if _TMP_DIR.match(name):
            final = path[:-len(".tmp")]
            if os.path.islink(final):
                continue
            if is_complete(path) and not is_complete(final):
                _move_into_place(path, final)
                continue
            shutil.rmtree(path)
            removed.append(path)
        elif _STEP_DIR.match(name) and not is_complete(path):
            shutil.rmtree(path)
            removed.append(path)
    return removed


def prune(root: str, keep_last: int, written: Optional[str] = None) -> List[str]:
    """After the save of ``written`` (default: the newest complete checkpoint), delete the complete
    checkpoints older than it beyond the newest ``keep_last`` (counting ``written``; 0 keeps all);
    returns the deleted paths. Only lower steps are ever deleted: never the checkpoint just written,
    nor a higher step (another run's, which a fresh start refuses to mix with: ``plan.start_point``),
    nor anything through a symbolic link. Only finite checkpoints are ever written (``sharded.save``
    refuses the others), so the newest one kept is always a finite one to resume from."""
    done = complete_checkpoints(root)
    if written is None:
        written = done[-1] if done else None
    limit = step_of(written) if written is not None else None
    if keep_last <= 0 or limit is None:
        return []
    older = [path for path in done if step_of(path) < limit]
    doomed = older[:max(len(older) - (keep_last - 1), 0)]
    for path in doomed:
        _remove(path)
    return doomed
