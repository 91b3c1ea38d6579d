"""What every family's mapping shares: the fused attention layouts, and checked views of a
Hugging Face ``config.json`` and state dict.

Our attention keeps one fused QKV weight laid out per query group as [q heads of the group, k, v]
(``models.transformer.Attention``), so that a TP rank's contiguous slice holds whole groups; T5's
cross-attention fuses [k, v] per group the same way. Hugging Face keeps q, k and v as blocks
(Llama, BERT, T5: separate projections; GPT-2: one fused c_attn whose output is
[all q | all k | all v]). ``fuse_qkv`` / ``split_qkv`` and ``fuse_kv`` / ``split_kv`` move between
the two; each pair is exact inverses (pure reshapes and concatenations).
"""

from __future__ import annotations

import json
import math
from typing import List, Mapping, Optional, Sequence, Tuple

import torch

from megatron_hydra.config.transformer_config import TransformerConfig
from megatron_hydra.errors import CheckpointError, ConfigError


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: TransformerConfig) -> torch.Tensor:
    """[heads*d, ...], [groups*d, ...], [groups*d, ...] -> our [groups*(heads_per_group+2)*d, ...]."""
    g, d = cfg.num_query_groups, cfg.kv_channels
    rest = q.shape[1:]
    parts = [q.reshape(g, -1, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, cfg: TransformerConfig) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of ``fuse_qkv``: our fused tensor -> q [heads*d, ...], k, v [groups*d, ...]."""
    g, d = cfg.num_query_groups, cfg.kv_channels
    hpg = cfg.num_attention_heads // g
    rest = qkv.shape[1:]
    q, k, v = qkv.reshape(g, (hpg + 2) * d, *rest).split([hpg * d, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def fuse_kv(k: torch.Tensor, v: torch.Tensor, cfg: TransformerConfig) -> torch.Tensor:
    """[groups*d, ...] twice -> our [groups*2*d, ...], [k, v] per query group."""
    g, d = cfg.num_query_groups, cfg.kv_channels
    rest = k.shape[1:]
    return torch.cat([k.reshape(g, d, *rest), v.reshape(g, d, *rest)], dim=1).reshape(-1, *rest)


def split_kv(kv: torch.Tensor, cfg: TransformerConfig) -> Tuple[torch.Tensor, torch.Tensor]:
    """Inverse of ``fuse_kv``."""
    g, d = cfg.num_query_groups, cfg.kv_channels
    rest = kv.shape[1:]
    pairs = kv.reshape(g, 2, d, *rest)
    return pairs[:, 0].reshape(-1, *rest), pairs[:, 1].reshape(-1, *rest)


_REQUIRED = object()
_KINDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string", dict: "an object",
          list: "a list"}


class HFConfig(dict):
    """A ``config.json`` whose values are checked where they are read: a missing key, a value of
    the wrong type, or a number that is not finite (JSON's ``NaN`` and ``Infinity``, which Python's
    parser accepts) is one ``CheckpointError`` naming the file and the key, not a ``KeyError``, a
    ``TypeError`` deep in model building, or a model that trains on NaN."""

    def __init__(self, values: dict, path: str):
        super().__init__(values)
        self.path = path

    def value(self, key: str, kind: type, default=_REQUIRED):
        """``self[key]`` if it is a ``kind``; ``default`` when it is absent or null (as Hugging Face
        writes an unset optional value), and an error when there is no default."""
        v = self.get(key)
        if v is None:
            if default is _REQUIRED:
                raise CheckpointError(f"{self.path} has no {key!r}, which a {self.get('model_type')} config needs: "
                                      "the file is incomplete; copy it again")
            return default
        if kind is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)  # an integer written where a number is meant (1e6 as 1000000)
        if not isinstance(v, kind) or (isinstance(v, bool) and kind is not bool):
            raise CheckpointError(f"{self.path}: {key}={json.dumps(v)} should be {_KINDS[kind]}: fix the value "
                                  "or copy the file again")
        if kind is float and not math.isfinite(v):  # JSON's NaN / Infinity, or 1e999
            raise CheckpointError(f"{self.path}: {key}={json.dumps(v)} is not a finite number: fix the value or "
                                  "copy the file again")
        return v

    def unsupported(self, key: str, value, supported: str) -> ConfigError:
        """The one line for a value of this file that no model of ours computes: the file, the key,
        the value, and what is supported."""
        shown = repr(value) if isinstance(value, str) else json.dumps(value)
        shown = shown if len(shown) <= 200 else shown[:200] + "..."  # a file is anyone's: keep the line short
        return ConfigError(f"{self.path}: {key}={shown} is not supported: {supported}")


class HFWeights:
    """A Hugging Face state dict that hands out each tensor once, after checking its shape, so a
    config.json that does not match its weights fails in one line naming the tensor. ``shapes``
    (every tensor's shape, by name) lets ``check`` run before any tensor is read: ``tensors`` may
    read lazily (``hf_files.WeightFiles``)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], source: str,
                 shapes: Optional[Mapping[str, Sequence[int]]] = None):
        self.tensors, self.source, self.used = tensors, source, set()
        self.shapes = shapes if shapes is not None else {n: list(t.shape) for n, t in tensors.items()}

    def __contains__(self, name: str) -> bool:
        return name in self.shapes

    def check(self, name: str, shape: Sequence[int]) -> None:
        """Tensor ``name`` exists with ``shape``; nothing is read."""
        if name not in self.shapes:
            raise CheckpointError(f"input={self.source} has no tensor {name}, which its config.json implies: "
                                  "the weights and config.json do not belong together")
        if list(self.shapes[name]) != list(shape):
            raise CheckpointError(f"input={self.source}: tensor {name} has shape {list(self.shapes[name])} but "
                                  f"config.json implies {list(shape)}: the weights and config.json do not belong "
                                  "together")

    def take(self, name: str, shape: Sequence[int]) -> torch.Tensor:
        self.check(name, shape)
        self.used.add(name)
        return self.tensors[name]

    def unused(self, ignore: Tuple[str, ...] = (), used: Optional[set] = None) -> List[str]:
        used = self.used if used is None else used
        return sorted(n for n in self.shapes if n not in used and not n.endswith(ignore))
