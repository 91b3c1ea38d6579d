"""Each TP mapping's forward is the collective it names, and its backward is its exact adjoint.

Megatron's convention: a *replicated* tensor is one logical tensor held by every rank (its values
and its gradient are the same everywhere, and an inner product over it counts once); a *per-rank*
tensor (a shard, or a partial sum whose consumers differ by rank) counts once per rank. With that
bookkeeping, <f(x), g> = <x, f*(g)> must hold for random x and g.
"""

from __future__ import annotations

import torch

from conftest import spawn_ranks

# name: (x replicated?, y replicated?)
KINDS = {
    "copy_to_tp": (True, False),
    "reduce_from_tp": (False, True),
    "gather_from_tp": (False, True),
    "scatter_to_tp": (True, False),
    "gather_from_sp": (False, False),
    "reduce_scatter_to_sp": (False, False),
}


def _check(rank, world):
    import torch.distributed as dist

    from megatron_hydra.parallel import mappings as M

    group = dist.new_group(list(range(world)))
    own = torch.Generator().manual_seed(100 + rank)
    same = torch.Generator().manual_seed(7)  # the same draws on every rank
    reference = {
        "copy_to_tp": lambda x, xs: x,
        "reduce_from_tp": lambda x, xs: sum(xs),
        "gather_from_tp": lambda x, xs: torch.cat(xs, dim=-1),
        "scatter_to_tp": lambda x, xs: x.chunk(world, dim=-1)[rank],
        "gather_from_sp": lambda x, xs: torch.cat(xs, dim=1),
        "reduce_scatter_to_sp": lambda x, xs: sum(xs).chunk(world, dim=1)[rank],
    }
    results = {}
    for name, (x_rep, y_rep) in KINDS.items():
        x = torch.randn(2, 4 * world, 6, generator=same if x_rep else own, dtype=torch.float64)
        everyone = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(everyone, x)
        x0 = x.clone()  # reduce_from_tp sums into its input in place
        x.requires_grad_(True)
        y = getattr(M, name)(x, group)
        forward_ok = torch.allclose(y.detach(), reference[name](x0, everyone), rtol=0, atol=1e-12)
        g = torch.randn(y.shape, generator=same if y_rep else own, dtype=torch.float64)
        # Before backward: the all-reducing backwards work in place on the incoming gradient.
        lhs = torch.tensor([(y.detach() * g).sum() / (world if y_rep else 1)])
        y.backward(g)
        rhs = torch.tensor([(x0 * x.grad).sum() / (world if x_rep else 1)])
        dist.all_reduce(lhs)
        dist.all_reduce(rhs)
        results[name] = (forward_ok, float(lhs), float(rhs))
    return results


def test_mappings_forward_and_adjoint_backward():
    results = spawn_ranks(_check, 2)
    assert sorted(results) == [0, 1]
    for rank, per_name in results.items():
        assert sorted(per_name) == sorted(KINDS)
        for name, (forward_ok, lhs, rhs) in per_name.items():
            assert forward_ok, (rank, name)
            assert abs(lhs - rhs) <= 1e-10 * max(1.0, abs(lhs)), (rank, name, lhs, rhs)
