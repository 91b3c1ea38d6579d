"""Reading and writing a Hugging Face model directory: ``config.json`` plus weights.

Weights are read from ``model.safetensors``, a sharded ``model.safetensors.index.json``, or the
older ``pytorch_model.bin`` (and its index), loaded with ``weights_only`` so that a file can never
run code. Safetensors are read lazily: their headers give every tensor's name and shape without
its data, so an import checks a ``config.json`` against its weights before it builds anything.
They are written as safetensors, split into shards with an index once a model passes
``max_shard_bytes``, which is what ``from_pretrained`` expects of a large model; ``ShardWriter``
plans the shards from names, shapes and dtypes and then takes the tensors one at a time, so an
export never holds more than the tensor it is writing.

The files come from anyone, so every problem with them is one ``CheckpointError`` naming the file:
JSON that does not parse, is too large or too deeply nested, or has the wrong shape
(``megatron_hydra.untrusted``); a FIFO or device where a file belongs (refused, never opened for
reading, so it cannot block); a truncated or damaged weights file; and an index that names a file
outside the model directory (``../../etc/passwd``), which is refused rather than read. The
confinement is by name, not by resolved link, so a Hugging Face cache snapshot, whose files are
links into a sibling ``blobs`` folder, still loads.
"""

from __future__ import annotations

import json
import math
import os
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch

from megatron_hydra import untrusted
from megatron_hydra.convert.mapping import HFConfig
from megatron_hydra.errors import CheckpointError

CONFIG = "config.json"
SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
PT_BIN, PT_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
DEFAULT_SHARD_BYTES = 5 * 1024**3
# Far above what Hugging Face writes (a config of a few KiB; an index of a few MiB for the largest
# models), far below what would hurt to read.
CONFIG_BYTES, INDEX_BYTES = 16 * untrusted.MiB, 64 * untrusted.MiB


def _read_json(path: str, limit: int) -> dict:
    """The JSON object in the regular file ``path`` of at most ``limit`` bytes (``untrusted``:
    bounded size and nesting, so a crafted file is one line, never a hang or a traceback)."""
    value = untrusted.load_json(path, limit, "Hugging Face JSON file", CheckpointError)
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} holds a JSON {type(value).__name__}, not an object; copy the file again")
    return value


def read_config(directory: str) -> HFConfig:
    """``config.json`` of the model directory, its values checked as they are read."""
    path = os.path.join(directory, CONFIG)
    if not os.path.isdir(directory):
        raise CheckpointError(f"input={directory}: no such directory; give a local Hugging Face model directory")
    if not os.path.lexists(path):
        raise CheckpointError(f"input={directory} has no {CONFIG}: give a Hugging Face model directory "
                              "(as written by save_pretrained)")
    return HFConfig(_read_json(path, CONFIG_BYTES), path)


def _unreadable(path: str, e: BaseException) -> CheckpointError:
    why = str(e).splitlines()[0] if str(e) else type(e).__name__
    return CheckpointError(f"{path}: not a readable weights file ({why}): it is truncated, damaged or not "
                           "weights; copy it again")


# The dtype names of the safetensors header, and torch's dtypes for them.
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
                      "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


class WeightFiles(Mapping):
    """The tensors of a model directory by their Hugging Face names, read when asked for.

    ``shapes`` and ``dtypes`` come from the safetensors headers alone, so that the names and
    shapes a ``config.json`` implies are checked before any tensor data is read or any model is
    built. Each read opens its file afresh: a safetensors handle maps its whole file, and every
    page read through it stays resident (counted in this process's memory) while the handle
    lives, so a handle kept open across an import would make it hold the whole model by the
    end. An older ``pytorch_model.bin`` has no header apart from its data: it is loaded whole
    (with ``weights_only``), one file at a time."""

    def __init__(self):
        self.shapes: Dict[str, List[int]] = {}
        self.dtypes: Dict[str, torch.dtype] = {}
        self.files: List[str] = []
        self._where: Dict[str, str] = {}  # name -> its file
        self._pickled: Tuple[Optional[str], Dict[str, torch.Tensor]] = (None, {})  # the .bin file last read

    def _add(self, path: str, shapes: Dict[str, List[int]], dtypes: Dict[str, torch.dtype]) -> None:
        self.files.append(path)
        self.shapes.update(shapes)
        self.dtypes.update(dtypes)
        self._where.update((name, path) for name in shapes)

    def add_safetensors(self, path: str) -> None:
        from safetensors import safe_open

        os.close(untrusted.open_regular(path, "weights file", CheckpointError))  # a FIFO would block the open
        try:
            with safe_open(path, framework="pt") as handle:
                slices = {name: handle.get_slice(name) for name in handle.keys()}
                shapes = {name: list(s.get_shape()) for name, s in slices.items()}
                kinds = {name: s.get_dtype() for name, s in slices.items()}
        except Exception as e:  # safetensors' SafetensorError
            raise _unreadable(path, e) from None
        for name, kind in kinds.items():
            if kind not in SAFETENSORS_DTYPES:
                raise CheckpointError(f"{path}: tensor {name} has dtype {kind}, which is not supported: "
                                      f"{', '.join(SAFETENSORS_DTYPES)} are")
        self._add(path, shapes, {name: SAFETENSORS_DTYPES[kind] for name, kind in kinds.items()})

    def add_pickle(self, path: str) -> None:
        tensors = _load_pickle(path)
        self._add(path, {str(n): list(t.shape) for n, t in tensors.items()},
                  {str(n): t.dtype for n, t in tensors.items()})

    def file_of(self, name: str) -> int:
        """The position of ``name``'s file among the directory's weight files (reads in this
        order go through each file once)."""
        return self.files.index(self._where[name])

    def __getitem__(self, name: str) -> torch.Tensor:
        path = self._where[name]
        if not path.endswith(".safetensors"):
            if self._pickled[0] != path:
                self._pickled = (None, {})  # the previous file's tensors go before the next is read
                self._pickled = (path, {str(n): t for n, t in _load_pickle(path).items()})
            return self._pickled[1][name]
        from safetensors import safe_open

        try:
            with safe_open(path, framework="pt") as handle:
                return handle.get_tensor(name)
        except Exception as e:
            raise _unreadable(path, e) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def _load_pickle(path: str) -> Dict[str, torch.Tensor]:
    fd = untrusted.open_regular(path, "weights file", CheckpointError)
    try:
        with os.fdopen(fd, "rb") as f:
            tensors = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:  # torch's RuntimeError/UnpicklingError/EOFError
        raise _unreadable(path, e) from None
    if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        raise CheckpointError(f"{path}: holds no state dict (a mapping of names to tensors): it is not "
                              "a model's weights; copy it again")
    return tensors


def inside(directory: str, name: object, source: str) -> str:
    """``directory/name`` for a file name taken from ``source``; refused unless it stays inside
    ``directory`` (by name: no absolute path, no ``..`` out of it)."""
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"{source}: file name {name!r} is not a string; copy the file again")
    path = os.path.normpath(os.path.join(directory, name))
    rel = os.path.relpath(path, os.path.normpath(directory))
    if os.path.isabs(name) or rel == os.pardir or rel.startswith(os.pardir + os.sep):
        raise CheckpointError(f"{source} names {name!r}, which is outside {directory}: refused "
                              "(a model's files are read from its own directory only)")
    return path


def _shard_files(directory: str, index_name: str) -> List[str]:
    index = os.path.join(directory, index_name)
    weight_map = _read_json(index, INDEX_BYTES).get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index} has no \"weight_map\" object; copy the file again")
    files = sorted({inside(directory, name, index) for name in weight_map.values()})
    for path in files:
        if not os.path.lexists(path):
            raise CheckpointError(f"{index} names {os.path.relpath(path, directory)}, which is missing: "
                                  "copy the whole model directory")
    return files


def read_weights(directory: str) -> WeightFiles:
    """Every tensor of the model directory by its Hugging Face name (read when first asked for)."""
    for single, index in ((SAFETENSORS, SAFETENSORS_INDEX), (PT_BIN, PT_INDEX)):
        if os.path.lexists(os.path.join(directory, single)):
            files = [os.path.join(directory, single)]
        elif os.path.lexists(os.path.join(directory, index)):
            files = _shard_files(directory, index)
        else:
            continue
        weights = WeightFiles()
        for path in files:
            (weights.add_safetensors if path.endswith(".safetensors") else weights.add_pickle)(path)
        return weights
    raise CheckpointError(f"input={directory} has no weights: expected {SAFETENSORS}, {SAFETENSORS_INDEX}, "
                          f"{PT_BIN} or {PT_INDEX}")


def write_config(directory: str, config: dict) -> None:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, CONFIG), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def _shards(specs: Sequence[Tuple[str, Sequence[int], torch.dtype]], max_shard_bytes: int) -> List[List[tuple]]:
    """``specs`` in order, cut into shards of at most ``max_shard_bytes`` (a larger tensor alone)."""
    shards: List[List[tuple]] = [[]]
    size = 0
    for name, shape, dtype in specs:
        nbytes = math.prod(shape) * dtype.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, tuple(shape), dtype, nbytes))
        size += nbytes
    return shards


def _header(shard: List[tuple]) -> Tuple[bytes, Dict[str, int]]:
    """The safetensors header of ``shard`` (its length as 8 little-endian bytes, then JSON padded
    with spaces to a multiple of 8) and where each tensor's data starts, counted from the file's
    start."""
    names = {dtype: kind for kind, dtype in SAFETENSORS_DTYPES.items()}
    entries, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, dtype, nbytes in shard:
        entries[name] = {"dtype": names[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    head = len(text).to_bytes(8, "little") + text
    starts, offset = {}, len(head)
    for name, _, _, nbytes in shard:
        starts[name] = offset
        offset += nbytes
    return head, starts


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):  # one call moves at most about 2 GiB on Linux
        done = os.pwrite(fd, data, offset)
        data, offset = data[done:], offset + done


class ShardWriter:
    """Safetensors shards (and their index) written one tensor at a time.

    The shards are planned from every tensor's name, shape and dtype before any data exists, so
    each file's header is written first and each tensor goes straight to its place as it comes,
    in any order: an export holds one tensor at a time, never a shard. Shards are cut in the
    order of ``specs`` at ``max_shard_bytes``, as ``from_pretrained`` expects of a large model."""

    def __init__(self, directory: str, specs: Sequence[Tuple[str, Sequence[int], torch.dtype]],
                 max_shard_bytes: int = DEFAULT_SHARD_BYTES):
        shards = _shards(specs, max_shard_bytes)
        self.directory = directory
        self.files = [SAFETENSORS] if len(shards) == 1 else [
            f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        self.total = sum(nbytes for shard in shards for *_, nbytes in shard)
        self._fds: List[int] = []
        self._pending: Dict[str, tuple] = {}  # name -> (fd, offset, shape, dtype)
        self._file_of: Dict[str, str] = {}
        os.makedirs(directory, exist_ok=True)
        try:
            for file, shard in zip(self.files, shards):
                fd = os.open(os.path.join(directory, file), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
                self._fds.append(fd)
                head, starts = _header(shard)
                _pwrite_all(fd, memoryview(head), 0)
                for name, shape, dtype, _ in shard:
                    self._pending[name] = (fd, starts[name], shape, dtype)
                    self._file_of[name] = file
        except BaseException:
            self._close()
            raise

    def put(self, name: str, tensor: torch.Tensor) -> None:
        """Write ``tensor`` as ``name``, which must have the planned shape and dtype."""
        fd, offset, shape, dtype = self._pending.pop(name)
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise ValueError(f"{name}: {tuple(tensor.shape)} {tensor.dtype} given, {shape} {dtype} planned")
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        _pwrite_all(fd, memoryview(data), offset)

    def finish(self) -> List[str]:
        """Close the shards and write the index; returns the files written. Every planned tensor
        must have been put."""
        if self._pending:
            raise ValueError(f"{len(self._pending)} planned tensors were never written, "
                             f"e.g. {next(iter(self._pending))}")
        self._close()
        if len(self.files) == 1:
            return list(self.files)
        with open(os.path.join(self.directory, SAFETENSORS_INDEX), "w") as f:
            json.dump({"metadata": {"total_size": self.total}, "weight_map": self._file_of}, f, indent=2)
        return [*self.files, SAFETENSORS_INDEX]

    def _close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, *exc) -> None:
        self._close()


def write(directory: str, config: dict, tensors: Dict[str, torch.Tensor],
          max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> List[str]:
    """Write ``config.json`` and the tensors as (sharded) safetensors; returns the files written."""
    write_config(directory, config)
    with ShardWriter(directory, [(n, t.shape, t.dtype) for n, t in tensors.items()], max_shard_bytes) as out:
        for name, t in tensors.items():
            out.put(name, t)
        return [CONFIG, *out.finish()]
