"""Reading and writing a Hugging Face model directory: ``config.json`` plus weights.

Weights are read from ``model.safetensors``, a sharded ``model.safetensors.index.json``, or the
older ``pytorch_model.bin`` (and its index), loaded with ``weights_only`` so that a file can never
run code. Safetensors are read lazily: their headers give every tensor's name and shape without
its data, so an import checks a ``config.json`` against its weights before it builds anything.
They are written as safetensors, split into shards with an index once a model passes
``max_shard_bytes``, which is what ``from_pretrained`` expects of a large model.

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
import os
from typing import Dict, Iterator, List, Mapping, Tuple

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


class WeightFiles(Mapping):
    """The tensors of a model directory by their Hugging Face names, read when asked for.

    ``shapes`` comes from the safetensors headers alone, so that the names and shapes a
    ``config.json`` implies are checked before any tensor data is read or any model is built. An
    older ``pytorch_model.bin`` has no header apart from its data: it is loaded whole (with
    ``weights_only``)."""

    def __init__(self):
        self.shapes: Dict[str, List[int]] = {}
        self._where: Dict[str, Tuple[str, object]] = {}  # name -> (file, safetensors handle or tensor)

    def add_safetensors(self, path: str) -> None:
        from safetensors import safe_open

        os.close(untrusted.open_regular(path, "weights file", CheckpointError))  # a FIFO would block the open
        try:
            handle = safe_open(path, framework="pt")
            shapes = {name: list(handle.get_slice(name).get_shape()) for name in handle.keys()}
        except Exception as e:  # safetensors' SafetensorError
            raise _unreadable(path, e) from None
        self.shapes.update(shapes)
        self._where.update((name, (path, handle)) for name in shapes)

    def add_pickle(self, path: str) -> None:
        fd = untrusted.open_regular(path, "weights file", CheckpointError)
        try:
            with os.fdopen(fd, "rb") as f:
                tensors = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # torch's RuntimeError/UnpicklingError/EOFError
            raise _unreadable(path, e) from None
        if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
            raise CheckpointError(f"{path}: holds no state dict (a mapping of names to tensors): it is not "
                                  "a model's weights; copy it again")
        self.shapes.update((str(name), list(t.shape)) for name, t in tensors.items())
        self._where.update((str(name), (path, t)) for name, t in tensors.items())

    def __getitem__(self, name: str) -> torch.Tensor:
        path, source = self._where[name]
        if isinstance(source, torch.Tensor):
            return source
        try:
            return source.get_tensor(name)
        except Exception as e:
            raise _unreadable(path, e) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


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


def write(directory: str, config: dict, tensors: Dict[str, torch.Tensor],
          max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> List[str]:
    """Write ``config.json`` and the tensors as (sharded) safetensors; returns the files written."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, CONFIG), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    shards: List[Dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], os.path.join(directory, SAFETENSORS), metadata={"format": "pt"})
        return [CONFIG, SAFETENSORS]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards):
        save_file(shard, os.path.join(directory, name), metadata={"format": "pt"})
        weight_map.update({key: name for key in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(directory, SAFETENSORS_INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return [CONFIG, *names, SAFETENSORS_INDEX]
