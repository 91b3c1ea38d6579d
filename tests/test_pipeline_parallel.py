"""Pipeline parallelism equals one process: every schedule, with TP, SP and DP around it.

References are independent of the pipeline code: the single-process run (per-step losses, grad
norms and validation losses over 10 steps in float64, to 1e-9), the analytic 1F1B memory bound
(at most pp micro-batches in flight on the first stage, where GPipe would hold all of them), and
the tied-embedding invariant (the first and last stage's copies stay bitwise equal).
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import SMALL, assert_same_trajectory, compose_config, run_training, spawn_ranks
from megatron_hydra.parallel.pipeline import stage_indices, stage_layers

STEPS = 10
# No final checkpoint (nothing reads it; checkpoint tests cover saving).
QUICK = ["checkpoint.save_last=false"]
BASE = [*SMALL, *QUICK, "precision=fp64", f"trainer.max_steps={STEPS}", "model.num_layers=4",
        "trainer.val_check_interval=5", "trainer.limit_val_batches=2"]
PP2 = ["parallel=pp2", "trainer.devices=2"]

# Each schedule at least once; the 8-rank layouts (tp2 x pp2 x dp2) cover TP, SP and DP with the
# plain and the zero-bubble schedule (whose split backward must keep TP collectives matched).
LAYOUTS = [
    pytest.param(PP2, id="pp2_1f1b"),
    pytest.param(["parallel=pp4", "trainer.devices=4"], id="pp4_1f1b"),
    pytest.param([*PP2, "parallel.virtual_pipeline_size=2", "parallel.pipeline_schedule=interleaved_1f1b"],
                 id="pp2_vpp2_interleaved"),
    pytest.param([*PP2, "parallel.pipeline_schedule=zero_bubble", "parallel.layers_per_stage=[1,3]"],
                 id="pp2_zero_bubble_uneven_split"),
    pytest.param([*PP2, "parallel.virtual_pipeline_size=2", "parallel.pipeline_schedule=zbv"], id="pp2_zbv"),
    pytest.param(["parallel=tp2_pp2", "trainer.devices=8"], id="tp2_pp2_dp2_1f1b"),
    pytest.param(["parallel=tp2_pp2", "trainer.devices=8", "parallel.sequence_parallel=true",
                  "parallel.tp_comm_overlap=true", "parallel.virtual_pipeline_size=2",
                  "parallel.pipeline_schedule=zero_bubble"],
                 id="tp2_pp2_dp2_sp_vpp2_zero_bubble"),
]


def _split(rows):
    return [r for r in rows if "loss" in r], [r for r in rows if "val_loss" in r]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return _split(run_training(BASE, tmp_path_factory.mktemp("single")))


@pytest.mark.parametrize("overrides", LAYOUTS)
def test_pipeline_losses_equal_single_process(single, overrides, tmp_path):
    train, val = _split(run_training([*BASE, *overrides], tmp_path))
    ref_train, ref_val = single
    assert [r["step"] for r in train] == [r["step"] for r in ref_train] == list(range(STEPS))
    assert_same_trajectory(train, ref_train, rel=1e-9)
    assert len(val) == len(ref_val) == 2
    assert_same_trajectory(val, ref_val, rel=1e-9, keys=("val_loss",))
    assert train[-1]["loss"] < train[0]["loss"]


def test_untied_embeddings_pp2(tmp_path):
    # No embedding copy on the last stage: it owns output_weight; nothing is summed across stages.
    untied = [*BASE, "model.tie_embeddings=false"]
    ref, _ = _split(run_training(untied, tmp_path / "single"))
    ours, _ = _split(run_training([*untied, *PP2], tmp_path / "pp2"))
    assert len(ref) == STEPS
    assert_same_trajectory(ours, ref, rel=1e-9)


@pytest.mark.parametrize("pp,vpp,schedule", [(4, 1, "1f1b"), (2, 2, "interleaved_1f1b"), (4, 2, "zbv")])
def test_stages_cover_every_layer_once(pp, vpp, schedule):
    per_stage = [1, 2, 3, 1, 2, 1, 1, 3][: pp * vpp]
    held = sorted(layer for rank in range(pp) for stage in stage_indices(rank, pp, vpp, schedule)
                  for layer in stage_layers(per_stage, stage))
    assert held == list(range(sum(per_stage)))
    if schedule == "zbv":  # the V: rank 0 holds the first and the last stage
        assert stage_indices(0, pp, vpp, schedule) == [0, 2 * pp - 1]
    else:  # Megatron's interleaving: chunk c of rank p is virtual stage c * pp + p
        assert stage_indices(1, pp, vpp, schedule) == [c * pp + 1 for c in range(vpp)]


def _train_and_inspect(rank, world, overrides, run_dir):
    """Train through Lightning as train.py does; return the tied embedding copies before and
    after, and the order of forward/backward computations of this rank's stages."""
    import torch

    from megatron_hydra.config import derive
    from megatron_hydra.parallel.state import ParallelState
    from megatron_hydra.training.module import LMModule
    from megatron_hydra.training.strategy import MegatronStrategy
    from megatron_hydra.training.train import build_dataloaders, build_trainer

    torch.set_num_threads(1)
    cfg = compose_config(overrides, run_dir)
    derived = derive(cfg)
    ps = ParallelState.build(tp=derived.tp, pp=derived.pp, dp=derived.dp)
    module = LMModule(cfg, derived, ps)
    tied = [p for chunk in module.model for p in chunk.parameters() if getattr(p, "shared_embedding", False)]
    before = [p.detach().numpy().copy() for p in tied]
    module.pipeline.events = []
    strategy = MegatronStrategy(ps, torch.device("cpu"), grad_bucket_size=cfg.parallel.grad_bucket_size)
    train_loader, _ = build_dataloaders(cfg, derived, ps)
    build_trainer(cfg, derived, strategy, rank).fit(module, train_dataloaders=train_loader)
    return {
        "pp_rank": ps.pp_rank,
        "before": before,
        "after": [p.detach().numpy().copy() for p in tied],
        "events": [(stage, kind, mb) for stage, kind, mb, _, _ in module.pipeline.events],
    }


def _max_in_flight(events, stage):
    """Most micro-batches whose forward ran on ``stage`` and whose backward has not."""
    live = peak = 0
    for s, kind, _ in events:
        if s == stage:
            live += {"F": 1, "B": -1}.get(kind, 0)
            peak = max(peak, live)
    return peak


@pytest.mark.parametrize("pp,extra", [
    (4, []),
    (2, ["parallel.virtual_pipeline_size=2", "parallel.pipeline_schedule=zbv"]),  # both copies on rank 0
], ids=["pp4_1f1b", "pp2_zbv"])
def test_tied_embedding_copies_stay_bitwise_equal_and_1f1b_memory_bound(pp, extra, tmp_path):
    # Three steps: the copies must match after every update, which the second and third show as
    # well as a tenth; the first stage's peak is reached within each step.
    steps = 3
    micro = 8  # micro-batches per step: GPipe would keep all 8 in flight on stage 0, 1F1B only pp
    overrides = [*SMALL, *QUICK, "precision=fp64", f"trainer.max_steps={steps}", "model.num_layers=4",
                 f"parallel.pipeline_parallel_size={pp}", f"trainer.devices={pp}", "data.micro_batch_size=1",
                 f"data.global_batch_size={micro}", *extra]
    results = spawn_ranks(_train_and_inspect, pp, overrides, str(tmp_path))
    copies = [(r["before"][i], r["after"][i]) for r in results.values() for i in range(len(r["after"]))]
    assert len(copies) == 2  # one on the first stage, one on the last
    (first_before, first_after), (last_before, last_after) = copies
    assert np.array_equal(first_before, last_before)
    assert not np.array_equal(first_before, first_after)  # it trained
    assert np.array_equal(first_after, last_after)  # bitwise
    if not extra:
        first = next(r for r in results.values() if r["pp_rank"] == 0)
        last = next(r for r in results.values() if r["pp_rank"] == pp - 1)
        assert sum(kind == "F" for _, kind, _ in first["events"]) == steps * micro
        assert _max_in_flight(first["events"], 0) == pp
        assert _max_in_flight(last["events"], pp - 1) == 1


def test_unsupported_torch_pipelining_is_one_line(monkeypatch):
    """The adapter names what a torch release lacks, in one line, before building a schedule."""
    from megatron_hydra.errors import ConfigError
    from megatron_hydra.parallel import pipeline_runtime

    pipeline_runtime.check_supported()  # this torch has everything
    monkeypatch.setattr(pipeline_runtime, "_STAGE_METHODS", ("forward_one_chunk", "renamed_in_a_later_torch"))
    with pytest.raises(ConfigError, match=r"lacks renamed_in_a_later_torch: install a supported torch") as e:
        pipeline_runtime.check_supported()
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("schedule,vpp", [("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 4)])
@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_schedule_bubble_counts_equal_narayanan(schedule, vpp, pp, m):
    """The bubble counted from torch's own action order with unit costs (F 1, B 2) is Narayanan
    et al.'s (p - 1) / m for 1F1B and (p - 1) / (v m) interleaved, on every rank."""
    from megatron_hydra.planning.schedule_bubble import schedule_bubble

    expected = (pp - 1) / (vpp * m)
    assert schedule_bubble(schedule, pp, vpp, m).idle_over_busy == pytest.approx([expected] * pp, abs=1e-12)


@pytest.mark.parametrize("pp,m", [(4, 8), (4, 16)])
def test_zero_bubble_schedules_count_less_bubble_than_interleaved(pp, m):
    """Splitting the backward into input and weight halves fills the interleaved schedule's bubble
    (Qi et al. 2024): torch's interleaved zero-bubble and ZB-V orders both count less."""
    from megatron_hydra.planning.schedule_bubble import schedule_bubble, simulate

    interleaved = schedule_bubble("interleaved_1f1b", pp, 2, m).mean
    assert schedule_bubble("zero_bubble", pp, 2, m).mean < interleaved
    assert schedule_bubble("zbv", pp, 2, m).mean < interleaved
    with pytest.raises(RuntimeError, match="deadlocks"):  # a backward before its forward never runs
        simulate({0: [("B", 0, 0), ("F", 0, 0)]}, 1)
