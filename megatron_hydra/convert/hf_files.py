"""Reading and writing a Hugging Face model directory: ``config.json`` plus weights.

Weights are read from ``model.safetensors``, a sharded ``model.safetensors.index.json``, or the
older ``pytorch_model.bin`` (and its index), loaded with ``weights_only`` so that a file can never
run code. They are written as safetensors, split into shards with an index once a model passes
``max_shard_bytes``, which is what ``from_pretrained`` expects of a large model.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List

import torch

from megatron_hydra.errors import CheckpointError

CONFIG = "config.json"
SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
PT_BIN, PT_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
DEFAULT_SHARD_BYTES = 5 * 1024**3


def read_config(directory: str) -> dict:
    path = os.path.join(directory, CONFIG)
    if not os.path.isdir(directory):
        raise CheckpointError(f"input={directory}: no such directory; give a local Hugging Face model directory")
    if not os.path.isfile(path):
        raise CheckpointError(f"input={directory} has no {CONFIG}: give a Hugging Face model directory "
                              "(as written by save_pretrained)")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e})") from None


def _load_file(path: str) -> Dict[str, torch.Tensor]:
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    return torch.load(path, map_location="cpu", weights_only=True)


def _shard_files(directory: str, index_name: str) -> List[str]:
    with open(os.path.join(directory, index_name)) as f:
        weight_map = json.load(f)["weight_map"]
    files = sorted(set(weight_map.values()))
    for name in files:
        if not os.path.isfile(os.path.join(directory, name)):
            raise CheckpointError(f"{os.path.join(directory, index_name)} names {name}, which is missing: "
                                  "copy the whole model directory")
    return [os.path.join(directory, name) for name in files]


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
