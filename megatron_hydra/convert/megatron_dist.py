"""Reading Megatron-Core's ``torch_dist`` checkpoints: torch DCP with Megatron's key scheme.

A ``torch_dist`` directory (``iter_NNNNNNN/`` of Megatron-LM) holds DCP's ``.metadata`` and
``__<rank>_<n>.distcp`` files, ``metadata.json`` (``"sharded_backend": "torch_dist"``) and
``common.pt``: what is not sharded (Megatron-LM's ``args``, ``iteration``, the optimizer's param
groups and step count). Every tensor is stored whole-shaped: its logical (unsharded) shape, as
the rectangles each rank saved, so any rectangle of it reads back exactly, whatever TP and PP
wrote it. Layers are stacked (``decoder.layers.<name>``, the layer the first dim) or, when saved
per layer, ``decoder.layers.<i>.<name>`` (``megatron_names``).

Only tensor entries are ever read; the byte entries beside them (the layers' ``_extra_state``,
random states, pickled objects) are never unpickled. The metadata is read once, with
``safe_reader``'s allowlist plus the classes Megatron-Core's planner adds (its saved plans and
the descriptors of byte entries), and reused for every read, each of which brings in one
rectangle (one layer's tensor) through DCP's own resharding reads. Every data file is opened
without following a link and checked to be a regular file on the open descriptor.

The optimizer, where saved in model space, is ``optimizer.state.<kind>.<model key>`` with the
model tensor's shape and layout: ``exp_avg``, ``exp_avg_sq`` and the fp32 main weights
(``fp32_param`` of the plain optimizer of a 16-bit model, ``param`` of the distributed
optimizer's ``fully_reshardable`` format); the step count is in ``common.pt``. The distributed
optimizer's other formats are not carried (``optimizer_layout`` says why): ``dp_reshardable``
and the bucket formats store flat per-rank ranges laid out as Megatron's gradient buffers (their
order follows its bucketing of that version); ``fully_sharded_model_space`` is keyed by model
tensor but stores each saving rank's flattened range of its TP shard (Megatron-Core's N-D
flattened layout: the shards counted in the leading dims, their elements flat in the last), a
shape that follows the saving run's TP split and bucketing, not the model tensor's.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from megatron_hydra import untrusted
from megatron_hydra.checkpoint import safe_reader
from megatron_hydra.checkpoint.chunks import Chunks
from megatron_hydra.checkpoint.safe_reader import TensorOnlyPlanner
from megatron_hydra.checkpoint.standalone import one_process
from megatron_hydra.convert import megatron_pickle
from megatron_hydra.convert.megatron_names import DECODER_LAYERS, LOCAL_NORMS, VOCAB, Part, ignorable
from megatron_hydra.errors import CheckpointError

METADATA_JSON = "metadata.json"
COMMON = "common.pt"
OPTIMIZER_PREFIX = "optimizer."
STATE_PREFIX = OPTIMIZER_PREFIX + "state."
METADATA_BYTES = 1024 * untrusted.MiB  # .metadata lists every saved chunk and plan of every rank
# What Megatron-Core's torch_dist metadata holds beyond ours: its saved plans and byte entries.
DCP_EXTRA = {
    "torch.distributed.checkpoint.metadata": frozenset({"BytesStorageMetadata"}),
    "torch.distributed.checkpoint.planner": frozenset({"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"}),
}
# The distributed optimizer's formats that store flat buckets rather than model-space tensors.
BUCKET_FORMATS = ("dp_reshardable", "fully_sharded_bucket_space", "dp_zero_gather_scatter")
FLATTENED_FORMAT = "fully_sharded_model_space"


def is_dist(path: str) -> bool:
    return os.path.isfile(os.path.join(path, METADATA_JSON)) and os.path.isfile(os.path.join(path, ".metadata"))


class _RegularFiles(FileSystem):
    """DCP's file system, opening each data file without following a link, checked on the open
    descriptor (a file swapped for a link after ``open_dist`` checked it is refused)."""

    @contextmanager
    def create_stream(self, path, mode: str):
        if mode != "rb":
            raise ValueError(f"{path}: a Megatron checkpoint is only read here")
        with os.fdopen(megatron_pickle.open_checked(str(path)), "rb") as stream:
            yield stream


class _Reader(dcp.FileSystemReader):
    """DCP's file reader over metadata read once, with the allowlist, and regular files only."""

    def __init__(self, path: str, metadata: Metadata):
        super().__init__(path)
        self.fs = _RegularFiles()
        self._metadata = metadata

    def read_metadata(self, *args, **kwargs) -> Metadata:
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


@dataclass
class DistCheckpoint:
    """An opened ``torch_dist`` directory: its tensors' metadata and its common state."""

    path: str
    metadata: Metadata
    common: Dict[str, Any]
    tensors: Dict[str, TensorStorageMetadata] = field(init=False)

    def __post_init__(self) -> None:
        self.tensors = {k: v for k, v in self.metadata.state_dict_metadata.items()
                        if isinstance(v, TensorStorageMetadata)}

    def shape(self, key: str) -> Optional[Tuple[int, ...]]:
        md = self.tensors.get(key)
        return None if md is None else tuple(md.size)

    def dtype(self, key: str) -> torch.dtype:
        return self.tensors[key].properties.dtype

    def read(self, key: str, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
        """The rectangle ``offsets`` + ``sizes`` of the stored tensor ``key``, in its stored dtype."""
        out = torch.empty(tuple(sizes), dtype=self.dtype(key))
        try:
            with one_process():
                dcp.load({key: Chunks(self.shape(key), [(tuple(offsets), out)])},
                         storage_reader=_Reader(self.path, self.metadata), planner=TensorOnlyPlanner(), no_dist=True)
        except CheckpointException as e:  # the failure itself (a refused file: one line), not DCP's wrapper
            raise safe_reader.dcp_failure(e) from None
        return out


def open_dist(path: str) -> DistCheckpoint:
    """The ``torch_dist`` checkpoint directory ``path``, its metadata and ``common.pt`` read as data."""
    info = untrusted.load_json(os.path.join(path, METADATA_JSON), untrusted.MiB, "Megatron checkpoint metadata",
                               CheckpointError)
    backend = info.get("sharded_backend") if isinstance(info, dict) else None
    if backend != "torch_dist":
        raise CheckpointError(f"{path}/{METADATA_JSON}: sharded_backend is {str(backend)[:40]!r}; only Megatron-Core's "
                              "torch_dist format is read (re-save it with --ckpt-format torch_dist)")
    metadata = safe_reader.read_metadata(path, DCP_EXTRA, (TensorStorageMetadata, BytesStorageMetadata),
                                         "Megatron-Core's torch_dist", METADATA_BYTES)
    for rel in sorted({str(info.relative_path) for info in (metadata.storage_data or {}).values()}):
        megatron_pickle.regular(os.path.join(path, rel))  # a link could make DCP read any file here
    common_file = os.path.join(path, COMMON)
    common = megatron_pickle.load(common_file, megatron_pickle.COMMON_BYTES) if os.path.lexists(common_file) else {}
    if not isinstance(common, dict):
        raise CheckpointError(f"{common_file}: holds a {type(common).__name__}, not Megatron's common state: refused")
    return DistCheckpoint(path, metadata, common)


def source_key(ck: DistCheckpoint, part: Part, prefix: str = "") -> Tuple[str, Optional[int]]:
    """The stored key holding ``part`` (under ``prefix``: an optimizer state's) and, for a stacked
    layer tensor, the index of its layer in the first dim (None: the key is that tensor alone)."""
    if part.layer is None:
        return prefix + part.key, None
    names = [part.key, *(old for old, new in LOCAL_NORMS.items() if new == part.key)]
    for name in names:
        if ck.shape(f"{prefix}{DECODER_LAYERS}{name}") is not None:
            return f"{prefix}{DECODER_LAYERS}{name}", part.layer
        if ck.shape(f"{prefix}{DECODER_LAYERS}{part.layer}.{name}") is not None:
            return f"{prefix}{DECODER_LAYERS}{part.layer}.{name}", None
    return f"{prefix}{DECODER_LAYERS}{part.key}", part.layer


def unused(ck: DistCheckpoint, parts: Sequence[Part], tied: bool) -> List[str]:
    """The model tensors of ``ck`` (outside ``optimizer.*``) that none of ``parts`` reads, except
    those a model leaves behind by design (``megatron_names.ignorable``)."""
    used = {source_key(ck, part)[0] for part in parts}
    return [k for k in ck.tensors if not k.startswith(OPTIMIZER_PREFIX) and k not in used and not ignorable(k, tied)]


def region(ck: DistCheckpoint, part: Part, shape: Sequence[int], prefix: str = "") -> Tuple[str, List[int], List[int]]:
    """Where our tensor of ``shape`` is: (stored key, offsets, sizes) of its rectangle, checked to
    lie in the stored tensor. ``shape`` is ours: a vocabulary table's real rows, one half of a
    fused fc1."""
    key, layer = source_key(ck, part, prefix)
    stored = ck.shape(key)
    if stored is None:
        raise CheckpointError(f"{ck.path}: has no tensor {key}, which this model needs: the checkpoint does not match "
                              "its arguments (or is of another model kind)")
    inner = stored[1:] if layer is not None else stored
    offsets = [0] * len(inner)
    rows = inner[0] if inner else 0
    if part.half is not None:
        offsets[0] = part.half * rows // 2
        rows //= 2
    expected = list(shape)
    fits = len(inner) == len(expected) and (
        expected[0] <= rows if part.key in VOCAB else expected[0] == rows) and list(inner[1:]) == expected[1:]
    if layer is not None and not 0 <= layer < stored[0]:
        fits = False
    if not fits:
        raise CheckpointError(f"{ck.path}: tensor {key} is {list(stored)}, which does not hold our {part} of shape "
                              f"{expected}: the checkpoint does not match its arguments")
    if layer is not None:
        return key, [layer, *offsets], [1, *expected]
    return key, offsets, expected


def read_part(ck: DistCheckpoint, part: Part, shape: Sequence[int], prefix: str = "") -> torch.Tensor:
    key, offsets, sizes = region(ck, part, shape, prefix)
    return ck.read(key, offsets, sizes).reshape(tuple(shape))


def _find(tree: Any, key: str, depth: int = 0) -> List[Any]:
    """Every value under ``key`` in nested dicts and lists of ``tree`` (bounded depth)."""
    if depth > 8:
        return []
    if isinstance(tree, dict):
        found = [tree[key]] if key in tree else []
        return found + [v for value in tree.values() for v in _find(value, key, depth + 1)]
    if isinstance(tree, (list, tuple)):
        return [v for value in tree for v in _find(value, key, depth + 1)]
    return []


def _as_int(value: Any) -> Optional[int]:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def optimizer_step(common: Dict[str, Any]) -> Optional[int]:
    """Adam's step count in ``common.pt``: the plain optimizer's ``common_step``, or the
    distributed optimizer's per param group ``step``; None when absent or not one number."""
    optimizer = common.get("optimizer")
    steps = _find(optimizer, "common_step") or [g.get("step") for groups in _find(optimizer, "param_groups")
                                                 if isinstance(groups, list) for g in groups if isinstance(g, dict)]
    counts = {_as_int(s) for s in steps}
    return counts.pop() if len(counts) == 1 and None not in counts else None


def optimizer_layout(ck: DistCheckpoint) -> Tuple[Optional[str], str]:
    """``(main weights' kind or "", "")`` when the optimizer is stored in model space (its
    moments per model tensor), else ``(None, why not)``."""
    keys = ck.tensors
    formats = {f for name in ("param_state_sharding_type", "distrib_optim_sharding_type")
               for f in _find(ck.common, name) if isinstance(f, str)}
    bucketed = any(k.startswith(OPTIMIZER_PREFIX + "distributed.") for k in ck.metadata.state_dict_metadata)
    fix = "save it with --dist-ckpt-optim-fully-reshardable to carry it"
    if formats & set(BUCKET_FORMATS) or bucketed:
        shown = ", ".join(sorted(formats & set(BUCKET_FORMATS))) or "dp_reshardable"
        return None, (f"its distributed optimizer state is stored as flat per-rank ranges ({shown}), laid out as "
                      f"Megatron's gradient buffers: not carried ({fix})")
    if FLATTENED_FORMAT in formats:
        return None, (f"its distributed optimizer state ({FLATTENED_FORMAT}) is keyed by model tensor but stored as "
                      "each saving rank's flattened range of its TP shard, a shape set by that run's TP split and "
                      f"gradient buckets rather than the model tensor's: not carried ({fix})")
    if not any(k.startswith(STATE_PREFIX + "exp_avg.") for k in keys):
        return None, "it holds no optimizer state"
    if optimizer_step(ck.common) is None:
        return None, "its optimizer step count is missing from common.pt"
    for main in ("fp32_param", "param"):
        if any(k.startswith(f"{STATE_PREFIX}{main}.") for k in keys):
            return main, ""
    return "", ""
