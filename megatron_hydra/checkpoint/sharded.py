"""Sharded save and load of a rank's model and AdamW state, in any layout.

Every tensor is stored under its logical name (``model/layers.3.mlp.fc1.weight``,
``optim/layers.3.mlp.fc1.weight/exp_avg``, and for 16-bit models the fp32 main weights
``main/layers.3.mlp.fc1.weight``) with its logical, unsharded shape, as the rectangles
(``checkpoint.chunks``) that this rank holds of it: its TP shard of a weight, split over its
data-parallel replicas so that each writes 1/dp; the optimizer's pieces as
``MegatronOptimizer.checkpoint_pieces`` hands them over (whole TP-local tensors, or the flat
ranges the distributed optimizer owns). ``torch.distributed.checkpoint`` writes the rectangles
with their offsets and, on load, reads into each rank's own tensors exactly the overlapping parts
of the saved ones, whatever tp/pp/dp, distributed optimizer or precision wrote them. No rank
gathers anything: saving and loading allocate at most a rank's own part. Pipeline stages simply
hold different names.

Two tensors need care:

- Vocabulary tables (word embedding, untied output weight) are padded to a multiple of 128 x tp,
  so their shape depends on tp. Only their ``vocab_size`` real rows are logical: each rank writes
  and reads the real rows of its own TP shard (padding rows are zero in weights and AdamW state
  alike: no token and no gradient ever reaches them).
- The last pipeline stage's copy of the tied embedding (``shared_embedding_copy``) has the same
  logical name as the first stage's: it is saved once (from the first stage) and loaded into both.

A model with LoRA adapters keeps its frozen base and its adapters in different checkpoints
(``checkpoint.selection``): ``select`` picks the part a function handles (``None`` everything,
``"adapters"``, ``"base"`` with the persistent buffers). A load with a selector reads that part
of the checkpoint and ignores the rest, so one model loads its base from one checkpoint and its
adapters from another.
"""

from __future__ import annotations

import errno
import logging
import math
import os
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from megatron_hydra.checkpoint import rng, store
from megatron_hydra.checkpoint.chunks import Chunks, Placement, SavePlanner
from megatron_hydra.checkpoint.safe_reader import dcp_failure, read_metadata, safe_load
# check_shapes: also sharded's, for the callers that check a checkpoint before loading it
from megatron_hydra.checkpoint.selection import (check_select, check_shapes, extra_tensors,  # noqa: F401
                                                 select_names)
from megatron_hydra.errors import CheckpointError
from megatron_hydra.models.backends import logical_parameters
from megatron_hydra.models.init import VOCAB_TABLES
from megatron_hydra.parallel import collectives as C
from megatron_hydra.parallel.fsdp import is_sharded, local_rows
from megatron_hydra.parallel.lora import is_adapter
from megatron_hydra.parallel.optimizer import StatePiece
from megatron_hydra.parallel.state import ParallelState

log = logging.getLogger(__name__)

ADAM_KEYS = ("exp_avg", "exp_avg_sq")
MUON_KEYS = ("momentum_buffer",)  # Muon's state of a hidden matrix (optim=muon), in place of Adam's
OPTIMIZER_KEYS = ADAM_KEYS + MUON_KEYS + ("main",)


@dataclass
class Entry:
    """One local shard of a logical tensor and how it maps onto it."""

    name: str
    param: torch.Tensor  # the parameter, or the rows of one that hold this tensor (see ``owner``)
    dim: Optional[int]  # TP-sharded dim, None when replicated over TP
    vocab: bool  # a padded vocabulary table
    copy: bool  # the last stage's copy of the tied embedding
    # The parameter holding ``param`` (its optimizer state is keyed by it) and, when it holds
    # several logical tensors (Transformer Engine's fc1 with SwiGLU's gate and up), which rows.
    owner: Optional[torch.nn.Parameter] = None
    rows: Optional[slice] = None

    def part(self, t: torch.Tensor) -> torch.Tensor:
        """This entry's rows of a tensor shaped like ``owner`` (its optimizer state)."""
        return t if self.rows is None else t[self.rows].view(self.param.shape)

    @property
    def expert(self) -> bool:
        """One expert of an MoE layer's stacked parameter (replicated over the expert data-parallel
        group only, not over all of dp x cp)."""
        return getattr(self.owner, "expert_parallel", False)


def entries(model: torch.nn.Module, select: Optional[str] = None) -> List[Entry]:
    """This rank's parameters under their logical names, whichever implementation holds them
    (``models.backends.logical_parameters``), those of the part ``select`` names. ``model`` is a
    ``GPTModel`` or, under pipeline parallelism, a ``ModuleList`` of them (one per virtual stage):
    each chunk's names are already logical, so the chunk index is simply dropped."""
    check_select(select)
    chunks = list(model) if isinstance(model, torch.nn.ModuleList) else [model]
    return [Entry(lp.name, lp.tensor, lp.tp_dim, lp.name in VOCAB_TABLES,
                  getattr(lp.param, "shared_embedding_copy", False), lp.param, lp.rows)
            for chunk in chunks for lp in logical_parameters(chunk)
            if select is None or (select == "adapters") == is_adapter(lp.param)]


def persistent_buffers(model: torch.nn.Module, select: Optional[str] = None) -> Dict[str, torch.Tensor]:
    """The model's state that is not a parameter but must survive a restart (an MoE router's
    selection bias), by logical name; replicated over every rank that holds it. Part of the base:
    adapters have none."""
    if select == "adapters":
        return {}
    chunks = list(model) if isinstance(model, torch.nn.ModuleList) else [model]
    out = {}
    for chunk in chunks:
        for prefix, module in chunk.named_modules():
            for name, buf in module._buffers.items():
                if buf is not None and name not in module._non_persistent_buffers_set:
                    out[f"{prefix}.{name}" if prefix else name] = buf
    return out


def logical_shape(e: Entry, tp_size: int, vocab_size: int) -> List[int]:
    shape = list(e.param.shape)
    if e.vocab:
        shape[0] = vocab_size
    elif e.dim is not None:
        shape[e.dim] *= tp_size
    return shape


def logical_shapes(model: torch.nn.Module, tp_size: int, vocab_size: int,
                   select: Optional[str] = None) -> Dict[str, List[int]]:
    return {e.name: logical_shape(e, tp_size, vocab_size) for e in entries(model, select)}


def placement(e: Entry, ps: ParallelState, vocab_size: int) -> Placement:
    """Where this rank's TP-local tensor of ``e`` sits in the logical tensor."""
    logical = tuple(logical_shape(e, ps.tp_size, vocab_size))
    dim = 0 if e.vocab else e.dim
    offset = ps.tp_rank * e.param.shape[dim] if dim is not None else 0
    return Placement(logical, tuple(e.param.shape), dim, offset)


def _entry_range(e: Entry) -> Tuple[int, int]:
    """Where ``e``'s tensor lies in its owner parameter flattened (all of it, or some rows)."""
    if e.rows is None:
        return 0, e.param.numel()
    row = e.owner[0].numel()
    return e.rows.start * row, e.rows.stop * row


def _piece_chunks(e: Entry, place: Placement, piece: StatePiece, key: str,
                  within: Optional[Tuple[int, int]] = None) -> Chunks:
    """The part of ``piece`` (a flat range of ``e``'s owner) that is ``e``'s, and inside
    ``within`` (a range of ``e``'s tensor), as chunks."""
    base, stop = _entry_range(e)
    start = base
    if within is not None:
        start, stop = base + within[0], base + within[1]
    lo, hi = max(piece.lo, start), min(piece.hi, stop)
    if lo >= hi:
        return Chunks(place.logical, [])
    return Chunks.of(place, piece.tensors[key][lo - piece.lo:hi - piece.lo], lo - base)


def _held(e: Entry) -> Tuple[torch.Tensor, int]:
    """The elements of ``e``'s TP-local tensor this rank holds, flat, and the first one's index:
    all of it, or under FSDP its rows (``parallel.fsdp.local_rows``)."""
    rows, r0 = local_rows(e.param)
    return rows.detach().reshape(-1), r0 * math.prod(e.param.shape[1:])


def _written_range(e: Entry, ps: ParallelState) -> Tuple[int, int]:
    """The part of ``e``'s data-parallel-replicated tensor this rank writes: 1/dp x cp of it (an
    expert's: 1/size of the expert data-parallel group, the ranks holding that expert)."""
    numel = e.param.numel()
    group = ps.expert_dp_group if e.expert and ps.expert_dp_group is not None else ps.dp_cp_group
    size, rank = C.group_size(group), C.group_rank(group)
    return rank * numel // size, (rank + 1) * numel // size


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world(group=None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _barrier(group=None) -> None:
    if _world(group) > 1:
        dist.barrier(group=group)


def _default_step_dtype() -> torch.dtype:
    """What AdamW would make ``step`` in now (saving before the first step)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _pieces_by_owner(optimizer, step_dtype: torch.dtype) -> Dict[torch.nn.Parameter, List[StatePiece]]:
    by_owner: Dict[torch.nn.Parameter, List[StatePiece]] = {}
    for piece in optimizer.checkpoint_pieces(step_dtype):
        by_owner.setdefault(piece.param, []).append(piece)
    return by_owner


# Save ------------------------------------------------------------------------------------------
def _key(name: str, key: str) -> str:
    return f"main/{name}" if key == "main" else f"optim/{name}/{key}"


def state_dict(model, optimizer, ps: ParallelState, vocab_size: int, select: Optional[str] = None) -> dict:
    """What this rank contributes to a checkpoint (of the part ``select`` names, with the optimizer
    state of that part): DCP-ready, keyed by logical name. Every value is a view of this rank's own
    storage (``Chunks`` of its TP shard, or of its optimizer pieces), so
    building it allocates nothing. The data-parallel replicas of a weight (and of its optimizer
    state, without the distributed optimizer) split its writing: each writes 1/dp of it
    (``_written_range``), so every rank writes about as much, and an
    asynchronous save stages only that. Replicas over tp (norms, biases) write the same chunks,
    which DCP's deduplication writes once."""
    sd = {}
    pieces = _pieces_by_owner(optimizer, _default_step_dtype()) if optimizer is not None else {}
    for e in entries(model, select):
        if e.copy:
            continue
        place = placement(e, ps, vocab_size)
        if is_sharded(e.param):  # FSDP: this rank's rows are its own to write
            held, start = _held(e)
            written = None
            sd[f"model/{e.name}"] = Chunks.of(place, held, start)
        else:
            written = _written_range(e, ps)
            sd[f"model/{e.name}"] = Chunks.of(place, e.param.detach().reshape(-1)[written[0]:written[1]], written[0])
        owned = pieces.get(e.owner, [])
        if owned:
            sd[f"optim/{e.name}/step"] = owned[0].step
        # Replicated optimizer state (not the distributed optimizer's) splits its writing as the weights do.
        within = None if getattr(optimizer, "distributed", False) else written  # FSDP: None too
        for key in OPTIMIZER_KEYS if optimizer is not None else ():
            parts = [_piece_chunks(e, place, piece, key, within) for piece in owned if key in piece.tensors]
            if parts:
                sd[_key(e.name, key)] = Chunks(place.logical, [c for part in parts for c in part.parts])
    for name, buf in persistent_buffers(model, select).items():  # the same on every holder: DCP writes it once
        sd[f"buffer/{name}"] = buf
    return sd


def _share(files: List[str], group=None) -> List[str]:
    """This rank's part of a checkpoint's files for hashing: each file is hashed by one rank."""
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    return files[rank::_world(group)]


def _first_problem(problem: Optional[str], device: torch.device, group=None) -> Optional[str]:
    """Agree on checks each rank ran on its own share: the lowest rank's problem, or ``None``, on
    every rank. One one-element all-reduce; the messages travel only when something is wrong."""
    if _world(group) == 1:
        return problem
    # An explicit dtype: a background save runs this while training may switch the (process-wide)
    # default dtype, e.g. fp64's precision plugin around each step; the ranks must agree on it.
    flag = torch.tensor([0.0 if problem is None else 1.0], dtype=torch.float32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if flag.item() == 0:
        return None
    found: List[Optional[str]] = [None] * _world(group)
    dist.all_gather_object(found, problem, group=group)
    return next(p for p in found if p is not None)


def _local_tensors(value) -> List[torch.Tensor]:
    """The local tensors of a state dict value: ``Chunks`` or a plain tensor."""
    return value.local_tensors() if isinstance(value, Chunks) else [value]


def _nonfinite(sd: dict) -> Optional[str]:
    """The first tensor of this rank's contribution holding NaN or inf."""
    for key, value in sd.items():
        for local in _local_tensors(value):
            if local.is_floating_point() and not bool(torch.isfinite(local).all()):
                return key
    return None


def _gather_checksums(tmp: str, group=None) -> Optional[Dict[str, dict]]:
    """Size and SHA-256 of every file of the written directory, each hashed by one rank; the
    whole table on rank 0 (``None`` elsewhere). Called once every rank has finished writing."""
    mine = store.checksums(tmp, _share(store.checkpoint_files(tmp), group))
    if _world(group) == 1:
        return mine
    parts = [None] * _world(group) if _rank() == 0 else None
    dist.gather_object(mine, parts, dst=0, group=group)
    return {k: v for part in parts for k, v in part.items()} if parts is not None else None


@dataclass
class Snapshot:
    """Everything a save writes, taken on the training thread (``snapshot``); ``write`` turns it
    into the checkpoint directory on any thread."""

    final: str
    sd: dict
    meta: dict
    rng: Optional[dict]  # this rank's generator states when the snapshot was taken
    device: torch.device  # the training device: collectives over the default group use it


def snapshot(final: str, model, optimizer, ps: ParallelState, vocab_size: int, meta: dict, rng_states: bool = True,
             stage: Optional[Callable[[dict], dict]] = None, select: Optional[str] = None) -> Snapshot:
    """What this rank saves into ``final``, as of now (collective when TP gathers a vocabulary
    table): the part of the model ``select`` names. ``stage`` copies the state dict to host memory
    (``async_save.HostStager``) so that training may go on changing the parameters while
    ``write`` runs; without it the snapshot holds views of the live tensors and must be written
    before the next step."""
    sd = state_dict(model, optimizer, ps, vocab_size, select)
    if stage is not None:
        sd = stage(sd)
    return Snapshot(final, sd, {**meta, "has_optimizer": optimizer is not None},
                    rng.capture() if rng_states else None, next(iter(model.parameters())).device)


def write(snap: Snapshot, group=None) -> None:
    """Write a snapshot as the checkpoint ``snap.final`` (collective over ``group``, every rank
    calls it; ``None``: the default group). A background writer passes a gloo group of its own,
    so that these collectives never interleave with training's. A state holding NaN or inf is
    refused before anything is written: a diverged run never replaces a good checkpoint, nor
    makes retention delete one. A failed write (a full disk) is one line saying why, whatever
    layer of DCP it surfaced in."""
    final = snap.final
    device = torch.device("cpu") if group is not None and dist.get_backend(group) == "gloo" else snap.device
    bad = _first_problem(_nonfinite(snap.sd), device, group)
    if bad is not None:
        raise CheckpointError(f"refused to save {final}: {bad} holds NaN or inf, so nothing was written (after a "
                              "diverged run the older checkpoints are kept: resume from the newest with a lower "
                              "optim.lr)")
    try:
        _write_files(snap, group)
    except CheckpointException as e:
        raise save_failed(final, dcp_failure(e)) from None
    except OSError as e:
        raise save_failed(final, e) from None


def _write_files(snap: Snapshot, group) -> None:
    rank, final = _rank(), snap.final
    if rank == 0:
        store.prepare(final)
    _barrier(group)
    tmp = store.tmp_dir(final)
    dcp.save(snap.sd, storage_writer=dcp.FileSystemWriter(tmp, thread_count=1), planner=SavePlanner(),
             process_group=group)
    if snap.rng is not None:
        rng.save(os.path.join(tmp, "rng", f"rank_{rank:05d}.pt"), snap.rng)
    _barrier(group)
    sums = _gather_checksums(tmp, group)
    if rank == 0:
        store.write_meta(tmp, {**snap.meta, "checksums": sums})
        store.commit(final)
    _barrier(group)


def save_failed(final: str, error: BaseException) -> CheckpointError:
    """One line for a save of ``final`` that failed with ``error``: the system's reason (``No space
    left on device``) rather than DCP's wrapper, and what to do about it."""
    if isinstance(error, CheckpointError):
        return error
    if isinstance(error, OSError) and error.strerror:
        why = error.strerror + (f": {error.filename}" if error.filename else "")
    else:
        why = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"
    full = isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)
    fix = "free space on that disk or set checkpoint.dir to another one; " if full else ""
    return CheckpointError(f"saving {final} failed ({why}): {fix}the older checkpoints are kept")


def save(final: str, model, optimizer, ps: ParallelState, vocab_size: int, meta: dict, rng_states: bool = True,
         select: Optional[str] = None) -> None:
    """Write the checkpoint ``final`` now (collective: every rank calls it). ``optimizer=None``
    saves the model only; ``rng_states=False`` leaves out the ranks' random states (a model
    written outside a run); ``select``: the part of the model saved. ``meta`` (JSON-able) is
    stored as ``meta.json`` by rank 0, with the checksums of every file. The same two steps as a
    background save, on this thread."""
    write(snapshot(final, model, optimizer, ps, vocab_size, meta, rng_states, select=select))


# Load ------------------------------------------------------------------------------------------
def check_consumed(path: str, saved: Dict[str, List[int]], local: Dict[str, List[int]], device: torch.device,
                   select: Optional[str] = None) -> None:
    """Every saved model tensor (of the part ``select`` names) is loaded by some rank
    (collective): each rank marks the names its part of the model takes, and one all-reduce over
    a flag per name finds those nobody takes."""
    names = sorted(select_names(saved, select))
    taken = torch.tensor([float(n in local) for n in names], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(taken, op=dist.ReduceOp.MAX)
    extra = [n for n, t in zip(names, taken.tolist()) if not t]
    if extra:
        taken_names = [n for n, t in zip(names, taken.tolist()) if t]
        raise extra_tensors(path, extra, saved, taken_names, select=select)


def verify(path: str, device: torch.device) -> None:
    """Check every file of the checkpoint against the size and SHA-256 that ``meta.json`` records
    (collective: the files are shared out, each hashed once by one rank); a missing, truncated or
    corrupted one is a one-line ``CheckpointError`` naming it, on every rank."""
    recorded = store.read_meta(path, required={}).get("checksums") or {}
    problem = store.check_files(path, recorded, _share(sorted(recorded)))
    problem = _first_problem(problem, device)
    if problem is not None:
        raise CheckpointError(problem)


class _Loader:
    """The chunks DCP fills in place (views of this rank's tensors), and the tied embedding's
    second holder on this rank, filled from the first after the read."""

    def __init__(self, ps: ParallelState, vocab_size: int):
        self.ps, self.vocab_size = ps, vocab_size
        self.sd: Dict[str, object] = {}
        self.again: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self.first: Dict[str, torch.Tensor] = {}

    def add(self, key: str, e: Entry) -> None:
        if key in self.sd:  # the tied embedding's copy: the same logical tensor again
            self.again.append((_held(e)[0], self.first[key]))
            return
        held, start = _held(e)
        if e.vocab:  # padding rows are not in the checkpoint: zero, as at initialisation
            held.zero_()
        self.sd[key], self.first[key] = Chunks.of(placement(e, self.ps, self.vocab_size), held, start), held

    def add_pieces(self, key: str, e: Entry, pieces: List[StatePiece], name: str) -> None:
        if key in self.sd:  # both holders of the tied embedding are never on one rank (pp > 1)
            raise ValueError(f"{key} is held twice on one rank")
        place = placement(e, self.ps, self.vocab_size)
        parts = []
        for piece in (p for p in pieces if name in p.tensors):  # a Muon shard: its owner holds the momentum
            chunks = _piece_chunks(e, place, piece, name)
            if e.vocab:
                for t in piece_views(e, piece, name):
                    t.zero_()
            parts += chunks.parts
        self.sd[key] = Chunks(place.logical, parts)

    @torch.no_grad()
    def finish(self) -> None:
        for target, source in self.again:
            target.copy_(source)


def piece_views(e: Entry, piece: StatePiece, name: str) -> List[torch.Tensor]:
    """The flat part of ``piece``'s tensor ``name`` that belongs to ``e`` (empty or one view)."""
    start, stop = _entry_range(e)
    lo, hi = max(piece.lo, start), min(piece.hi, stop)
    return [piece.tensors[name][lo - piece.lo:hi - piece.lo]] if lo < hi else []


def load(path: str, model, optimizer, ps: ParallelState, vocab_size: int, load_optimizer: bool = True,
         select: Optional[str] = None, key: Optional[str] = None) -> None:
    """Fill this rank's parameters (and AdamW state unless ``load_optimizer`` is false) from the
    checkpoint at ``path``, whatever layout wrote it (collective: every rank calls it). The files
    are verified against their checksums first, and the saved model tensors must match this
    model's one for one (``load_optimizer=false`` skips the optimizer state, never a layer).
    ``select`` loads one part of the model (the rest is left as it is) from the same part of the
    checkpoint; ``key`` names the setting that gave ``path`` in errors. DCP reads straight into
    this rank's tensors: only the saved chunks that overlap them are read, one at a time."""
    device = next(iter(model.parameters())).device
    verify(path, device)
    metadata = read_metadata(path).state_dict_metadata
    saved = {k[len("model/"):]: list(v.size) for k, v in metadata.items() if k.startswith("model/")}
    has_optimizer = any(k.startswith("optim/") for k in metadata)
    local = entries(model, select)
    expected = {e.name: logical_shape(e, ps.tp_size, vocab_size) for e in local}
    try:  # this rank's part against the checkpoint; the ranks agree before any collective read
        check_shapes(path, saved, expected, has_optimizer, load_optimizer and optimizer is not None, whole=False,
                     select=select, key=key)
        problem = None
    except CheckpointError as e:
        problem = str(e)
    problem = _first_problem(problem, device)
    if problem is not None:
        raise CheckpointError(problem)
    check_consumed(path, saved, expected, device, select)
    if optimizer is not None and hasattr(optimizer, "finish_param_gather"):
        optimizer.finish_param_gather()
    loader = _Loader(ps, vocab_size)
    pieces: Dict[torch.nn.Parameter, List[StatePiece]] = {}
    steps: Dict[torch.nn.Parameter, torch.Tensor] = {}
    fresh: set = set()  # parameters whose optimizer state the checkpoint's optimizer did not keep
    mains = _Loader(ps, vocab_size)
    # The same on every rank (the second read is collective): the run keeps fp32 main weights
    # apart from its 16-bit model, and the checkpoint has none (saved in fp32, or by FSDP).
    mains_needed = (load_optimizer and getattr(optimizer, "separate", False)
                    and not any(k.startswith("main/") for k in metadata))
    if load_optimizer and optimizer is not None:
        step_key = next(k for k in metadata if k.startswith("optim/") and k.endswith("/step"))
        pieces = _pieces_by_owner(optimizer, metadata[step_key].properties.dtype)
    muon = getattr(optimizer, "muon", None)
    muon_params = set(muon.params) if muon is not None else set()  # the matrices Muon steps here
    with torch.no_grad():
        for e in local:
            # An fp32 model reads a 16-bit run's fp32 main weights rather than their rounded copy.
            full = e.param.dtype == torch.float32 and f"main/{e.name}" in metadata
            loader.add(f"main/{e.name}" if full else f"model/{e.name}", e)
            owned = pieces.get(e.owner, [])
            if not owned:
                continue
            held = {k for piece in owned for k in piece.tensors}  # a Muon matrix's owner adds its momentum piece
            # Decided from the metadata and the optimizer's kind alone, the same on every rank (a
            # non-owner of a Muon matrix holds no momentum piece, yet must drop Adam's step count too).
            state_keys = MUON_KEYS if e.owner in muon_params else ADAM_KEYS
            if not all(_key(e.name, k) in metadata for k in state_keys):
                fresh.add(e.owner)  # saved by the other optimizer: its state starts afresh, step count too
            elif e.owner not in steps:
                steps[e.owner] = torch.zeros((), dtype=owned[0].step.dtype)
                loader.sd[f"optim/{e.name}/step"] = steps[e.owner]
            for key in OPTIMIZER_KEYS:
                if key not in held or (key != "main" and e.owner in fresh):
                    continue
                if _key(e.name, key) in metadata:
                    loader.add_pieces(_key(e.name, key), e, owned, key)
                else:  # fp32 main weights of a checkpoint saved without them: the saved weights
                    mains.add_pieces(f"model/{e.name}", e, owned, key)
    for name, buf in persistent_buffers(model, select).items():
        if f"buffer/{name}" in metadata:  # absent from checkpoints of models without it: stays as built
            loader.sd[f"buffer/{name}"] = buf
    safe_load(loader.sd, path)
    loader.finish()
    if mains_needed:  # a second read, of the same tensors into the main weights: exact from fp32 ones
        safe_load(mains.sd, path)
    if fresh and _rank() == 0:
        log.warning(_switched(metadata))
    if steps:
        optimizer.load_steps(steps)
    elif optimizer is not None and hasattr(optimizer, "reload_main_from_model"):
        optimizer.reload_main_from_model()


def _switched(metadata) -> str:
    """The one line that says what a checkpoint of the other optimizer (AdamW <-> Muon) keeps."""
    if any(k.endswith("/momentum_buffer") for k in metadata):
        return ("checkpoint from optim=muon: weights and the Adam moments it has are loaded; the matrices Muon "
                "stepped start AdamW's moments and step count at zero")
    return ("checkpoint from optim=adamw: weights and the Adam moments of the parameters AdamW still steps are "
            "loaded; the Muon matrices drop their Adam moments and start their momentum at zero")


def load_rng(path: str) -> bool:
    """Restore this rank's generator states, if the checkpoint has them for this rank. A file that
    is not states ``rng.capture`` wrote (damaged, crafted, a FIFO) changes no generator: the rank
    goes on with fresh random states, as in another layout, after a one-line warning. The states
    only make the continuation bitwise identical; the weights and the step are already loaded."""
    file = os.path.join(path, "rng", f"rank_{_rank():05d}.pt")
    if not os.path.lexists(file):
        return False
    try:
        rng.load(file)
    except CheckpointError as e:
        log.warning("%s; this rank continues with fresh random states", e)
        return False
    return True
