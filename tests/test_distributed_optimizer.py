"""The distributed optimizer (ZeRO-1) equals the plain one, holds 1/dp of its state, and its
checkpoints load into plain runs."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import SMALL, assert_same_trajectory, run_training, spawn_ranks

STEPS = 10
LAYOUTS = {
    "dp2": ["trainer.devices=2"],
    "dp4": ["trainer.devices=4"],
    "tp2_dp2": ["trainer.devices=4", "parallel=tp2"],
    "pp2_dp2": ["trainer.devices=4", "parallel=pp2", "data.global_batch_size=16"],
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_losses_equal_plain_optimizer(layout, tmp_path):
    # fp32 on both sides, the same layout: the only difference is where Adam runs and how grads
    # and params travel (reduce-scatter + all-gather instead of all-reduce).
    common = [*SMALL, f"trainer.max_steps={STEPS}", *LAYOUTS[layout]]
    plain = run_training(common, tmp_path / "plain")
    ours = run_training([*common, "optim.distributed_optimizer=true"], tmp_path / "zero1")
    assert len(ours) == len(plain) == STEPS
    assert_same_trajectory(ours, plain, rel=1e-6, keys=("loss",))
    assert_same_trajectory(ours, plain, rel=1e-5, keys=("grad_norm",))
    assert ours[-1]["loss"] < ours[0]["loss"]


def _state_bytes(rank, world, distributed, dtype):
    from conftest import compose_config
    from megatron_hydra.config import derive
    from megatron_hydra.parallel.data_parallel import GradBuffer
    from megatron_hydra.parallel.state import ParallelState
    from megatron_hydra.training.module import LMModule

    torch.set_num_threads(1)
    prec = {"float32": "fp32", "bfloat16": "bf16"}[dtype]
    cfg = compose_config([*SMALL, f"trainer.devices={world}", f"precision={prec}", "parallel.grad_bucket_size=5000"])
    derived = derive(cfg)
    ps = ParallelState.build(dp=world)
    module = LMModule(cfg, derived, ps)
    buffer = GradBuffer(module.model.parameters(), ps.dp_cp_group, cfg.parallel.grad_bucket_size, distributed=distributed)
    opt = module.build_optimizer(buffer)
    for p in module.model.parameters():
        p.main_grad.fill_(1e-3)
    buffer.finish()
    opt.step()
    opt.finish_param_gather()
    params = sum(p.numel() for p in module.model.parameters())
    return {"optimizer": opt.optimizer_bytes(), "main": opt.main_weight_bytes(), "params": params,
            "buckets": len(buffer.buckets)}


@pytest.mark.parametrize("dp,dtype", [(4, "float32"), (2, "bfloat16")])
def test_optimizer_state_is_one_dp_th(dp, dtype):
    plain = spawn_ranks(_state_bytes, dp, False, dtype)
    sharded = spawn_ranks(_state_bytes, dp, True, dtype)
    n = plain[0]["params"]
    # Plain: every rank holds Adam's two fp32 moments of every parameter (and fp32 main weights
    # for bf16); sharded: the ranks' shards partition them exactly.
    assert all(r["optimizer"] == 2 * 4 * n for r in plain.values())
    assert sum(r["optimizer"] for r in sharded.values()) == 2 * 4 * n
    # Each bucket is padded to a multiple of dp, so a shard exceeds n/dp by less than a bucket's padding.
    slack = 2 * 4 * sharded[0]["buckets"]
    for r in sharded.values():
        assert abs(r["optimizer"] - 2 * 4 * n / dp) <= slack
        if dtype == "bfloat16":
            assert plain[0]["main"] == 4 * n
            assert 4 * n / dp <= r["main"] <= 4 * math.ceil(n / dp) + 4 * sharded[0]["buckets"] * dp
        else:
            assert r["main"] == 0  # fp32 Adam updates the model's own (gathered) parameter buffer


@pytest.mark.parametrize("first,second", [("true", "false"), ("false", "true")])
def test_checkpoint_loads_across_optimizers(first, second, tmp_path):
    # Saved at dp2 by one optimizer, resumed at dp4 by the other (ZeRO-1 -> plain, plain -> ZeRO-1,
    # whose shards at dp4 differ from any dp2 ones): the optimizer state is stored whole and by
    # logical name, so the resumed steps equal an uninterrupted plain run.
    common = [*SMALL, "precision=fp64", "trainer.max_steps=6"]
    whole = run_training([*common, "trainer.devices=2"], tmp_path / "whole")
    ckpt = tmp_path / "ckpt"
    run_training([*common, "trainer.devices=2", "trainer.max_steps=3", f"optim.distributed_optimizer={first}",
                  f"checkpoint.dir={ckpt}"], tmp_path / "first")
    resumed = run_training([*common, "trainer.devices=4", f"optim.distributed_optimizer={second}",
                            f"checkpoint.dir={ckpt}"], tmp_path / "second")
    assert [int(r["step"]) for r in resumed] == [3, 4, 5]
    assert_same_trajectory(resumed, whole[3:], rel=1e-9, keys=("loss",))
