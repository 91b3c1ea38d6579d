"""Where this rank sits in the (pp, dp, cp, tp) grid, and the process groups along each axis.

Ranks are laid out as Megatron does, tensor-parallel innermost:
``rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank``, so a TP group is a run of
consecutive ranks (one node's NVLink domain on GPUs) and pipeline stages are furthest apart.
The arithmetic is pure (``coordinates``, ``group_ranks``) so it is tested without processes; the
``DeviceMesh`` built from it carries the per-axis groups. Expert parallelism is carved from dp
(``expert_group_ranks``).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from itertools import product
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_hydra.parallel.device import bind_device

AXES = ("pp", "dp", "cp", "tp")
DP_CP_MESH = "dp_cp"  # the name of the dp and cp mesh dimensions flattened into one


def _strides(sizes: Dict[str, int]) -> Dict[str, int]:
    strides, step = {}, 1
    for axis in reversed(AXES):
        strides[axis] = step
        step *= sizes[axis]
    return strides


def coordinates(rank: int, sizes: Dict[str, int]) -> Dict[str, int]:
    """This rank's index along each axis."""
    strides = _strides(sizes)
    return {axis: (rank // strides[axis]) % sizes[axis] for axis in AXES}


def group_ranks(sizes: Dict[str, int], axes: Sequence[str]) -> List[List[int]]:
    """All groups of ranks that differ only along ``axes`` (each group sorted by rank)."""
    strides = _strides(sizes)
    fixed = [a for a in AXES if a not in axes]
    groups = []
    for fixed_coords in product(*(range(sizes[a]) for a in fixed)):
        base = sum(c * strides[a] for a, c in zip(fixed, fixed_coords))
        members = [
            base + sum(c * strides[a] for a, c in zip(axes, coords))
            for coords in product(*(range(sizes[a]) for a in axes))
        ]
        groups.append(sorted(members))
    return groups


def expert_group_ranks(sizes: Dict[str, int], ep: int, experts_split_over_tp: bool = True) -> Dict[str, List[List[int]]]:
    """Expert parallelism carved from data parallelism, as Megatron does: a data-parallel index is
    ``edp_rank * ep + ep_rank`` (ep innermost), so the ``ep`` ranks of a group are data-parallel
    neighbours. ``ep``: the ranks that split the experts of each MoE layer (tokens are dispatched
    among them). ``edp_cp``: the ranks that hold the same experts (same ``ep_rank``, every ``edp``
    and ``cp`` index): expert gradients are reduced over them, as dense ones are over ``dp_cp``.

    When the experts are not split over TP (``parallel.expert_tensor_parallel_size=1`` with
    tp > 1), each TP rank dispatches its own tokens and holds whole experts, so expert parallelism
    is carved from dp x tp instead: the index is ``dp_rank * tp + tp_rank`` (tp innermost, so TP
    neighbours, one node's NVLink domain, share an EP group first) and ``edp_cp`` takes every
    ``ep``-th of those indices over every cp index."""
    inner = ("dp",) if experts_split_over_tp else ("dp", "tp")
    span = sizes["dp"] * (1 if experts_split_over_tp else sizes["tp"])
    if span % ep:
        raise ValueError(f"expert-parallel size {ep} does not divide {' x '.join(inner)} = {span}")
    out: Dict[str, List[List[int]]] = {"ep": [], "edp_cp": []}
    cp = sizes["cp"]
    for group in group_ranks(sizes, (*inner, "cp")):  # sorted: index = (dp_rank [* tp + tp_rank]) * cp + cp_rank
        if not experts_split_over_tp:  # reorder to (dp, tp, cp) so that ``index * cp + c`` below holds
            tp = sizes["tp"]
            group = [group[(d * cp + c) * tp + t] for d in range(sizes["dp"]) for t in range(tp) for c in range(cp)]
        for edp in range(span // ep):
            for c in range(cp):
                out["ep"].append(sorted(group[(edp * ep + e) * cp + c] for e in range(ep)))
        for e in range(ep):
            out["edp_cp"].append(sorted(group[(edp * ep + e) * cp + c] for edp in range(span // ep) for c in range(cp)))
    return out


def embedding_group_ranks(sizes: Dict[str, int]) -> List[List[int]]:
    """First and last pipeline stage of each pipeline: they hold the tied input/output embedding."""
    return [sorted({g[0], g[-1]}) for g in group_ranks(sizes, ("pp",))]


@dataclass
class ParallelState:
    """Sizes, coordinates and groups of this rank. Groups are ``None`` when there is no process
    group at all (one process, no ``torch.distributed``); collectives over a group of size 1 are
    skipped by callers, so model code runs unchanged in both cases."""

    sizes: Dict[str, int]
    rank: int = 0
    mesh: Optional[object] = None
    groups: Optional[Dict[str, object]] = None
    ep: int = 1  # expert-parallel degree (a factor of dp; expert_group_ranks)
    etp: Optional[int] = None  # expert tensor-parallel degree: tp (None: the same) or 1 (experts whole)

    @classmethod
    def single(cls) -> "ParallelState":
        return cls(sizes={a: 1 for a in AXES})

    @classmethod
    def build(cls, tp: int = 1, pp: int = 1, dp: int = 1, cp: int = 1, device_type: str = "cpu",
              timeout: Optional[timedelta] = None, ep: int = 1, etp: Optional[int] = None) -> "ParallelState":
        """Create the mesh and every group. Collective: all ranks must call it together. Every group
        gets ``timeout`` (default: the world group's, i.e. ``trainer.collective_timeout_s``): a
        subgroup left at torch's default would wait 30 minutes for a stopped peer. ``ep``: the
        expert-parallel degree, carved from dp (``expert_group_ranks``); ``etp``: the experts'
        tensor-parallel degree, tp (None) or 1."""
        from torch.distributed.device_mesh import init_device_mesh

        sizes = {"pp": pp, "dp": dp, "cp": cp, "tp": tp}
        world = dist.get_world_size()
        if pp * dp * cp * tp != world:
            raise ValueError(f"pp*dp*cp*tp = {pp}*{dp}*{cp}*{tp} != world size {world}")
        rank = dist.get_rank()
        timeout = timeout or world_timeout(device_type)
        mesh = init_device_mesh(device_type, tuple(sizes[a] for a in AXES), mesh_dim_names=AXES,
                                backend_override=_mesh_backend_override(device_type, timeout))
        if cp > 1:  # FSDP shards over dp x cp: one flattened mesh dimension (parallel.fsdp.dp_mesh)
            mesh["dp", "cp"]._flatten(DP_CP_MESH)
        groups = {axis: mesh.get_group(axis) for axis in AXES}
        combined = {
            "dp_cp": group_ranks(sizes, ("dp", "cp")),  # gradient reduce
            "model": group_ranks(sizes, ("pp", "tp")),  # one model replica: norms, overflow checks
            "embedding": embedding_group_ranks(sizes),  # tied embedding grads
            "amax": group_ranks(sizes, ("dp", "cp", "tp")),  # FP8 amax reduction: the ranks holding the same layers
        }
        state = cls(sizes=sizes, rank=rank, ep=ep, etp=etp)
        if ep > 1 or not state.experts_split_over_tp:  # whole experts at ep 1 still reduce over tp too
            expert_groups = expert_group_ranks(sizes, ep, state.experts_split_over_tp)
            combined.update(expert_groups if ep > 1 else {"edp_cp": expert_groups["edp_cp"]})  # no 1-rank ep groups
        for name, all_groups in combined.items():
            for members in all_groups:  # every rank creates every group, in the same order
                group = dist.new_group(members, timeout=timeout)
                if rank in members:
                    groups[name] = group
        state.mesh, state.groups = mesh, groups
        return state

    def group(self, name: str):
        """The named group of this rank; ``None`` without process groups, or for the embedding
        group on a middle pipeline stage (which holds no embedding)."""
        return None if self.groups is None else self.groups.get(name)

    def coord(self, axis: str) -> int:
        return coordinates(self.rank, self.sizes)[axis]

    # Short names used throughout: the degrees and this rank's index along each axis.
    @property
    def tp_size(self) -> int:
        return self.sizes["tp"]

    @property
    def pp_size(self) -> int:
        return self.sizes["pp"]

    @property
    def dp_size(self) -> int:
        return self.sizes["dp"]

    @property
    def cp_size(self) -> int:
        return self.sizes["cp"]

    @property
    def tp_rank(self) -> int:
        return self.coord("tp")

    @property
    def pp_rank(self) -> int:
        return self.coord("pp")

    @property
    def dp_rank(self) -> int:
        return self.coord("dp")

    @property
    def cp_rank(self) -> int:
        return self.coord("cp")

    @property
    def tp_group(self):
        return self.group("tp")

    @property
    def experts_split_over_tp(self) -> bool:
        """Whether each expert is tensor-parallel like the dense MLP (the default), or whole on
        every rank (``etp=1``), each TP rank then routing its own tokens."""
        return (self.etp or self.tp_size) == self.tp_size

    @property
    def ep_rank(self) -> int:
        """This rank's index in its expert-parallel group (``expert_group_ranks``)."""
        index = self.dp_rank if self.experts_split_over_tp else self.dp_rank * self.tp_size + self.tp_rank
        return index % self.ep

    @property
    def ep_group(self):
        return self.group("ep")

    @property
    def expert_dp_group(self):
        """The ranks holding the same experts (expert gradients are reduced over them)."""
        return self.group("edp_cp")

    @property
    def cp_group(self):
        """The ranks that share each sequence (context parallelism)."""
        return self.group("cp")

    @property
    def pp_group(self):
        return self.group("pp")

    @property
    def dp_cp_group(self):
        """Data-parallel ranks together with context-parallel ones: the group gradients are
        averaged over (a cp rank holds the same weights as its dp peers)."""
        return self.group("dp_cp")

    def __repr__(self) -> str:
        coords = coordinates(self.rank, self.sizes)
        return "ParallelState(" + ", ".join(f"{a}={coords[a]}/{self.sizes[a]}" for a in AXES) + ")"


def world_timeout(device_type: str) -> Optional[timedelta]:
    """The timeout the world group was created with (``init_process_group(timeout=...)``)."""
    try:
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device(device_type))
        return backend.options._timeout
    except (AttributeError, RuntimeError, ValueError):
        return None


def _mesh_backend_override(device_type: str, timeout: Optional[timedelta]) -> Optional[dict]:
    """DeviceMesh creates its per-axis groups itself, with torch's default timeout unless the
    backend options carry one."""
    if timeout is None:
        return None
    if device_type == "cuda" and hasattr(dist, "ProcessGroupNCCL"):
        backend, options = "nccl", dist.ProcessGroupNCCL.Options()
    elif device_type == "cpu" and hasattr(dist, "ProcessGroupGloo"):
        backend, options = "gloo", dist.ProcessGroupGloo._Options()
    else:
        return None
    options._timeout = timeout
    return {axis: (backend, options) for axis in AXES}


def device_for(accelerator: str, local_rank: int) -> torch.device:
    """This rank's device, bound as the current CUDA device (``parallel.device.bind_device``: the
    worker already bound it before joining the process group; binding again is a no-op)."""
    return bind_device(accelerator, local_rank)
