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
from typing import Dict, List, Sequence, Tuple

import torch

from megatron_hydra.config.transformer_config import TransformerConfig
from megatron_hydra.errors import CheckpointError


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
    """A ``config.json`` whose values are checked where they are read: a missing key or a value of
    the wrong type is one ``CheckpointError`` naming the file and the key, not a ``KeyError`` or a
    ``TypeError`` deep in model building."""

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
            return float(v)
        if not isinstance(v, kind) or (isinstance(v, bool) and kind is not bool):
            raise CheckpointError(f"{self.path}: {key}={json.dumps(v)} should be {_KINDS[kind]}: fix the value "
                                  "or copy the file again")
        return v


class HFWeights:
    """A Hugging Face state dict that hands out each tensor once, after checking its shape, so a
    config.json that does not match its weights fails in one line naming the tensor."""

    def __init__(self, tensors: Dict[str, torch.Tensor], source: str):
        self.tensors, self.source, self.used = tensors, source, set()

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def take(self, name: str, shape: Sequence[int]) -> torch.Tensor:
        if name not in self.tensors:
            raise CheckpointError(f"input={self.source} has no tensor {name}, which its config.json implies: "
                                  "the weights and config.json do not belong together")
        t = self.tensors[name]
        if list(t.shape) != list(shape):
            raise CheckpointError(f"input={self.source}: tensor {name} has shape {list(t.shape)} but config.json "
                                  f"implies {list(shape)}: the weights and config.json do not belong together")
        self.used.add(name)
        return t

    def unused(self, ignore: Tuple[str, ...] = ()) -> List[str]:
        return sorted(n for n in self.tensors if n not in self.used and not n.endswith(ignore))

