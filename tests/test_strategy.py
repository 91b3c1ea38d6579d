"""MegatronStrategy: the collectives Lightning calls (metric sync, broadcast), and which group each
gradient of the buffer it attaches reduces over."""

from __future__ import annotations

import torch

from conftest import spawn_ranks


def _reduce(rank, world):
    import torch.distributed as dist

    from megatron_hydra.parallel.state import ParallelState
    from megatron_hydra.training.strategy import MegatronStrategy

    ps = ParallelState.build(dp=world, ep=world)
    strategy = MegatronStrategy(ps, torch.device("cpu"), grad_bucket_size=10)
    x = torch.tensor([float(rank + 1)])
    out = {op: float(strategy.reduce(x, reduce_op=op)) for op in ("mean", "sum", "max", dist.ReduceOp.MIN)} | {
        "broadcast": strategy.broadcast(f"from {rank}"), "world": strategy.world_size, "rank": strategy.global_rank}
    # The gradient buffer it attaches reduces expert parameters over the expert data-parallel group.
    model = torch.nn.Linear(2, 2)
    model.weight.expert_parallel = True
    strategy.wrap_model(model)
    groups = {p: b.group for b in strategy.grad_buffer.buckets for p in b.params}
    strategy.grad_buffer.close()
    return out | {"groups": (groups[model.weight] is ps.expert_dp_group, groups[model.bias] is ps.dp_cp_group)}


def test_reduce_ops_broadcast_and_gradient_groups():
    results = spawn_ranks(_reduce, 2)
    for rank, r in results.items():
        assert r.pop("groups") == (True, True)
        values = {k if isinstance(k, str) else "min": v for k, v in r.items()}
        assert values["mean"] == 1.5 and values["sum"] == 3.0 and values["max"] == 2.0 and values["min"] == 1.0
        assert values["broadcast"] == "from 0" and values["world"] == 2 and values["rank"] == rank
