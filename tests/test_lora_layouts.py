"""LoRA training at every layout equals one process, with the base frozen.

A Llama-form model (rotary, RMSNorm, SwiGLU, grouped-query attention) in float64 with adapters on
every layer trains three optimizer steps, through the run's own step (``training.step.TrainStep``
over ``LMModule``, the strategy's gradient buffer and ``MegatronOptimizer``), on the same global
batches at each layout: tp2 with sequence parallelism, tp2 with full recomputation, pp2 under 1F1B
and under the interleaved schedule, dp2 with the distributed optimizer, and cp2. The reference is
the same steps in this process (tp = pp = dp = cp = 1): per-step losses and the adapter weights
after the steps agree to 1e-9. At every layout the base weights end bitwise as they started, no
base parameter has a gradient or a gradient buffer, and the optimizer holds state for the adapter
tensors alone. LoRA with FSDP is a one-line ConfigError.
"""

from __future__ import annotations

import pytest
import torch

from conftest import SMALL, compose_config, spawn_ranks

STEPS, TOL = 3, 1e-9
BASE = [*SMALL, "precision=fp64", "model.num_layers=4", "model.seq_length=16", "model.vocab_size=128",
        "model.position_embedding=rope", "model.normalization=rmsnorm", "model.activation=swiglu",
        "model.num_query_groups=2", "model.add_bias_linear=false", "model.tie_embeddings=false",
        "data.global_batch_size=4", "peft=lora", "peft.rank=4", "peft.alpha=8", "optim.lr=1e-2", "optim.warmup_steps=0",
        f"trainer.max_steps={STEPS}", "trainer.devices=1"]
LAYOUTS = {
    "tp2_sp": ["parallel.tensor_parallel_size=2", "parallel.sequence_parallel=true"],
    "tp2_recompute_full": ["parallel.tensor_parallel_size=2", "recompute.granularity=full"],
    "pp2_1f1b": ["parallel.pipeline_parallel_size=2"],
    "pp2_interleaved": ["parallel.pipeline_parallel_size=2", "parallel.virtual_pipeline_size=2",
                        "parallel.pipeline_schedule=interleaved_1f1b"],
    "pp2_zero_bubble": ["parallel.pipeline_parallel_size=2", "parallel.virtual_pipeline_size=2",
                        "parallel.pipeline_schedule=zero_bubble"],
    "pp2_zbv": ["parallel.pipeline_parallel_size=2", "parallel.virtual_pipeline_size=2", "parallel.pipeline_schedule=zbv"],
    "dp2_distributed_optimizer": ["optim.distributed_optimizer=true"],
    "cp2": ["parallel.context_parallel_size=2"],
}


def _global_batch(derived):
    """The global batch every step trains on (so that the loss falls): random tokens and labels,
    the first tokens of each sample outside the loss."""
    gen = torch.Generator().manual_seed(100)
    shape = (derived.global_batch_size, derived.transformer.seq_length)
    loss_mask = torch.ones(shape, dtype=torch.float32)
    loss_mask[:, :3] = 0.0
    tokens, labels = (torch.randint(0, 128, shape, generator=gen) for _ in range(2))
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask}


def _rank_batch(batch, ps):
    """This data-parallel rank's contiguous share of the samples, this context-parallel rank's chunks."""
    from megatron_hydra.data.sequence_shards import shard_batch

    share = {k: v.chunk(ps.dp_size)[ps.dp_rank] for k, v in batch.items()}
    return shard_batch(share, ps.cp_size, ps.cp_rank)


def _gather(t, dim, group):
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _train(layout, world):
    """Three steps at ``layout`` (None: one process); returns what the tests compare."""
    from megatron_hydra.config import derive
    from megatron_hydra.parallel.state import ParallelState
    from megatron_hydra.training.module import LMModule
    from megatron_hydra.training.step import TrainStep, model_chunks
    from megatron_hydra.training.strategy import MegatronStrategy

    overrides = [*BASE] if layout is None else [*BASE, *LAYOUTS[layout], f"trainer.devices={world}"]
    cfg = compose_config(overrides)
    derived = derive(cfg)
    ps = ParallelState.single() if layout is None else ParallelState.build(
        tp=derived.tp, pp=derived.pp, dp=derived.dp, cp=derived.cp)
    module = LMModule(cfg, derived, ps)
    strategy = MegatronStrategy(ps, torch.device("cpu"), grad_bucket_size=cfg.parallel.grad_bucket_size,
                                distributed_optimizer=cfg.optim.distributed_optimizer)
    strategy.wrap_model(module)
    optimizer = module.build_optimizer(strategy.grad_buffer)
    params = [(n, p) for chunk in model_chunks(module.model) for n, p in chunk.named_parameters()]  # logical names
    base_before = {n: p.detach().clone() for n, p in params if not getattr(p, "lora", False)}
    step = TrainStep(module, optimizer)
    batch = _rank_batch(_global_batch(derived), ps)
    losses = [float(step(batch, s).loss) for s in range(STEPS)]
    adapters, base_changed, base_with_grads = {}, [], []
    for name, p in params:
        if getattr(p, "lora", False):
            dim = p.tp_partition_dim
            whole = dim is None or ps.tp_size == 1
            adapters[name] = p.detach().clone() if whole else _gather(p.detach(), dim, ps.tp_group)
        else:
            base_changed += [] if torch.equal(p.detach(), base_before[name]) else [name]
            if p.requires_grad or p.grad is not None or getattr(p, "main_grad", None) is not None:
                base_with_grads.append(name)
    adapter_params = [p for _, p in params if getattr(p, "lora", False)]
    state, pieces = optimizer.state, optimizer.pieces
    optimizer.close()
    strategy.grad_buffer.close()
    return {"losses": losses, "adapters": adapters, "base_changed": base_changed, "base_with_grads": base_with_grads,
            "adapter_params": len(adapter_params), "adapter_elements": sum(p.numel() for p in adapter_params),
            "params": len(params), "distributed": cfg.optim.distributed_optimizer,
            "buffer_holds_adapters_alone": all(getattr(p, "lora", False) for p in strategy.grad_buffer.params),
            "state_of_adapters_alone": all(getattr(pc.param, "lora", False) for pc in pieces)
            and {id(pc.main) for pc in pieces} == {id(k) for k in state} and len(state) == len(pieces),
            "state_keys": sorted({k for s in state.values() for k in s}),
            "moment_elements": sum(t.numel() for s in state.values() for k, t in s.items() if k.startswith("exp_avg"))}


def _all_layouts(rank, world):
    torch.set_num_threads(1)
    return {layout: _train(layout, world) for layout in LAYOUTS}


@pytest.fixture(scope="module")
def runs():
    """{layout: [each rank's result]}, every layout from one start of two ranks; None: one process."""
    ranks = spawn_ranks(_all_layouts, 2)
    out = {layout: [ranks[r][layout] for r in (0, 1)] for layout in LAYOUTS}
    out[None] = [_train(None, 1)]
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_losses_and_adapters_equal_one_process(runs, layout):
    ref = runs[None][0]
    assert all(b < a for a, b in zip(ref["losses"], ref["losses"][1:]))  # it trains
    results = runs[layout]
    losses = results[-1]["losses"]  # the last pipeline stage's (every rank's, elsewhere)
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref["losses"])) < TOL, (losses, ref["losses"])
    adapters = {name: t for r in results for name, t in r["adapters"].items()}  # pp: each stage its layers
    assert sorted(adapters) == sorted(ref["adapters"])
    worst = max(float((adapters[n] - t).abs().max()) for n, t in ref["adapters"].items())
    assert worst < TOL, worst
    assert all(t.any() for n, t in ref["adapters"].items())  # B started at zero: every adapter trained


@pytest.mark.parametrize("layout", [None, *LAYOUTS])
def test_base_frozen_and_optimizer_holds_adapters_alone(runs, layout):
    results = runs[layout]
    for r in results:
        assert r["adapter_params"] > 0 and r["params"] > r["adapter_params"]
        assert not r["base_changed"], r["base_changed"]
        assert not r["base_with_grads"], r["base_with_grads"]
        assert r["buffer_holds_adapters_alone"] and r["state_of_adapters_alone"]
        assert {"exp_avg", "exp_avg_sq"} <= set(r["state_keys"])
    if results[0]["distributed"]:  # the two ranks' shards partition Adam's moments of the adapters
        assert sum(r["moment_elements"] for r in results) == 2 * results[0]["adapter_elements"]
    else:
        assert all(r["moment_elements"] == 2 * r["adapter_elements"] for r in results)


def test_lora_with_fsdp_is_one_line():
    from megatron_hydra.config import derive
    from megatron_hydra.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        derive(compose_config([*BASE, "trainer.devices=2", "parallel.data_parallel=fsdp"]))
    message = str(info.value)
    assert "parallel.data_parallel=fsdp" in message and "peft=lora" in message and "\n" not in message
