"""Conversion one tensor at a time, into a directory that appears only once it is complete.

A whole-model conversion needs the model's size in memory twice over; an 8B model in bf16 is
16 GB, and the machines people convert on have 24 GiB or less. So both directions walk the
family's name map (``convert.name_map``) rule instance by rule instance:

- import: each of our logical tensors becomes a ``LazyTensor`` whose shape and dtype come from
  the Hugging Face headers through the rule's transform on the meta device, and which reads its
  source tensors (a fused QKV: q, k and v of one layer) only when the checkpoint writer reaches
  it. Tensors keep the dtype of their files: loading casts into a run's own.
- export: each of our logical tensors is read from the checkpoint (a few at a time), sent through
  the transform's inverse and written into its planned place in the safetensors shards
  (``hf_files.ShardWriter``).

Every name, shape and count is checked before the first tensor is read, as the whole-model walk
(``name_map.import_weights`` / ``export_weights``) checks them, with the same messages.

``staged`` makes the result atomic: everything is written into a hidden sibling directory that is
renamed to the output at the end, and removed on any failure, so a failed conversion leaves no
partial output directory behind.
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, List, Mapping, Tuple

import torch

from megatron_hydra.checkpoint.lazy_write import LazyTensor
from megatron_hydra.config.transformer_config import TransformerConfig
from megatron_hydra.convert.mapping import HFWeights
from megatron_hydra.convert.name_map import NameMap, Rule, _their_name, _their_shapes
from megatron_hydra.errors import CheckpointError, ConfigError


@contextmanager
def staged(output: str) -> Iterator[str]:
    """A new empty directory beside ``output`` to write into; renamed to ``output`` when the block
    ends, removed with its content when it raises. ``output`` must not exist or be an empty
    directory. A system error (a full disk) becomes one line naming ``output`` and the reason."""
    output = os.path.abspath(output)
    parent = os.path.dirname(output)
    os.makedirs(parent, exist_ok=True)
    stage = os.path.join(parent, f".{os.path.basename(output)}.{uuid.uuid4().hex[:12]}.partial")
    os.mkdir(stage)  # not mkdtemp: the output keeps the usual permissions, not 0700
    try:
        yield stage
        if os.path.isdir(output) and not os.path.islink(output):
            os.rmdir(output)  # empty, as the caller checked; rmdir refuses anything else
        os.replace(stage, output)
    except BaseException as e:
        shutil.rmtree(stage, ignore_errors=True)
        if isinstance(e, OSError) and e.strerror:
            full = e.errno in (errno.ENOSPC, errno.EDQUOT)
            fix = "free space there or write elsewhere" if full else "fix that and run again"
            where = f": {e.filename}" if e.filename else ""
            raise CheckpointError(f"output={output}: writing failed ({e.strerror}{where}); nothing was written: "
                                  f"{fix}") from None
        raise


def import_tensors(name_map: NameMap, weights: HFWeights, cfg: TransformerConfig, shapes: Mapping[str, List[int]],
                   dtypes: Mapping[str, torch.dtype], order: Callable[[str], int]) -> Dict[str, LazyTensor]:
    """Our logical tensors (the model's ``shapes``, vocabulary unpadded) as ``LazyTensor``s that
    read the Hugging Face files ``weights`` when made; ``dtypes`` are the files' dtypes by
    Hugging Face name. Every tensor of the model must come from the table and every tensor of
    the files go into it (``name_map.ignored`` aside); a tied copy is checked, then left. The
    tensors are ordered by ``order(hf_name)`` of their sources (the file they are in), so that
    the writer reads each file once, in turn."""
    source, hf = weights.source, _their_name(name_map, weights)
    out: Dict[str, Tuple[tuple, LazyTensor]] = {}
    used = set()
    for rule in name_map.rules:
        for ours, theirs in rule.instances(cfg):
            if ours not in shapes:
                raise CheckpointError(f"input={source}: converted tensor {ours} has no place in the model")
            names = [hf(name) for name in theirs]
            expected = _their_shapes(rule, ours, shapes, cfg)
            present = [(n, s) for n, s in zip(names, expected) if not rule.tied or n in weights]
            for name, shape in present:
                weights.check(name, shape)
                used.add(name)
            if rule.tied:
                continue
            made = rule.transform.to_ours(*(torch.empty(s, dtype=dtypes[n], device="meta") for n, s in present), cfg)
            key = tuple(sorted(order(n) for n in names))
            out[ours] = key, LazyTensor(tuple(shapes[ours]), made.dtype, _reader(rule, present, weights, cfg))
    missing = [name for name in shapes if name not in out]
    if missing:
        raise CheckpointError(f"input={source}: nothing maps to our tensor {missing[0]}; this variant of the "
                              "architecture is not supported")
    leftover = weights.unused(name_map.ignored, used=used)
    if leftover:
        raise CheckpointError(f"input={source}: tensor {leftover[0]} has no place in a {name_map.family} model of "
                              "this config; this variant is not supported")
    ranked = sorted(out.items(), key=lambda item: item[1][0])  # stable: the table's order within a file
    return {name: lazy for name, (_, lazy) in ranked}


def _reader(rule: Rule, sources: List[Tuple[str, List[int]]], weights: HFWeights, cfg: TransformerConfig):
    def make() -> torch.Tensor:
        return rule.transform.to_ours(*(weights.take(name, shape) for name, shape in sources), cfg)
    return make


def export_plan(name_map: NameMap, cfg: TransformerConfig, shapes: Mapping[str, List[int]],
                dtypes: Mapping[str, torch.dtype]) -> Tuple[List[Tuple[str, Rule, Tuple[str, ...]]], list]:
    """What an export writes, before any tensor is read: (our name, rule, their names) for each of
    our logical tensors that goes into the files, in the table's order, and (their name, shape,
    dtype) for each Hugging Face tensor, ``dtypes[ours]`` being the dtype it is written in. Tied
    copies are left out, as ``save_pretrained`` leaves them out."""
    steps, specs, used = [], [], set()
    for rule in name_map.rules:
        for ours, theirs in rule.instances(cfg):
            used.add(ours)
            if ours not in shapes:
                raise ConfigError(f"this model has no tensor {ours}, which a Hugging Face {name_map.family} model "
                                  "needs: this variant cannot be exported")
            if rule.tied:
                continue
            steps.append((ours, rule, theirs))
            their_shapes = _their_shapes(rule, ours, shapes, cfg)
            specs += [(name, shape, dtypes[ours]) for name, shape in zip(theirs, their_shapes)]
    extra = sorted(set(shapes) - used)
    if extra:
        raise ConfigError(f"our tensor {extra[0]} has no place in a Hugging Face {name_map.family} model: "
                          "this variant cannot be exported")
    return steps, specs
