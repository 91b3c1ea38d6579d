"""ParallelState: Megatron's rank order (tp innermost) for every factorisation of 8 ranks."""

from __future__ import annotations

from itertools import product

import pytest

from conftest import spawn_ranks
from megatron_hydra.parallel.state import AXES, coordinates, embedding_group_ranks, group_ranks


def factorisations(n: int):
    return [dict(zip(AXES, f)) for f in product(range(1, n + 1), repeat=4) if f[0] * f[1] * f[2] * f[3] == n]


def test_there_are_20_factorisations_of_8():
    assert len(factorisations(8)) == 20


@pytest.mark.parametrize("sizes", factorisations(8), ids=lambda s: "x".join(f"{a}{s[a]}" for a in AXES))
def test_coordinates_follow_megatron_order(sizes):
    # Independent reference: rank = ((pp * DP + dp) * CP + cp) * TP + tp.
    for rank in range(8):
        c = coordinates(rank, sizes)
        assert ((c["pp"] * sizes["dp"] + c["dp"]) * sizes["cp"] + c["cp"]) * sizes["tp"] + c["tp"] == rank
    # Every group partitions the ranks; members of a group differ only along its axes.
    for axis in AXES:
        groups = group_ranks(sizes, (axis,))
        assert sorted(r for g in groups for r in g) == list(range(8))
        for g in groups:
            assert len(g) == sizes[axis]
            others = {tuple(v for a, v in coordinates(r, sizes).items() if a != axis) for r in g}
            assert len(others) == 1


def test_tp_groups_are_consecutive_ranks():
    assert group_ranks({"pp": 2, "dp": 2, "cp": 1, "tp": 2}, ("tp",)) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert group_ranks({"pp": 2, "dp": 2, "cp": 1, "tp": 2}, ("pp",)) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert embedding_group_ranks({"pp": 4, "dp": 1, "cp": 1, "tp": 2}) == [[0, 6], [1, 7]]


def _build_all(rank, world):
    import torch.distributed as dist

    from megatron_hydra.parallel.state import ParallelState

    seen = []
    for sizes in factorisations(world):
        ps = ParallelState.build(tp=sizes["tp"], pp=sizes["pp"], dp=sizes["dp"], cp=sizes["cp"])
        row = {"coords": {a: ps.coord(a) for a in AXES}}
        for name in ("tp", "pp", "dp", "cp", "dp_cp", "model", "embedding"):
            group = ps.group(name)
            row[name] = None if group is None else dist.get_process_group_ranks(group)
        seen.append((sizes, row))
    return seen


def _coords(rank, sizes):
    """Megatron's order written out: rank = ((pp * DP + dp) * CP + cp) * TP + tp."""
    tp, cp, dp = sizes["tp"], sizes["cp"], sizes["dp"]
    return {"tp": rank % tp, "cp": rank // tp % cp, "dp": rank // (tp * cp) % dp, "pp": rank // (tp * cp * dp)}


def test_mesh_groups_on_8_gloo_ranks():
    world = 8
    results = spawn_ranks(_build_all, world)
    assert sorted(results) == list(range(8))
    for rank, seen in results.items():
        for sizes, row in seen:
            assert row["coords"] == _coords(rank, sizes)
            for axis in AXES:
                expected = [r for r in range(world) if all(_coords(r, sizes)[a] == _coords(rank, sizes)[a]
                                                          for a in AXES if a != axis)]
                assert row[axis] == expected, (axis, sizes, rank)
            # Combined groups, from the arithmetic alone: the members are the ranks that share
            # this rank's coordinates on every other axis.
            for name, axes in (("dp_cp", ("dp", "cp")), ("model", ("pp", "tp"))):
                expected = [r for r in range(world) if all(_coords(r, sizes)[a] == _coords(rank, sizes)[a]
                                                          for a in AXES if a not in axes)]
                assert row[name] == expected, (name, sizes, rank)
            # First and last stage of this rank's pipeline; middle stages belong to no group.
            pipeline = [r for r in range(world) if all(_coords(r, sizes)[a] == _coords(rank, sizes)[a]
                                                       for a in ("dp", "cp", "tp"))]
            ends = sorted({pipeline[0], pipeline[-1]})
            assert row["embedding"] == (ends if rank in ends else None), (sizes, rank)


@pytest.mark.parametrize("sizes, ep", [({"pp": 2, "dp": 4, "cp": 1, "tp": 2}, 2), ({"pp": 1, "dp": 4, "cp": 2, "tp": 2}, 4),
                                       ({"pp": 1, "dp": 2, "cp": 2, "tp": 1}, 2)])
def test_expert_groups_are_carved_from_data_parallelism(sizes, ep):
    from megatron_hydra.parallel.state import expert_group_ranks

    world = sizes["pp"] * sizes["dp"] * sizes["cp"] * sizes["tp"]
    groups = expert_group_ranks(sizes, ep)
    for name, size, same in (("ep", ep, lambda c: (c["pp"], c["cp"], c["tp"], c["dp"] // ep)),
                             ("edp_cp", world // (sizes["pp"] * sizes["tp"] * ep), lambda c: (c["pp"], c["tp"], c["dp"] % ep))):
        assert sorted(r for g in groups[name] for r in g) == list(range(world)), name  # a partition of the ranks
        for group in groups[name]:
            coords = [coordinates(r, sizes) for r in group]
            assert len(group) == size and len({same(c) for c in coords}) == 1, (name, group)
    for group in groups["ep"]:  # ep_rank = dp_rank % ep runs over 0..ep-1 within a group
        assert sorted(coordinates(r, sizes)["dp"] % ep for r in group) == list(range(ep))
