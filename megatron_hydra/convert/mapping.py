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
    ``TypeError`` deep in model building, or a model that trains on NaN. An object inside the file
    (``part``) names its keys by their place in it (``rope_parameters.full_attention.factor``)."""

    def __init__(self, values: dict, path: str, where: str = ""):
        super().__init__(values)
        self.path, self.where, self.model_type = path, where, values.get("model_type")

    def part(self, key: str, where: Optional[str] = None) -> "HFConfig":
        """The object at ``key`` (an empty one when absent or null), checked like the file; its
        keys named ``where`` + name in messages (default: ``key.`` + name)."""
        part = HFConfig(self.value(key, dict, {}), self.path, f"{self.where}{key}." if where is None else where)
        part.model_type = self.model_type
        return part

    def count(self, key: str, default=_REQUIRED, least: int = 1) -> int:
        """``self.value(key, int, default)``, at least ``least``: a count or size of the model
        (layers, heads, positions), which a zero or a negative number would turn into a division
        by zero or an empty model further on."""
        v = self.value(key, int, default)
        if v is not None and v < least:
            raise self.unsupported(key, v, f"an integer >= {least} is")
        return v

    def value(self, key: str, kind: type, default=_REQUIRED):
        """``self[key]`` if it is a ``kind``; ``default`` when it is absent or null (as Hugging Face
        writes an unset optional value), and an error when there is no default."""
        v, name = self.get(key), self.where + key
        if v is None:
            if default is _REQUIRED:
                raise CheckpointError(f"{self.path} has no {name!r}, which a {self.model_type} config needs: the "
                                      "file is incomplete; copy it again")
            return default
        if kind is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)  # an integer written where a number is meant (1e6 as 1000000)
        if not isinstance(v, kind) or (isinstance(v, bool) and kind is not bool):
            raise CheckpointError(f"{self.path}: {name}={_cut(json.dumps(v))} should be {_KINDS[kind]}: fix the "
                                  "value or copy the file again")
        if kind is float and not math.isfinite(v):  # JSON's NaN / Infinity, or 1e999
            raise CheckpointError(f"{self.path}: {name}={_cut(json.dumps(v))} is not a finite number: fix the "
                                  "value or copy the file again")
        return v

    def unsupported(self, key: str, value, supported: str) -> ConfigError:
        """The one line for a value of this file that no model of ours computes: the file, the key,
        the value, and what is supported."""
        shown = _cut(repr(value) if isinstance(value, str) else json.dumps(value))
        return ConfigError(f"{self.path}: {self.where}{key}={shown} is not supported: {supported}")


def _cut(shown: str) -> str:
    """A value of a file as one line shows it: cut short, since a file is anyone's and its values
    may be megabytes long."""
    return shown if len(shown) <= 200 else shown[:200] + "..."


class HFWeights:
    """A Hugging Face state dict that hands out each tensor once, after checking its shape, so a
    config.json that does not match its weights fails in one line naming the tensor. ``shapes``
    and ``dtypes`` (every tensor's, by name) let ``check`` and the import's plan run before any
    tensor is read: ``tensors`` may read lazily (``hf_files.WeightFiles``, which has both)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], source: str,
                 shapes: Optional[Mapping[str, Sequence[int]]] = None,
                 dtypes: Optional[Mapping[str, torch.dtype]] = None):
        self.tensors, self.source, self.used = tensors, source, set()
        self.shapes = shapes if shapes is not None else {n: list(t.shape) for n, t in tensors.items()}
        self.dtypes = dtypes if dtypes is not None else {n: t.dtype for n, t in tensors.items()}

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
