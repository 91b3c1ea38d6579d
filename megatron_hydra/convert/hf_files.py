"""Reading and writing a Hugging Face model directory: ``config.json`` plus weights.

Weights are read from ``model.safetensors``, a sharded ``model.safetensors.index.json``, or the
older ``pytorch_model.bin`` (and its index), loaded with ``weights_only`` so that a file can never
run code. They are written as safetensors, split into shards with an index once a model passes
``max_shard_bytes``, which is what ``from_pretrained`` expects of a large model.

The files come from anyone, so every problem with them is one ``CheckpointError`` naming the file:
JSON that does not parse or has the wrong shape, a truncated or damaged weights file, and an index
that names a file outside the model directory (``../../etc/passwd``), which is refused rather than
read. The confinement is by name, not by resolved link, so a Hugging Face cache snapshot, whose
files are links into a sibling ``blobs`` folder, still loads.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List

import torch

from megatron_hydra.convert.mapping import HFConfig
from megatron_hydra.errors import CheckpointError

CONFIG = "config.json"
SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
PT_BIN, PT_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
DEFAULT_SHARD_BYTES = 5 * 1024**3


def _read_json(path: str) -> dict:
    """The JSON object in ``path``."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise CheckpointError(f"{path} is not valid JSON ({e}); copy the file again") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} holds a JSON {type(value).__name__}, not an object; copy the file again")
    return value


def read_config(directory: str) -> HFConfig:
    """``config.json`` of the model directory, its values checked as they are read."""
    path = os.path.join(directory, CONFIG)
    if not os.path.isdir(directory):
        raise CheckpointError(f"input={directory}: no such directory; give a local Hugging Face model directory")
    if not os.path.isfile(path):
        raise CheckpointError(f"input={directory} has no {CONFIG}: give a Hugging Face model directory "
                              "(as written by save_pretrained)")
    return HFConfig(_read_json(path), path)


def _load_file(path: str) -> Dict[str, torch.Tensor]:
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(path)
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # safetensors' SafetensorError, torch's RuntimeError/UnpicklingError/EOFError
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"{path}: not a readable weights file ({why}): it is truncated, damaged or not "
                              "weights; copy it again") from None


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
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index} has no \"weight_map\" object; copy the file again")
    files = sorted({inside(directory, name, index) for name in weight_map.values()})
    for path in files:
        if not os.path.isfile(path):
            raise CheckpointError(f"{index} names {os.path.relpath(path, directory)}, which is missing: "
                                  "copy the whole model directory")
    return files


def read_weights(directory: str) -> Dict[str, torch.Tensor]:
    """Every tensor of the model directory by its Hugging Face name."""
    for single, index in ((SAFETENSORS, SAFETENSORS_INDEX), (PT_BIN, PT_INDEX)):
        if os.path.isfile(os.path.join(directory, single)):
            files = [os.path.join(directory, single)]
        elif os.path.isfile(os.path.join(directory, index)):
            files = _shard_files(directory, index)
        else:
            continue
        tensors: Dict[str, torch.Tensor] = {}
        for path in files:
            tensors.update(_load_file(path))
        return tensors
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
