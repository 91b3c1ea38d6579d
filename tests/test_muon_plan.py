"""optim=muon in the plans: its state in the memory plan, its step's transient and TP all-gathers in
the dry run, its Newton-Schulz FLOPs, and the planner's step time.

References: the parameter shapes written out here from the model config (Muon's matrices per layer),
torch's own FLOP counter over the optimizer's Newton-Schulz, and the dry run's real step on the
fake GPU (its measured bytes and the all-gathers it issues).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from conftest import compose_config
from megatron_hydra.config import derive
from megatron_hydra.config.schema import ClusterConfig
from megatron_hydra.parallel import collectives
from megatron_hydra.parallel.muon import newton_schulz
from megatron_hydra.planning import muon
from megatron_hydra.planning.layouts import plan_layouts
from megatron_hydra.planning.memory import plan_memory
from megatron_hydra.planning.performance import CALIBRATED, Layout, estimate
from megatron_hydra.training import dry_run as D

H100_NODE = ClusterConfig(name="h100_x8", gpu="H100-SXM5-80GB", gpus_per_node=8, num_nodes=1, peak_tflops=989.0,
                          memory_gb=80.0, hbm_gb_per_s=3350.0, nvlink_gb_per_s=450.0, ib_gb_per_s=50.0)


def _plans(*overrides):
    """(AdamW's plan, Muon's plan, Muon's config and derived values) of the same layout."""
    adam = compose_config(list(overrides))
    cfg = compose_config([*overrides, "optim=muon"])
    derived = derive(cfg)
    return plan_memory(adam, derive(adam)), plan_memory(cfg, derived), cfg, derived


def _muon_elements_per_layer(tc) -> int:
    """Muon's matrices of one dense layer, from the config: QKV, the output projection, the MLP."""
    h, d, a, g, f = tc.hidden_size, tc.kv_channels, tc.num_attention_heads, tc.num_query_groups, tc.ffn_hidden_size
    mlp = (3 if tc.activation in ("swiglu", "geglu") else 2) * h * f
    return h * (a + 2 * g) * d + a * d * h + mlp


@pytest.mark.parametrize("overrides", [
    ("model=gpt_tiny",),
    ("model=gpt_tiny", "parallel=tp2", "trainer.devices=2"),
    ("model=gpt_tiny", "parallel=pp2", "trainer.devices=2", "precision=bf16"),
    ("model=llama3.2_1b", "model.num_layers=4", "parallel=tp2_pp2", "trainer.devices=4", "precision=bf16"),
    ("model=gpt_tiny", "precision.params_dtype=float64"),
])
def test_momentum_is_one_buffer_where_adam_keeps_two(overrides):
    adam, plan, cfg, derived = _plans(*overrides)
    tc = derived.transformer
    state = 8 if tc.params_dtype == torch.float64 else 4
    per_rank = _muon_elements_per_layer(tc) * tc.num_layers // derived.pp // derived.tp
    for a, m in zip(adam.ranks, plan.ranks):
        assert a.optimizer_bytes - m.optimizer_bytes == per_rank * state
        assert (a.weight_bytes, a.grad_bytes, a.main_weight_bytes) == (m.weight_bytes, m.grad_bytes, m.main_weight_bytes)
        assert m.step_transient_bytes > 0 and a.step_transient_bytes == 0
    assert any("optim=muon" in n for n in plan.notes)


def test_fsdp_is_refused_with_muon_and_the_distributed_optimizer_is_not():
    derive(compose_config(["model=gpt_tiny", "optim=muon", "trainer.devices=2", "optim.distributed_optimizer=true"]))
    cfg = compose_config(["model=gpt_tiny", "optim=muon", "trainer.devices=2", "parallel.data_parallel=fsdp"])
    with pytest.raises(Exception, match="optim=muon with"):
        derive(cfg)


@pytest.mark.parametrize("shape", [(48, 160), (160, 48), (64, 64)])
def test_newton_schulz_flops_are_what_torch_counts(shape):
    counter = FlopCounterMode(display=False)
    with counter:
        newton_schulz(torch.randn(*shape), 5, torch.float32)
    assert counter.get_total_flops() == muon.newton_schulz_flops(*shape, 5)


@pytest.fixture(scope="module")
def dry_runs():
    """One dry-run step of a Muon run (bf16 on the fake GPU, tp2 x pp2) at its first rank,
    with the bytes of Muon's TP all-gathers (``collectives.count_comm``: the gathered tensors)."""
    cfg = compose_config(["model=gpt_tiny", "model.seq_length=32", "model.vocab_size=512", "data=synthetic",
                          "data.micro_batch_size=1", "data.global_batch_size=2", "trainer=gpu", "precision=bf16",
                          "optim=muon", "parallel=tp2_pp2", "trainer.devices=4"])
    derived = derive(cfg)
    out = {}
    for rank in (0,):
        with collectives.count_comm() as counter:
            (result,) = D.dry_run(cfg, derived, [rank])
        out[rank] = (result, counter.bytes["muon_tp_gather"], cfg, derived)
    return out


@pytest.mark.parametrize("overrides, ranks", [
    # tp2 x pp2 x dp2: pp0 tp0 at dp0 and dp1, each owns its own matrices
    (("model=gpt_tiny", "parallel=tp2_pp2", "trainer.devices=8"), [0, 2]),
    # moe_tiny, ep2 x dp4: dense buckets owned over 4 ranks, expert buckets over each expert group of
    # 2; rank 3 (dense shard 3, rank 1 of its expert group) is within 4 bytes of the busiest, rank 2
    (("model=moe_tiny", "model.num_query_groups=2", "model.ffn_hidden_size=64", "model.moe.ffn_hidden_size=32",
      "model.num_layers=2", "model.hidden_size=128", "trainer.devices=4", "parallel.expert_parallel_size=2"), [3]),
])
def test_dry_run_static_memory_with_owned_matrices_is_the_plan(overrides, ranks):
    """Muon under the distributed optimizer: the busiest rank's Adam shards and the momentum of
    the matrices it owns (dense ones over dp x cp, experts over the expert data-parallel group)."""
    cfg = compose_config(["model.seq_length=32", "model.vocab_size=512", "data=synthetic",
                          "data.micro_batch_size=1", "data.global_batch_size=4", "trainer=gpu", "precision=bf16",
                          "optim=muon", "optim.distributed_optimizer=true", *overrides])
    results = D.dry_run(cfg, derive(cfg), ranks)
    busiest = max(r.static_bytes for r in results)
    assert len({r.static_bytes for r in results}) == len(results)
    assert abs(busiest / results[0].plan_static_bytes - 1) < 0.01


def test_dry_run_step_transient_equals_the_plan(dry_runs):
    for rank, (result, _, _, _) in dry_runs.items():
        assert result.optimizer_step_bytes > 0, rank
        assert result.optimizer_step_bytes == result.plan_step_bytes, rank
        assert abs(result.static_bytes / result.plan_static_bytes - 1) < 0.01, rank


def test_tp_all_gather_bytes_are_the_formula(dry_runs):
    (result, gathered, cfg, derived) = dry_runs[0]
    tc = derived.transformer
    received = gathered * (derived.tp - 1) / derived.tp
    # (t - 1) / t of every Muon matrix of the stage, in bf16 (Newton-Schulz's dtype on a GPU)
    expected = (derived.tp - 1) / derived.tp * _muon_elements_per_layer(tc) * tc.num_layers // derived.pp * 2
    assert received == expected
    assert f"{expected / 2**20:.2f} MiB" in next(n for n in plan_memory(cfg, derived).notes if "optim=muon" in n)


def test_step_time_adds_newton_schulz_and_the_gathers():
    cfg = compose_config(["model=gpt_8b", "optim=muon"])
    tc = derive(cfg).transformer
    assert tc.activation == "gelu"  # fc1 and fc2, no gate
    cluster = H100_NODE
    base = Layout(tp=2, pp=1, dp=4, micro_batch=1)
    adam, with_muon = estimate(tc, 64, base, cluster), estimate(tc, 64, Layout(**{**base.__dict__, "muon_ns_steps": 5}), cluster)
    assert adam.optimizer == 0.0 and with_muon.total - adam.total == pytest.approx(with_muon.optimizer)
    flops = tc.num_layers * sum(k * muon.newton_schulz_flops(r, c, 5) for r, c, k in [
        ((tc.num_attention_heads + 2 * tc.num_query_groups) * tc.kv_channels, tc.hidden_size, 1),
        (tc.hidden_size, tc.num_attention_heads * tc.kv_channels, 1), (tc.ffn_hidden_size, tc.hidden_size, 1),
        (tc.hidden_size, tc.ffn_hidden_size, 1)])
    no_gather = estimate(tc, 64, Layout(**{**base.__dict__, "tp": 1, "dp": 8, "muon_ns_steps": 5}), cluster)
    assert no_gather.optimizer == pytest.approx(flops / (cluster.peak_tflops * 1e12 * CALIBRATED.matmul_eta(cluster.gpu)))
    assert with_muon.optimizer > no_gather.optimizer  # the TP all-gathers


def test_planner_ranks_muon_layouts_without_fsdp():
    cfg = compose_config(["model=gpt_125m", "optim=muon"])
    cluster = H100_NODE
    found = plan_layouts(cfg, cluster)
    assert found and all(c.layout.muon_ns_steps == 5 and not c.layout.fsdp for c in found)
    assert all(c.step.optimizer > 0 for c in found)


def test_step_time_with_owned_matrices_is_the_busiest_owner_and_the_ownership_rings():
    """gpt_125m (12 layers, h = 768, GELU) at dp8 under the distributed optimizer: the 24 fc1/fc2
    (4 h^2 each), 12 QKV (3 h^2) and 12 projections (h^2) dealt largest first leave ranks 0-3
    3 fc + 2 QKV and ranks 4-7 3 fc + 1 QKV + 3 projections, i.e. 86 h^3 of Newton-Schulz work per
    iteration against 84 h^3 on average; the Muon buckets (12 h^2 a layer, fp32) are gathered and
    reduce-scattered over NVLink, each ring sending 7/8 of them."""
    cfg = compose_config(["model=gpt_125m", "optim=muon"])
    tc = derive(cfg).transformer
    h, c, cluster = tc.hidden_size, CALIBRATED, H100_NODE
    lay = Layout(tp=1, pp=1, dp=8, micro_batch=1, distributed_optimizer=True, muon_ns_steps=5)
    fc, qkv, proj = 5 * 18 * h ** 3, 5 * 14 * h ** 3, 5 * 6 * h ** 3  # 5 (4 m^2 n + 2 m^3)
    flops = max(3 * fc + 2 * qkv, 3 * fc + qkv + 3 * proj)
    wire = 2 * 7 / 8 * tc.num_layers * 12 * h * h * 4
    expected = (flops / (cluster.peak_tflops * 1e12 * c.matmul_eta(cluster.gpu))
                + wire / (cluster.nvlink_gb_per_s * 1e9 * c.link_efficiency) + 2 * c.latency_s)
    assert estimate(tc, 64, lay, cluster).optimizer == pytest.approx(expected, rel=1e-9)
