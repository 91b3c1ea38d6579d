"""Sharded save and load of a rank's model and AdamW state, in any layout.

Every tensor is stored under its logical name (``model/layers.3.mlp.fc1.weight``,
``optim/layers.3.mlp.fc1.weight/exp_avg``, and for 16-bit models the fp32 main weights
``main/layers.3.mlp.fc1.weight``) with its logical, unsharded shape. The optimizer hands its state
over as whole TP-local tensors (``MegatronOptimizer.checkpoint_state``), gathered over
data-parallel ranks when the distributed optimizer shards it, so a checkpoint does not depend on
precision bookkeeping or ZeRO sharding either: any run loads it. At save and load
time each TP-sharded local tensor is viewed as a DTensor over this rank's TP sub-mesh with
``Shard(tp_partition_dim)``; ``torch.distributed.checkpoint`` then writes each shard once and, on
load, reads exactly the slice the loading rank owns, whatever tp/pp/dp wrote it. Replicated
tensors are plain tensors, which DCP writes once however many ranks hold them. Pipeline stages
simply hold different names.

Two tensors need care:

- Vocabulary tables (word embedding, untied output weight) are padded to a multiple of 128 x tp,
  so their shape depends on tp. Only their ``vocab_size`` real rows are logical: they are saved
  gathered over TP and unpadded, and loaded whole, each rank then keeping its rows (padding rows
  are zero in weights and AdamW state alike: no token and no gradient ever reaches them).
- The last pipeline stage's copy of the tied embedding (``shared_embedding_copy``) has the same
  logical name as the first stage's: it is saved once (from the first stage) and loaded into both.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Shard

from megatron_hydra.checkpoint import rng, store
from megatron_hydra.checkpoint.safe_reader import read_metadata, safe_load
from megatron_hydra.errors import CheckpointError
from megatron_hydra.models.init import VOCAB_TABLES
from megatron_hydra.parallel import collectives as C
from megatron_hydra.parallel.state import ParallelState

ADAM_KEYS = ("exp_avg", "exp_avg_sq")
OPTIMIZER_KEYS = ADAM_KEYS + ("main",)


@dataclass
class Entry:
    """One local parameter and how it maps onto its logical tensor."""

    name: str
    param: torch.nn.Parameter
    dim: Optional[int]  # TP-sharded dim, None when replicated over TP
    vocab: bool  # a padded vocabulary table
    copy: bool  # the last stage's copy of the tied embedding


def entries(model: torch.nn.Module) -> List[Entry]:
    """This rank's parameters under their logical names. ``model`` is a ``GPTModel`` or, under
    pipeline parallelism, a ``ModuleList`` of them (one per virtual stage): each chunk's own
    ``named_parameters`` are already logical, so the chunk index is simply dropped."""
    chunks = list(model) if isinstance(model, torch.nn.ModuleList) else [model]
    return [Entry(name, p, getattr(p, "tp_partition_dim", None), name in VOCAB_TABLES,
                  getattr(p, "shared_embedding_copy", False))
            for chunk in chunks for name, p in chunk.named_parameters()]


def logical_shape(e: Entry, tp_size: int, vocab_size: int) -> List[int]:
    shape = list(e.param.shape)
    if e.vocab:
        shape[0] = vocab_size
    elif e.dim is not None:
        shape[e.dim] *= tp_size
    return shape


def logical_shapes(model: torch.nn.Module, tp_size: int, vocab_size: int) -> Dict[str, List[int]]:
    return {e.name: logical_shape(e, tp_size, vocab_size) for e in entries(model)}


def _tp_mesh(ps: ParallelState):
    return ps.mesh["tp"] if ps.mesh is not None and ps.tp_size > 1 else None


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _default_step_dtype() -> torch.dtype:
    """What AdamW would make ``step`` in now (saving before the first step)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


# Save ------------------------------------------------------------------------------------------
def _saved_view(t: torch.Tensor, e: Entry, ps: ParallelState, vocab_size: int):
    mesh = _tp_mesh(ps)
    t = t.detach()
    if e.vocab:
        return C.all_gather(t, 0, ps.tp_group)[:vocab_size].contiguous()
    if e.dim is not None and mesh is not None:
        return DTensor.from_local(t, mesh, [Shard(e.dim)], run_check=False)
    return t


def _key(name: str, key: str) -> str:
    return f"main/{name}" if key == "main" else f"optim/{name}/{key}"


def state_dict(model, optimizer, ps: ParallelState, vocab_size: int) -> dict:
    """What this rank contributes to a checkpoint: DCP-ready, keyed by logical name."""
    sd = {}
    states = optimizer.checkpoint_state(_default_step_dtype()) if optimizer is not None else {}
    for e in entries(model):
        if e.copy:
            continue
        sd[f"model/{e.name}"] = _saved_view(e.param, e, ps, vocab_size)
        if optimizer is not None:
            state = states[e.param]
            sd[f"optim/{e.name}/step"] = state["step"]
            for key in OPTIMIZER_KEYS:
                if key in state:
                    sd[_key(e.name, key)] = _saved_view(state[key], e, ps, vocab_size)
    return sd


def save(final: str, model, optimizer, ps: ParallelState, vocab_size: int, meta: dict) -> None:
    """Write the checkpoint ``final`` (collective: every rank calls it). ``optimizer=None`` saves
    the model only. ``meta`` (JSON-able) is stored as ``meta.json`` by rank 0."""
    rank = _rank()
    if rank == 0:
        store.prepare(final)
    _barrier()
    tmp = store.tmp_dir(final)
    sd = state_dict(model, optimizer, ps, vocab_size)
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(tmp, thread_count=1))
    rng.save(os.path.join(tmp, "rng", f"rank_{rank:05d}.pt"))
    _barrier()
    if rank == 0:
        store.write_meta(tmp, {**meta, "has_optimizer": optimizer is not None})
        store.commit(final)
    _barrier()


# Load ------------------------------------------------------------------------------------------
def check_shapes(path: str, saved: Dict[str, List[int]], expected: Dict[str, List[int]], has_optimizer: bool,
                 load_optimizer: bool) -> None:
    """A one-line ``CheckpointError`` for the first tensor the checkpoint lacks or has another shape."""
    for name, shape in expected.items():
        if name not in saved:
            raise CheckpointError(f"checkpoint {path} has no tensor {name}: it was saved from another model; "
                                  "load a checkpoint of this model config")
        if list(saved[name]) != list(shape):
            raise CheckpointError(f"checkpoint {path}: tensor {name} has shape {list(saved[name])} there but "
                                  f"{list(shape)} in this model: use the model config it was saved with")
    if load_optimizer and not has_optimizer:
        raise CheckpointError(f"checkpoint {path} has no optimizer state: set checkpoint.load_optimizer=false to "
                              "load the model only")


class _Loader:
    """Templates DCP fills in place, and how each then lands in this rank's tensors."""

    def __init__(self, ps: ParallelState, vocab_size: int):
        self.ps, self.vocab_size, self.mesh = ps, vocab_size, _tp_mesh(ps)
        self.sd, self.targets = {}, {}

    def add(self, key: str, target: torch.Tensor, e: Entry) -> None:
        if key in self.sd:  # the tied embedding's copy: the same logical tensor again
            self.targets[key].append((target, e))
            return
        if e.vocab:
            template = torch.empty([self.vocab_size, *target.shape[1:]], dtype=target.dtype, device=target.device)
        elif e.dim is not None and self.mesh is not None:
            template = DTensor.from_local(target.detach(), self.mesh, [Shard(e.dim)], run_check=False)
        else:
            template = target.detach()
        self.sd[key], self.targets[key] = template, [(target, e)]

    @torch.no_grad()
    def finish(self) -> None:
        for key, targets in self.targets.items():
            loaded = self.sd[key]
            for target, e in targets:
                if e.vocab:
                    rows = target.shape[0]
                    start = C.group_rank(self.ps.tp_group) * rows
                    mine = loaded[start:min(start + rows, self.vocab_size)]
                    target.zero_()
                    target[:mine.shape[0]].copy_(mine)
                elif isinstance(loaded, DTensor):
                    target.copy_(loaded.to_local())
                elif loaded is not target:
                    target.copy_(loaded)


def load(path: str, model, optimizer, ps: ParallelState, vocab_size: int, load_optimizer: bool = True) -> None:
    """Fill this rank's parameters (and AdamW state unless ``load_optimizer`` is false) from the
    checkpoint at ``path``, whatever layout wrote it (collective: every rank calls it)."""
    metadata = read_metadata(path).state_dict_metadata
    saved = {k[len("model/"):]: list(v.size) for k, v in metadata.items() if k.startswith("model/")}
    has_optimizer = any(k.startswith("optim/") for k in metadata)
    local = entries(model)
    expected = {e.name: logical_shape(e, ps.tp_size, vocab_size) for e in local}
    check_shapes(path, saved, expected, has_optimizer, load_optimizer and optimizer is not None)
    if optimizer is not None and hasattr(optimizer, "finish_param_gather"):
        optimizer.finish_param_gather()
    loader = _Loader(ps, vocab_size)
    states, missing_main = {}, []
    if load_optimizer and optimizer is not None:
        step_key = next(k for k in metadata if k.startswith("optim/") and k.endswith("/step"))
        states = optimizer.checkpoint_state(metadata[step_key].properties.dtype)
    for e in local:
        # An fp32 model reads a 16-bit run's fp32 main weights rather than their rounded copy.
        full = e.param.dtype == torch.float32 and f"main/{e.name}" in metadata
        loader.add(f"main/{e.name}" if full else f"model/{e.name}", e.param, e)
        if e.param in states:
            state = states[e.param]
            loader.add(f"optim/{e.name}/step", state["step"], Entry(e.name, e.param, None, False, e.copy))
            for key in OPTIMIZER_KEYS:
                if key not in state:
                    continue
                if _key(e.name, key) in metadata:
                    loader.add(_key(e.name, key), state[key], e)
                else:  # fp32 main weights of a checkpoint saved without them: from the model's
                    missing_main.append((state[key], e.param))
    safe_load(loader.sd, path)
    loader.finish()
    with torch.no_grad():
        for main, param in missing_main:
            main.copy_(param)
    if states:
        optimizer.load_checkpoint_state(states)
    elif optimizer is not None and hasattr(optimizer, "reload_main_from_model"):
        optimizer.reload_main_from_model()


def load_rng(path: str) -> bool:
    """Restore this rank's generator states, if the checkpoint has them for this rank."""
    file = os.path.join(path, "rng", f"rank_{_rank():05d}.pt")
    if not os.path.isfile(file):
        return False
    rng.load(file)
    return True
