"""``trainer.compile``: every transformer block compiled on its own (``models.compile``) trains to
the losses of the eager single-process run in float64 (1e-9), in one process and at tp2 + SP, pp2,
full recompute, cp2 and dp2 with the distributed optimizer; one graph serves every layer; evaluation and generation run eagerly; what
it cannot compile is refused in one line. The one-process runs use the ``aot_eager`` backend
(dynamo's trace and AOT autograd's forward/backward partition, torch's own kernels); the layouts,
whose difference is where dynamo breaks the graph around collectives, use the ``eager`` backend
(dynamo's trace alone), since every compile costs seconds of CPU. Inductor's generated code (a
C++ compile per kernel, seconds each here) is held to eager by ``benchmarks/compile.py``, which
prints its largest loss difference."""

from __future__ import annotations

import logging

import pytest
import torch

from conftest import SMALL, compose_config, run_training, spawn_ranks
from megatron_hydra.errors import ConfigError

STEPS, TOL = 3, 1e-9
BASE = [*SMALL, "precision=fp64", "model.num_layers=4", "model.seq_length=16", "model.vocab_size=128",
        "model.position_embedding=rope", "model.normalization=rmsnorm", "model.activation=swiglu",
        "model.num_query_groups=2", "data.global_batch_size=4", "optim.lr=1e-3", "optim.warmup_steps=0",
        f"trainer.max_steps={STEPS}", "trainer.devices=1"]
COMPILED = ["trainer.compile=true", "trainer.compile_backend=aot_eager"]
TRACED = ["trainer.compile=true", "trainer.compile_backend=eager"]
LAYOUTS = {
    "tp2_sp_recompute_full": ["parallel.tensor_parallel_size=2", "parallel.sequence_parallel=true",
                              "recompute.granularity=full", "recompute.num_layers=2"],
    "pp2": ["parallel.pipeline_parallel_size=2"],
    "cp2": ["parallel.context_parallel_size=2"],
    # The optimizer's forward pre-hooks (waiting for a module's parameter all-gather) stay out of
    # the compiled graphs; one parameter a bucket, so the gathers are many and still pending at the
    # forward (with overlap_param_gather=false the step waits for them all: no hook has one to wait for).
    "dp2_distopt_overlap": ["optim.distributed_optimizer=true", "parallel.overlap_param_gather=true",
                            "parallel.grad_bucket_size=1"],
}


def _batch(derived, ps):
    """This rank's share of the one global batch every step trains on."""
    from megatron_hydra.data.sequence_shards import shard_batch

    gen = torch.Generator().manual_seed(100)
    shape = (derived.global_batch_size, derived.transformer.seq_length)
    tokens, labels = (torch.randint(0, 128, shape, generator=gen) for _ in range(2))
    batch = {"tokens": tokens, "labels": labels, "loss_mask": torch.ones(shape)}
    share = {k: v.chunk(ps.dp_size)[ps.dp_rank] for k, v in batch.items()}
    return shard_batch(share, ps.cp_size, ps.cp_rank)


def _train(overrides, world: int = 1):
    """``STEPS`` training steps (forward, backward, optimizer step) through ``LMModule``, which
    compiles the blocks when the config says so; the losses and how many compiled calls ran."""
    from megatron_hydra.config import derive
    from megatron_hydra.parallel.state import ParallelState
    from megatron_hydra.training.module import LMModule
    from megatron_hydra.training.step import TrainStep
    from megatron_hydra.training.strategy import MegatronStrategy

    cfg = compose_config([*BASE, *overrides, f"trainer.devices={world}"])
    derived = derive(cfg)
    ps = ParallelState.single() if world == 1 else ParallelState.build(
        tp=derived.tp, pp=derived.pp, dp=derived.dp, cp=derived.cp)
    module = LMModule(cfg, derived, ps)
    strategy = MegatronStrategy(ps, torch.device("cpu"), grad_bucket_size=cfg.parallel.grad_bucket_size)
    strategy.wrap_model(module)
    optimizer = module.build_optimizer(strategy.grad_buffer)
    step, batch = TrainStep(module, optimizer), _batch(derived, ps)
    losses = [float(step(batch, s).loss) for s in range(STEPS)]
    optimizer.close()
    strategy.grad_buffer.close()
    clock = module.compile_clock
    return {"losses": losses, "calls": 0 if clock is None else clock.compiled.calls,
            "blocks": 0 if clock is None else len(clock.compiled.blocks)}


def _compiled_layouts(rank, world):
    torch.set_num_threads(1)
    results = {}
    for layout, overrides in LAYOUTS.items():
        torch.compiler.reset()  # each layout compiles afresh
        results[layout] = _train([*TRACED, *overrides], world)
    return results


@pytest.fixture(scope="module")
def eager():
    return _train([])


@pytest.fixture(scope="module")
def ranks():
    return spawn_ranks(_compiled_layouts, 2)


def _assert_same_losses(losses, reference):
    assert all(b < a for a, b in zip(reference, reference[1:]))  # it trains
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, reference)) < TOL, (losses, reference)


def test_compiled_equals_eager_one_process(eager):
    """Without recompute, then with full recompute: one graph serves every layer; the blocks inside
    checkpoints (run under its saved-tensor hooks) get a second graph, which every replay reuses."""
    from torch._dynamo.utils import counters

    torch.compiler.reset()
    counters.clear()
    for recompute in ([], ["recompute.granularity=full", "recompute.num_layers=1"]):
        ours = _train([*COMPILED, *recompute])
        assert ours["blocks"] == 4 and ours["calls"] == 4 * 2 * STEPS * (2 if recompute else 1)  # 2 micro-batches
        assert counters["stats"]["unique_graphs"] == (2 if recompute else 1)
        _assert_same_losses(ours["losses"], eager["losses"])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_compiled_layout_equals_eager_one_process(ranks, eager, layout):
    results = [ranks[r][layout] for r in (0, 1)]
    assert all(r["calls"] > 0 for r in results)
    _assert_same_losses(results[-1]["losses"], eager["losses"])  # the last pipeline stage's


def test_compiled_with_distributed_optimizer_through_the_launcher(tmp_path):
    """The distributed optimizer's forward pre-hooks (waiting for a module's parameter gather) run
    outside the compiled graphs: traced into them, the launcher's run trained to other losses
    (4.7825 against 4.8059 at the first step) even in one process, with no gather pending."""
    torch.compiler.reset()
    run = [*BASE, "optim.distributed_optimizer=true", "trainer.max_steps=2"]
    eager = [r["loss"] for r in run_training(run, tmp_path / "eager")]
    ours = [r["loss"] for r in run_training([*run, *TRACED], tmp_path / "compiled")]
    assert len(ours) == 2 and max(abs(a - b) / abs(b) for a, b in zip(ours, eager)) < TOL, (ours, eager)


def _saved_bytes(overrides, backend=None) -> int:
    """Bytes autograd keeps for backward after one training forward of the ``BASE`` model."""
    from megatron_hydra.config import derive
    from megatron_hydra.models.compile import compile_blocks
    from megatron_hydra.models.stages import build_model
    from megatron_hydra.parallel.state import ParallelState

    cfg = compose_config([*BASE, *overrides])
    model = build_model(cfg, derive(cfg), ParallelState.single(), "cpu").train()
    if backend is not None:
        compile_blocks(model, backend)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.untyped_storage()) or t, lambda t: t):
        model(tokens, tokens)
    return sum({s.data_ptr(): s.nbytes() for s in saved}.values())


def test_recompute_frees_compiled_blocks():
    """Under full recompute a compiled block keeps what an eager one keeps: its input alone."""
    recompute = ["recompute.granularity=full", "recompute.num_layers=1"]
    eager = _saved_bytes(recompute)
    assert _saved_bytes(recompute, "aot_eager") == eager < _saved_bytes([])


def test_evaluation_and_generation_run_eagerly():
    """Outside training (eval mode, or a KV cache) a block takes its eager forward: dynamo never
    sees the other lengths of validation, generation or lm-evaluation-harness."""
    from megatron_hydra.config import derive
    from megatron_hydra.models.compile import compile_blocks
    from megatron_hydra.models.stages import build_model
    from megatron_hydra.parallel.state import ParallelState

    cfg = compose_config([*BASE, "model.num_layers=2"])
    model = build_model(cfg, derive(cfg), ParallelState.single(), "cpu").eval()
    blocks = compile_blocks(model, "aot_eager")
    with torch.no_grad():
        for length in (3, 5, 7):
            model(torch.zeros(1, length, dtype=torch.int64))
    assert blocks.calls == 0


def test_dry_run_runs_eagerly_and_says_so(caplog):
    from megatron_hydra.training.compile import compile_for_training

    cfg = compose_config([*BASE, *COMPILED, "mode=dry_run"])
    with caplog.at_level(logging.INFO, logger="megatron_hydra"):
        assert compile_for_training(cfg, torch.nn.Linear(1, 1), talk=True) is None
    assert "the dry run runs the blocks eagerly" in caplog.text


def test_cold_compile_time_is_logged_once(caplog):
    from megatron_hydra.models.compile import CompiledBlocks
    from megatron_hydra.training.compile import CompileClock

    clock = CompileClock(CompiledBlocks("aot_eager"), talk=True)
    with caplog.at_level(logging.INFO, logger="megatron_hydra"):
        for _ in range(4):
            clock.start()
            clock.stop()
    assert clock.cold_s is not None and caplog.text.count("compiled 0 blocks (aot_eager) in") == 1


@pytest.mark.parametrize("override, key", [
    (["recompute.granularity=selective"], "recompute.granularity"),
    (["model=moe_tiny"], "model.moe"),
    (["model=bert_base"], "model.arch"),
    (["model.transformer_impl=transformer_engine"], "model.transformer_impl"),
    (["trainer.compile_backend=cudagraphs"], "trainer.compile_backend"),
])
def test_refused_combinations_name_the_key(override, key):
    from megatron_hydra.config import derive

    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as err:
        derive(compose_config([*BASE, *COMPILED, *override]))
    assert "\n" not in str(err.value)
