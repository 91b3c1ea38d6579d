"""Fully sharded data parallelism (``parallel.data_parallel=fsdp``) equals one process, step by
step, and holds 1/dp of the parameters.

Each layout runs its steps through the real module, strategy and optimizer without a Trainer
(``training.step.TrainStep``), so that one spawned group can run several layouts in sequence; the reference
is the single process with the ``ddp`` path (``data_parallel=ddp``, no process group)."""

from __future__ import annotations

import pytest
import torch

from conftest import SMALL, compose_config, spawn_ranks

# Three steps: the forward and backward over the shards (step 0), an update of the shards (step 1)
# and one with AdamW's moments in use (step 2).
STEPS = 3
FSDP = ["parallel.data_parallel=fsdp"]
LAYOUTS = {  # name -> (world size, overrides)
    "dp2": (2, ["trainer.devices=2"]),
    "dp4": (4, ["trainer.devices=4"]),
    "tp2_dp2": (4, ["trainer.devices=4", "parallel=tp2", "parallel.sequence_parallel=true"]),
    "pp2_dp2": (4, ["trainer.devices=4", "parallel=pp2"]),
    "dp2_bf16": (2, ["trainer.devices=2", "precision=bf16"]),
    "dp2_fp16": (2, ["trainer.devices=2", "precision=fp16"]),
}


def _batch(samples: int, seq: int, first: int) -> dict:
    """Samples ``[first, first + samples)`` of the global batch every step trains on (a loss that
    falls shows the steps learn)."""
    data = torch.randint(0, 500, (8, seq + 1), generator=torch.Generator().manual_seed(0))[first:first + samples]
    return {"tokens": data[:, :-1], "labels": data[:, 1:], "loss_mask": torch.ones(samples, seq, dtype=torch.float32)}


def _run(overrides, ps_from=None, steps: int = STEPS):
    """Per step (loss, grad norm) of a SMALL float64 model, and the parameter bytes this rank holds."""
    from megatron_hydra.config import derive
    from megatron_hydra.parallel.fsdp import sharded_bytes
    from megatron_hydra.parallel.random import seed_model_parallel
    from megatron_hydra.parallel.state import ParallelState
    from megatron_hydra.training.module import LMModule
    from megatron_hydra.training.step import TrainStep
    from megatron_hydra.training.strategy import MegatronStrategy

    cfg = compose_config([*SMALL, "precision=fp64", *overrides])
    d = derive(cfg)
    ps = ParallelState.build(tp=d.tp, pp=d.pp, dp=d.dp) if ps_from is None else ps_from
    torch.manual_seed(cfg.seed + 100 * ps.pp_rank)
    seed_model_parallel(cfg.seed + 100 * ps.pp_rank, ps.tp_rank)
    module = LMModule(cfg, d, ps)
    strategy = MegatronStrategy(ps, torch.device("cpu"), grad_bucket_size=cfg.parallel.grad_bucket_size,
                                data_parallel=cfg.parallel.data_parallel)
    strategy.connect(module)
    strategy.wrap_model(module)
    optimizer = module.build_optimizer(strategy.grad_buffer)
    train_step = TrainStep(module, optimizer)
    local = d.global_batch_size // d.dp
    out = []
    for step in range(steps):
        result = train_step(_batch(local, cfg.model.seq_length, ps.dp_rank * local), step)
        out.append((float(result.loss), float(result.grad_norm)))
    optimizer.close()
    return out, sharded_bytes([module.model])


def _layouts(rank, world, names):
    """Each named layout with FSDP; ``ddp:<name>``: the layout with the default data parallelism."""
    torch.set_num_threads(1)
    return {name: _run([*LAYOUTS[name.split(":")[-1]][1], *(FSDP if ":" not in name else [])]) for name in names}



@pytest.fixture(scope="module")
def single():
    from megatron_hydra.parallel.state import ParallelState

    return _run([], ps_from=ParallelState.single())


@pytest.fixture(scope="module")
def two_ranks():
    return spawn_ranks(_layouts, 2, ["dp2", "dp2_bf16", "ddp:dp2_bf16", "dp2_fp16", "ddp:dp2_fp16"])


@pytest.fixture(scope="module")
def four_ranks():
    return spawn_ranks(_layouts, 4, ["dp4", "tp2_dp2", "pp2_dp2"])


@pytest.mark.parametrize("layout", ["dp2", "dp4", "tp2_dp2", "pp2_dp2"])
def test_fsdp_equals_single_process(layout, single, two_ranks, four_ranks):
    results = two_ranks if layout == "dp2" else four_ranks
    reference = single[0]
    for rank, per_layout in results.items():
        steps = per_layout[layout][0]
        assert len(steps) == len(reference) == STEPS
        for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(steps, reference)):
            assert loss == pytest.approx(ref_loss, rel=1e-9), f"rank {rank} step {step}: loss"
            assert norm == pytest.approx(ref_norm, rel=1e-9), f"rank {rank} step {step}: grad norm"
    assert reference[-1][0] < reference[0][0]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_16_bit_fsdp_equals_16_bit_ddp(precision, two_ranks):
    # fp32 shards computed in 16 bits and reduced in fp32 are the ddp path's 16-bit weights with
    # fp32 main copies and an fp32 grad buffer (fp16: the same loss scaling): the same first loss.
    # The grad norm sums squares over other partitions (per rank, then over ranks), and one 16-bit
    # rounding that a last-bit difference flips moves it (a bf16 or fp16 rounding step is 2^-8 or
    # 2^-11 of a value; measured on the norm: 1.3e-7 to 1.3e-4 depending on the initial weights).
    # The fp32 grads, summed in another order, differ in their last bits, and so do the updated
    # weights: once cast to 16 bits, a few of them round the other way, and later losses drift
    # (measured over five steps: up to 2.1e-6 by step 4, depending on the CPU's matmul kernels). The exact equality
    # of the two paths is the float64 tests' (1e-9).
    name = f"dp2_{precision}"
    for per_layout in two_ranks.values():
        steps, ref_steps = per_layout[name][0], per_layout[f"ddp:{name}"][0]
        assert len(steps) == len(ref_steps) == STEPS
        for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(steps, ref_steps)):
            assert loss == pytest.approx(ref_loss, rel=1e-6 if step == 0 else 2e-5), f"step {step}: loss"
            assert norm == pytest.approx(ref_norm, rel=1e-3), f"step {step}: grad norm"


def test_fsdp_dp4_holds_a_quarter_of_the_parameters(single, four_ranks):
    whole = single[1]
    held = [per_layout["dp4"][1] for per_layout in four_ranks.values()]
    assert sum(held) == whole  # the shards partition the parameters
    for b in held:
        assert b == pytest.approx(whole / 4, rel=0.05)


@pytest.mark.parametrize("overrides,names", [
    (["parallel.data_parallel=zero3"], "parallel.data_parallel='zero3'"),
    (["optim.distributed_optimizer=true"], "optim.distributed_optimizer=false"),
    (["parallel=pp2", "parallel.pipeline_schedule=zero_bubble"], "parallel.pipeline_schedule=1f1b"),
    (["model.transformer_impl=transformer_engine"], "model.transformer_impl=local"),
])
def test_config_errors_are_one_line(overrides, names):
    from megatron_hydra.config import derive
    from megatron_hydra.errors import ConfigError

    cfg = compose_config([*SMALL, "trainer.devices=4", *FSDP, *overrides])
    with pytest.raises(ConfigError) as err:
        derive(cfg)
    assert "\n" not in str(err.value) and names in str(err.value)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_memory_plan_against_analytic_count(precision):
    from megatron_hydra.config import derive
    from megatron_hydra.planning.memory import rank_memory

    # SMALL at dp4, one micro-batch per rank: h=64, 2 layers, vocabulary padded to 512, 32 positions.
    cfg = compose_config([*SMALL, "trainer.devices=4", "data.global_batch_size=8", "data.micro_batch_size=2",
                          f"precision={precision}", "mode=plan", "parallel.data_parallel=fsdp"])
    row = rank_memory(cfg, derive(cfg), 0)
    h, layers, vocab, positions = 64, 2, 512, 32
    block = 12 * h * h + 13 * h  # QKV, projection, fc1, fc2 with biases, two layer norms
    root = vocab * h + positions * h + 2 * h  # embeddings and the final norm (the head is tied)
    n = layers * block + root
    s = n // 4  # every row count divides by 4: no padding
    gathered = (root + 2 * block) * (4 if precision == "fp32" else 2) + (root + block) * 4  # fp32 grads
    if precision == "fp32":
        expected = (4 * s, 4 * s, 0, 8 * s, gathered)
    else:  # the fp32 shards are the main weights; the gathered copies are bf16, the grads fp32
        expected = (0, 4 * s, 4 * s, 8 * s, gathered)
    assert row.params == n
    assert (row.weight_bytes, row.grad_bytes, row.main_weight_bytes, row.optimizer_bytes, row.gathered_bytes) == expected


def test_checkpoints_move_between_fsdp_and_the_other_modes(tmp_path):
    # Three legs of one float64 run, each resuming the last one's checkpoint in another layout:
    # ZeRO-1 tp2 x dp2 (steps 0-1) -> FSDP dp4 (2-3) -> one process (4-5). Every rank writes and
    # reads only its own pieces (FSDP: its rows), so the legs together equal the run in one process.
    # Two steps a leg: its first step starts from the loaded weights and optimizer state, its second
    # from its own update.
    from conftest import assert_same_trajectory, run_training

    schedule = [*SMALL, "precision=fp64", "optim.decay_steps=6"]  # the same learning rates in every leg
    common = [*schedule, f"checkpoint.dir={tmp_path / 'ckpt'}"]
    whole = run_training([*schedule, "trainer.max_steps=6", "checkpoint.save_last=false"], tmp_path / "whole")
    first = run_training([*common, "trainer.max_steps=2", "trainer.devices=4", "parallel=tp2",
                          "optim.distributed_optimizer=true"], tmp_path / "zero1")
    second = run_training([*common, "trainer.max_steps=4", "trainer.devices=4", *FSDP], tmp_path / "fsdp")
    third = run_training([*common, "trainer.max_steps=6", "checkpoint.save_last=false"], tmp_path / "single")
    assert [int(r["step"]) for r in second] == [2, 3] and [int(r["step"]) for r in third] == [4, 5]
    assert_same_trajectory(first + second + third, whole, rel=1e-9, keys=("loss", "grad_norm"))
