"""Reading Megatron-LM's legacy per-rank checkpoints (``--ckpt-format torch``).

``iter_NNNNNNN/mp_rank_TT/model_optim_rng.pt`` (``mp_rank_TT_PPP`` under pipeline parallelism)
holds, for tensor-parallel rank TT of pipeline stage PPP, Megatron-LM's ``state_dict``: ``model``
(``model0``, ``model1``, ... with virtual pipeline stages), ``args``, ``iteration``,
``checkpoint_version``, ``rng_state`` and, unless saved without it, ``optimizer``. Each file is a
pickle read as data (``megatron_pickle``), its tensors memory-mapped: a tensor is read from disk
only when the converted checkpoint's writer asks for it.

Each file numbers its stage's layers from 0. Megatron assigns layers to stages in order: virtual
stage v of pipeline rank r is global stage ``v * pp + r``, holding the layers after those of every
earlier global stage. Counting the layers each file holds gives every stage's offset exactly,
whatever split the run used (even, uneven first or last stage, an explicit layout).

The optimizer state of this format is not carried: Adam's state is keyed by the parameter's index
in Megatron's param groups, an order set by that version's weight-decay and learning-rate group
rules (and, with the distributed optimizer, ``distrib_optim.pt`` holds flat per-rank buckets in
gradient-buffer order). Mapping either would rest on rules the file does not record.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

import torch

from megatron_hydra.convert import megatron_pickle
from megatron_hydra.convert.megatron_names import EXTRA_STATE, VOCAB, Part, ignorable, split_layer
from megatron_hydra.errors import CheckpointError

FILE = "model_optim_rng.pt"
RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?$")
MODEL_CHUNK = re.compile(r"^model(\d+)$")
OPTIMIZER_NOT_CARRIED = ("the legacy format keys Adam's state by parameter index in Megatron's param groups (and "
                         "the distributed optimizer's distrib_optim.pt by flat gradient buckets), an order the file "
                         "does not record: not carried (save with --ckpt-format torch_dist to carry it)")


def is_legacy(path: str) -> bool:
    return os.path.isdir(path) and any(RANK_DIR.match(n) for n in os.listdir(path))


def rank_dirs(path: str) -> Dict[Tuple[int, int], str]:
    """``{(tp rank, pp rank): directory}`` of the legacy iteration directory ``path``, checked to be
    a whole tp x pp grid (expert-parallel files, ``_EEE``, are MoE: refused by name)."""
    found = {}
    for name in sorted(os.listdir(path)):
        if name.startswith("mp_rank_") and not RANK_DIR.match(name):
            raise CheckpointError(f"{path}/{name}: not a tensor/pipeline rank directory of a dense GPT model "
                                  "(expert-parallel files are MoE, which is not imported)")
        match = RANK_DIR.match(name)
        if match and os.path.islink(os.path.join(path, name)):
            raise CheckpointError(f"{path}/{name}: is a symbolic link, which no Megatron checkpoint holds: refused")
        if match:
            rank = int(match.group(1)), int(match.group(2) or 0)
            if rank in found:
                raise CheckpointError(f"{path}: both {os.path.basename(found[rank])} and {name} hold tensor rank "
                                      f"{rank[0]}, pipeline rank {rank[1]}: two saves are mixed in one directory; "
                                      "keep the one that matches the arguments")
            found[rank] = os.path.join(path, name)
    tp = 1 + max(t for t, _ in found)
    pp = 1 + max(p for _, p in found)
    missing = [(t, p) for t in range(tp) for p in range(pp) if (t, p) not in found]
    if missing:
        t, p = missing[0]
        raise CheckpointError(f"{path}: the files of tensor rank {t}, pipeline rank {p} are missing "
                              f"({len(found)} of {tp} x {pp}): the checkpoint is incomplete")
    return found


def _chunks(state: Dict[str, Any], file: str) -> List[Dict[str, torch.Tensor]]:
    """The model chunks a file holds: ``model`` or, with virtual pipeline stages, ``model0``,
    ``model1``, ... (every one of them: a gap would shift the layers of every later chunk)."""
    numbered = sorted(int(m.group(1)) for m in map(MODEL_CHUNK.match, map(str, state)) if m)
    if "model" in state and numbered:
        raise CheckpointError(f"{file}: holds both 'model' and 'model{numbered[0]}': not one Megatron-LM save; "
                              "refused")
    if numbered != list(range(len(numbered))):
        missing = min(set(range(numbered[-1] + 1)) - set(numbered))
        raise CheckpointError(f"{file}: holds model chunks {', '.join(f'model{v}' for v in numbered)} but no "
                              f"model{missing}: the virtual pipeline stages are incomplete; refused")
    chunks = [state["model"]] if "model" in state else [state[f"model{v}"] for v in numbered]
    if not chunks or not all(isinstance(c, dict) for c in chunks):
        raise CheckpointError(f"{file}: holds no model state dict: not a Megatron-LM checkpoint file")
    if any(str(k) == "language_model" or str(k).startswith("language_model.") for c in chunks for k in c):
        raise CheckpointError(f"{file}: holds a pre-Megatron-Core model (language_model.* keys: Megatron-LM's legacy "
                              "models, --use-legacy-models): only Megatron-Core GPT checkpoints import; convert it "
                              "with Megatron-LM's tools/checkpoint/convert.py to the Megatron-Core format first")
    return [{k: v for k, v in c.items() if isinstance(v, torch.Tensor) and not str(k).endswith(EXTRA_STATE)}
            for c in chunks]


@dataclass
class LegacyCheckpoint:
    """The files of one legacy iteration, opened: ``chunks[(tp, pp)][v]`` a model chunk's tensors,
    ``offsets[(pp, v)]`` the global index of its first layer."""

    path: str
    tp: int
    pp: int
    first: Dict[str, Any]  # rank (0, 0)'s whole state dict: args, iteration, ...
    first_file: str
    chunks: Dict[Tuple[int, int], List[Dict[str, torch.Tensor]]]
    offsets: Dict[Tuple[int, int], int]
    layers: int

    @property
    def has_optimizer(self) -> bool:
        return self.first.get("optimizer") is not None or any(
            os.path.exists(os.path.join(self.path, name, "distrib_optim.pt")) for name in os.listdir(self.path))

    def unused(self, parts: List[Part], tied: bool) -> List[str]:
        """The tensors of the files that none of ``parts`` reads (``megatron_names.ignorable``
        aside), each named with the pipeline rank and chunk holding it."""
        used = {self._where(part) for part in parts}
        held = {(p, v, key) for (_, p), chunks in self.chunks.items()
                for v, chunk in enumerate(chunks) for key in chunk}
        return [f"{key} (pipeline rank {p}, model chunk {v})" for p, v, key in sorted(held - used)
                if not ignorable(key, tied)]

    def _stage(self, layer: int) -> Tuple[int, int, int]:
        """(pp rank, virtual stage, local index) holding the global ``layer``."""
        for (p, v), start in self.offsets.items():
            count = _layer_count(self.chunks[0, p][v])
            if start <= layer < start + count:
                return p, v, layer - start
        raise CheckpointError(f"{self.path}: holds no layer {layer} ({self.layers} layers): the checkpoint does not "
                              "match its arguments")

    def _where(self, part: Part) -> Tuple[int, int, str]:
        if part.layer is not None:
            p, v, i = self._stage(part.layer)
            return p, v, _local_key(self.chunks[0, p][v], i, part.key)
        last = (self.pp - 1, len(self.chunks[0, self.pp - 1]) - 1)
        first = (0, 0)
        p, v = first if part.key.startswith("embedding.") else last
        return p, v, part.key

    def dtype(self, part: Part) -> torch.dtype:
        p, v, key = self._where(part)
        if key not in self.chunks[0, p][v]:
            raise CheckpointError(f"{self.path}: the files of pipeline rank {p} have no {key}: the checkpoint "
                                  "does not match its arguments")
        return self.chunks[0, p][v][key].dtype

    def read(self, part: Part, shape: List[int]) -> torch.Tensor:
        """Our tensor of ``shape`` that ``part`` names, merged from the tensor-parallel shards."""
        p, v, key = self._where(part)
        shards = []
        for t in range(self.tp if part.tp_dim is not None else 1):
            shard = self.chunks[t, p][v].get(key)
            if shard is None:
                raise CheckpointError(f"{self.path}: the files of pipeline rank {p} have no {key}: the checkpoint "
                                      "does not match its arguments")
            if part.half is not None:
                shard = shard.chunk(2, dim=0)[part.half]  # this rank's [gate_r; up_r]
            shards.append(shard)
        whole = torch.cat(shards, dim=part.tp_dim) if len(shards) > 1 else shards[0]
        if part.key in VOCAB and whole.shape[0] >= shape[0]:
            whole = whole[:shape[0]]
        if list(whole.shape) != list(shape):
            raise CheckpointError(f"{self.path}: {key} merges to {list(whole.shape)} over {self.tp} tensor ranks, "
                                  f"not our {list(shape)}: the checkpoint does not match its arguments")
        return whole.contiguous()


def _layer_count(chunk: Dict[str, torch.Tensor]) -> int:
    return len({split[0] for split in map(split_layer, chunk) if split is not None})


def _local_key(chunk: Dict[str, torch.Tensor], index: int, name: str) -> str:
    """The key of layer ``index``'s tensor ``name`` (canonical) in a chunk: either spelling of the norms."""
    for key in chunk:
        split = split_layer(key)
        if split == (index, name):
            return key
    return f"decoder.layers.{index}.{name}"


def open_legacy(path: str) -> LegacyCheckpoint:
    """The legacy iteration directory ``path``, every rank's file opened (memory-mapped)."""
    dirs = rank_dirs(path)
    tp, pp = 1 + max(t for t, _ in dirs), 1 + max(p for _, p in dirs)
    states = {rank: megatron_pickle.load(os.path.join(d, FILE)) for rank, d in dirs.items()}
    for rank, state in states.items():
        if not isinstance(state, dict):
            raise CheckpointError(f"{dirs[rank]}/{FILE}: holds a {type(state).__name__}, not a state dict: refused")
    chunks = {rank: _chunks(state, os.path.join(dirs[rank], FILE)) for rank, state in states.items()}
    vpp = len(chunks[0, 0])
    if any(len(c) != vpp for c in chunks.values()):
        raise CheckpointError(f"{path}: its files hold different numbers of model chunks: the checkpoint is damaged")
    offsets, start = {}, 0
    for v in range(vpp):
        for p in range(pp):
            offsets[p, v] = start
            start += _layer_count(chunks[0, p][v])
    return LegacyCheckpoint(path, tp, pp, states[0, 0], os.path.join(dirs[0, 0], FILE), chunks, offsets, start)
