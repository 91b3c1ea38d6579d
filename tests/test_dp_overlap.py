"""parallel.overlap_grad_reduce: each data-parallel bucket reduces as soon as its grads are final,
under every pipeline schedule, and the result equals one process.

Four gloo ranks (started once) run pp2 x dp2 with 1F1B, interleaved 1F1B, interleaved zero-bubble
and ZB-V, each with and without the distributed optimizer, and pp1 x dp4 (m >= 2; pp2: m = 4), in
float64 with small buckets, recording every collective and every stage computation in one order
(``collectives.record_comm``). Order: with overlap on, every bucket's collective is issued before
the rank's last backward computation (B or W pass) ends, except the buckets holding the tied
embedding, which wait for its cross-stage sum; with overlap off none is (they all wait for the end
of the step), so the order check can fail. Exactness: per-step losses and gradient norms equal the
single-process run at 1e-9, with the overlap on and off.
"""

from __future__ import annotations

import pytest
import torch

from conftest import SMALL, StubGroup, compose_config, spawn_ranks, stub_groups

STEPS = 2
# Micro-batch 1, global batch 8: m = 4 at dp2 (8 in one process); buckets of a few thousand
# elements give every chunk several.
BASE = [*SMALL, "precision=fp64", "model.num_layers=4", "data.micro_batch_size=1", "parallel.grad_bucket_size=6000"]
PP2 = ["parallel.pipeline_parallel_size=2", "trainer.devices=4"]
SCHEDULES = {
    "1f1b": [],
    "interleaved_1f1b": ["parallel.virtual_pipeline_size=2", "parallel.pipeline_schedule=interleaved_1f1b"],
    "zero_bubble": ["parallel.virtual_pipeline_size=2", "parallel.pipeline_schedule=zero_bubble"],
    "zbv": ["parallel.virtual_pipeline_size=2", "parallel.pipeline_schedule=zbv"],
}
CASES = {"pp1_dp4": ["trainer.devices=4"], "pp1_dp4_no_overlap": ["trainer.devices=4", "parallel.overlap_grad_reduce=false"]}
for _name, _extra in SCHEDULES.items():
    CASES[f"{_name}"] = [*PP2, *_extra]
    CASES[f"{_name}_distopt"] = [*PP2, *_extra, "optim.distributed_optimizer=true"]
# Without overlap every schedule takes the same path (the buffer counts nothing): one suffices.
CASES["1f1b_no_overlap"] = [*PP2, "parallel.overlap_grad_reduce=false"]
DP_KINDS = ("dp_all_reduce", "dp_reduce_scatter")


def global_batch(step: int, samples: int = 8, seq: int = 32) -> dict:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, 500, (samples, seq + 1), generator=g)
    mask = (torch.rand(samples, seq, generator=g) > 0.2).double()
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": mask}


def bucket_order(recorder, buffer) -> dict:
    """How the step's data-parallel bucket collectives fall against the rank's last backward
    computation (a stage's B or W pass, or a pp1 backward), in the recorded order."""
    from megatron_hydra.parallel import collectives as C

    backward_ends = [order for label, order, _ in recorder.marks if label[0] in "BIW"]
    last = max(backward_ends)
    reduced = [e for e in recorder.events if e.kind in DP_KINDS]
    buckets = [b for b in buffer.buckets if C.group_size(b.group) > 1]
    tied = sum(any(getattr(p, "shared_embedding", False) for p in b.params) for b in buckets)
    return {"buckets": len(buckets), "tied": tied, "issued": len(reduced),
            "early": sum(e.order < last for e in reduced)}


def run_case(overrides, ps_of, steps: int = STEPS) -> dict:
    """``steps`` training steps of this rank through ``TrainStep``; the first one recorded."""
    from megatron_hydra.config import derive
    from megatron_hydra.parallel import collectives as C
    from megatron_hydra.training.module import LMModule
    from megatron_hydra.training.step import TrainStep
    from megatron_hydra.training.strategy import MegatronStrategy

    cfg = compose_config([*BASE, *overrides])
    derived = derive(cfg)
    ps = ps_of(derived)
    module = LMModule(cfg, derived, ps)
    strategy = MegatronStrategy(ps, torch.device("cpu"), grad_bucket_size=cfg.parallel.grad_bucket_size,
                                distributed_optimizer=cfg.optim.distributed_optimizer,
                                overlap_grad_reduce=cfg.parallel.overlap_grad_reduce)
    strategy.wrap_model(module)
    optimizer = module.build_optimizer(strategy.grad_buffer)

    def backward(loss):
        loss.backward()
        C.mark("B")  # as a pipeline stage marks its backward computations

    step = TrainStep(module, optimizer, backward=backward)
    share = derived.global_batch_size // derived.dp
    out = {"loss": [], "grad_norm": []}
    for s in range(steps):
        whole = global_batch(s, derived.global_batch_size)
        batch = {k: v[ps.dp_rank * share:(ps.dp_rank + 1) * share] for k, v in whole.items()}
        with C.record_comm() as recorder:
            result = step(batch, s)
        if s == 0:
            out["order"] = bucket_order(recorder, strategy.grad_buffer)
        out["loss"].append(result.loss.item())
        out["grad_norm"].append(result.grad_norm.item())
    optimizer.close()
    strategy.grad_buffer.close()
    return out


def _cases(rank, world):
    from megatron_hydra.parallel.state import ParallelState

    torch.set_num_threads(1)
    meshes = {}

    def ps_of(d):
        key = (d.pp, d.dp)
        if key not in meshes:  # collective: every rank builds the meshes in the same order
            meshes[key] = ParallelState.build(pp=d.pp, dp=d.dp)
        return meshes[key]

    return {name: run_case(overrides, ps_of) for name, overrides in CASES.items()}


@pytest.fixture(scope="module")
def ranks():
    return spawn_ranks(_cases, 4)


@pytest.fixture(scope="module")
def single():
    from megatron_hydra.parallel.state import ParallelState

    return run_case([], lambda d: ParallelState.single())


@pytest.mark.parametrize("case", list(CASES))
def test_equals_single_process(ranks, single, case):
    for result in ranks.values():
        for key in ("loss", "grad_norm"):
            assert result[case][key] == pytest.approx(single[key], rel=1e-9, abs=0), (case, key)


@pytest.mark.parametrize("case", list(CASES))
def test_buckets_reduce_before_the_last_backward_ends(ranks, case):
    for rank, result in ranks.items():
        order = result[case]["order"]
        assert order["issued"] == order["buckets"] > order["tied"], (rank, order)
        if case.endswith("_no_overlap"):  # every bucket waits for the end of the step
            assert order["early"] == 0, (rank, order)
        elif case.startswith("pp1"):  # one model: the embedding's grad is final in the last backward too
            assert order["early"] == order["buckets"], (rank, order)
        else:  # all but the tied embedding's, which wait for its cross-stage sum
            assert order["early"] == order["buckets"] - order["tied"], (rank, order)
    if not case.startswith("pp1"):  # the tied embedding's buckets exist (first and last stage)
        assert any(r[case]["order"]["tied"] for r in ranks.values())


def test_buffer_counts_armed_and_ready_parameters_and_finish_starts_the_rest():
    """One process, the reduce recorded instead of run: armed parameters start their bucket in the
    backward that reaches them, ``ready`` ones at once, one without a gradient waits for
    ``finish`` (nothing hangs); without overlap everything waits for ``finish``; ``finish``
    divides by dp x micro-batches."""
    from unittest import mock

    from megatron_hydra.parallel import collectives as C
    from megatron_hydra.parallel.data_parallel import GradBuffer

    class Done:
        def wait(self):
            return True

    for overlap in (True, False):
        a, b, c = (torch.nn.Parameter(torch.ones(3, dtype=torch.float64)) for _ in range(3))
        started = []
        with stub_groups(), mock.patch.object(C, "all_reduce_async", lambda view, *_: started.append(view) or Done()):
            buffer = GradBuffer([a, b, c], StubGroup(2, 0), bucket_size=1, overlap=overlap)  # a bucket each
            buffer.sync_enabled = False  # as under a pipeline schedule
            buffer.arm([a, b])
            (a * 2).sum().backward()  # b gets no gradient
            early = [v.data_ptr() for v in started]
            buffer.ready([c])
            early_ready = len(started)
            buffer.finish(microbatches=4)
        if overlap:
            assert early == [a.main_grad.data_ptr()] and early_ready == 2
        else:
            assert early == [] and early_ready == 0
        assert len(started) == 3
        assert torch.equal(a.main_grad, torch.full((3,), 2 / 8, dtype=torch.float64))
