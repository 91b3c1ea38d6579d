"""MegatronStrategy's collectives that Lightning calls (metric sync, broadcast)."""

from __future__ import annotations

import torch

from conftest import spawn_ranks


def _reduce(rank, world):
    import torch.distributed as dist

    from megatron_hydra.parallel.state import ParallelState
    from megatron_hydra.training.strategy import MegatronStrategy

    strategy = MegatronStrategy(ParallelState.build(dp=world), torch.device("cpu"), grad_bucket_size=10)
    x = torch.tensor([float(rank + 1)])
    return {op: float(strategy.reduce(x, reduce_op=op)) for op in ("mean", "sum", "max", dist.ReduceOp.MIN)} | {
        "broadcast": strategy.broadcast(f"from {rank}"), "world": strategy.world_size, "rank": strategy.global_rank}


def test_reduce_ops_and_broadcast():
    results = spawn_ranks(_reduce, 2)
    for rank, r in results.items():
        values = {k if isinstance(k, str) else "min": v for k, v in r.items()}
        assert values["mean"] == 1.5 and values["sum"] == 3.0 and values["max"] == 2.0 and values["min"] == 1.0
        assert values["broadcast"] == "from 0" and values["world"] == 2 and values["rank"] == rank
