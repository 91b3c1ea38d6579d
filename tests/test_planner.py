"""The layout planner: predictions against SC21's published TFLOP/s, the pipeline-bubble formula,
memory-infeasible layouts never proposed (checked against a static lower bound computed here),
and mode=plan_layouts printing commands that compose into the planned layout."""

from __future__ import annotations

import dataclasses

import pytest

from conftest import compose_config, launch_py
from megatron_hydra.config import derive
from megatron_hydra.errors import ConfigError
from megatron_hydra.planning import sc21
from megatron_hydra.planning.layouts import Options, layout_config, layouts, plan_layouts, run_planner
from megatron_hydra.planning.performance import CALIBRATED, Constants, Layout, estimate

GIB = 2 ** 30


@pytest.fixture(scope="module")
def selene():
    return compose_config(["cluster=a100_80g_x1024"]).cluster


@pytest.mark.parametrize("row", sc21.TABLE1, ids=lambda r: r.label)
def test_sc21_published_layouts_within_15_percent(row, selene):
    assert sc21.predicted_tflops(row, selene) == pytest.approx(row.tflops_per_gpu, rel=0.15)


def test_shipped_constants_are_the_sc21_fit(selene):
    eta, kappa, rms = sc21.fit(selene)
    assert (eta, kappa) == pytest.approx((CALIBRATED.eta, CALIBRATED.kappa), abs=0.01)
    assert rms < 0.1


@pytest.mark.parametrize("row", [sc21.TABLE1[0], sc21.TABLE1[-1]], ids=lambda r: r.label)
def test_flop_counts_are_the_papers(row, selene):
    # SC21 eq. 3 (full recompute): 96 B s l h^2 (1 + s/(6h) + V/(16 l h)); without recompute the
    # planning.flops' model FLOPs, 72 B s l h^2 (1 + s/(6h) + V/(12 l h)).
    from megatron_hydra.planning.flops import model_flops_per_step

    B, s, l, h, V = row.batch, sc21.SEQ_LENGTH, row.layers, row.hidden, sc21.VOCAB_SIZE
    step = estimate(sc21.transformer(row), B, sc21.published_layout(row), selene)
    assert step.hardware_flops == pytest.approx(96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h)), rel=1e-12)
    assert step.model_flops == pytest.approx(72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h)), rel=1e-12)
    assert step.model_flops == pytest.approx(model_flops_per_step(sc21.transformer(row), B), rel=1e-12)


@pytest.mark.parametrize("vpp", [1, 2, 4])
def test_pipeline_bubble_is_narayanan_eq2(selene, vpp):
    # No communication and no memory-bound time: the bubble over the busy time is (p-1)/(v m).
    free = Constants(eta=0.5, kappa=0.0, link_efficiency=1.0, latency_s=0.0)
    row = sc21.TABLE1[6]  # 145.6B: p = 8
    lay = Layout(tp=1, pp=8, dp=1, micro_batch=2, vpp=vpp, recompute="full", overlap_grad_reduce=False)
    step = estimate(sc21.transformer(row), 64, lay, selene, free)
    m = 64 // 2
    assert step.bubble / step.compute == pytest.approx((8 - 1) / (vpp * m), rel=1e-12)
    assert step.tp_comm == step.dp_comm == 0


def _static_lower_bound(cfg, lay: Layout) -> float:
    """Bytes a rank must hold before any activation: bf16 weights, fp32 grads and fp32 Adam state
    plus main weights (sharded over dp with the distributed optimizer) of the layers of one
    stage and the tensor-parallel share of the vocabulary embedding (Rajbhandari et al. 2020); with
    FSDP (ZeRO-3) the fp32 grads, main weights and Adam state all over dp, the gathered bf16
    weights left out."""
    m = cfg.model
    h, layers = m.hidden_size, m.num_layers
    per_layer = 12 * h * h
    params = (layers // lay.pp * per_layer) / lay.tp
    if lay.fsdp:
        return params * 16 / lay.dp
    opt = 12 / lay.dp if lay.distributed_optimizer else 12
    return params * (2 + 4 + opt)


def test_memory_infeasible_layouts_are_never_proposed():
    cfg = compose_config(["model=gpt_8b", "cluster=a100_40g_x64", "data.global_batch_size=256"])
    cluster = cfg.cluster
    found = plan_layouts(cfg, cluster)
    valid = []
    for lay in layouts(cfg, cluster):
        try:
            derive(layout_config(cfg, cluster, lay))
            valid.append(lay)
        except ConfigError:
            pass
    proposed = {c.layout for c in found}
    assert 0 < len(proposed) < len(valid)  # the memory plan rejected some valid layouts
    budget = cluster.memory_gb * GIB
    for cand in found:
        assert cand.peak_bytes <= budget
        assert _static_lower_bound(cfg, cand.layout) <= budget
    hopeless = [lay for lay in valid if _static_lower_bound(cfg, lay) > budget]
    assert hopeless and not proposed & set(hopeless)
    times = [c.step.total for c in found]
    assert times == sorted(times)


def test_plan_layouts_without_a_cluster_is_a_config_error():
    with pytest.raises(ConfigError, match="cluster=<name>"):
        run_planner(compose_config(["model=gpt_8b", "mode=plan_layouts"]))


def test_plan_layouts_prints_runnable_commands(env_no_launcher, tmp_path, capsys):
    capsys.readouterr()
    code = launch_py(["model=gpt_8b", "cluster=a100_40g_x64", "mode=plan_layouts", "data.global_batch_size=256",
                      f"hydra.run.dir={tmp_path}"], env_no_launcher)  # a plain shell's environment
    out = capsys.readouterr()
    assert code == 0, out.err
    lines = out.out.splitlines()
    commands = [line.split(None, 1)[1] for line in lines[lines.index("commands:") + 1:]]
    assert len(commands) == 5
    for command in commands:
        words = command.split()
        assert words[:4] == ["python", "launch.py", "-m", "hydra/launcher=slurm"]
        cfg = compose_config(words[4:])
        derived = derive(cfg)
        assert derived.world_size == 64 and cfg.model.name == "gpt_8b" and cfg.data.global_batch_size == 256
        assert cfg.precision.params_dtype == "bfloat16" and cfg.trainer.accelerator == "gpu"


def test_sc21_options_keep_the_2021_features():
    cfg = compose_config(["model=gpt_8b", "cluster=a100_40g_x64", "data.global_batch_size=256"])
    opts = Options(recompute=("full",), sequence_parallel=(False,), distributed_optimizer=(False,),
                   data_parallel=("ddp",), overlap_grad_reduce=False)
    assert all(lay.recompute == "full" and not lay.sequence_parallel and not lay.distributed_optimizer
               and not lay.fsdp for lay in layouts(cfg, cfg.cluster, opts))


def test_fsdp_layouts_are_searched_and_their_commands_derive():
    from megatron_hydra.planning.layouts import overrides

    cfg = compose_config(["model=gpt_8b", "cluster=a100_40g_x64", "data.global_batch_size=256"])
    found = [lay for lay in layouts(cfg, cfg.cluster) if lay.fsdp]
    assert found and all(lay.dp > 1 and not lay.distributed_optimizer for lay in found)
    lay = next(x for x in found if x.tp == 8 and x.pp == 1 and x.micro_batch == 1 and x.recompute is None)
    words = overrides(lay)
    assert "parallel.data_parallel=fsdp" in words
    run = compose_config(["model=gpt_8b", "data.global_batch_size=256", "precision=bf16", "trainer=gpu",
                          "trainer.devices=8", "trainer.num_nodes=8", *words])
    assert derive(run).dp == 8 and run.parallel.data_parallel == "fsdp"
    # FSDP gathers the weights twice per micro-batch (forward and backward): with a micro-batch of
    # one sample the gathers outlast the compute that hides them, and cost more than DDP's single
    # all-reduce; with eight they hide entirely.
    tc = derive(run).transformer
    small, large = lay, dataclasses.replace(lay, micro_batch=8)
    assert estimate(tc, 256, small, cfg.cluster).dp_comm > estimate(tc, 256, dataclasses.replace(small, fsdp=False),
                                                                     cfg.cluster).dp_comm
    assert estimate(tc, 256, large, cfg.cluster).dp_comm == 0.0


# Context parallelism ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def h100():
    return compose_config(["cluster=h100_80g_x1024"]).cluster


def _llama_long():
    """Llama 3 8B's shape at 128k tokens (bf16, the performance model's view)."""
    from megatron_hydra.config.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                             kv_channels=128, ffn_hidden_size=14336, seq_length=131072, max_position_embeddings=131072,
                             vocab_size=128256, padded_vocab_size=128256, activation="swiglu", position_embedding="rope")


def _transfer(nbytes: float, gb_per_s: float, c: Constants = CALIBRATED) -> float:
    return nbytes / (gb_per_s * 1e9 * c.link_efficiency) + c.latency_s


@pytest.mark.parametrize("recompute", [None, "full"])
def test_more_context_parallelism_never_more_compute_per_gpu(h100, recompute):
    tc = _llama_long()
    # dp fixed: each GPU runs 1/cp of every micro-batch's tokens, so 1/cp of the compute.
    base = estimate(tc, 16, Layout(tp=8, pp=1, dp=2, micro_batch=1, recompute=recompute), h100)
    previous = base.compute
    for cp in (2, 4, 8, 16):
        step = estimate(tc, 16, Layout(tp=8, pp=1, dp=2, micro_batch=1, recompute=recompute, cp=cp), h100)
        assert step.compute == pytest.approx(base.compute / cp, rel=1e-12)
        assert step.compute <= previous and step.gpus == 8 * 2 * cp
        previous = step.compute
    # World fixed (64 GPUs): cp takes GPUs from dp; the compute per GPU does not grow.
    fixed = [estimate(tc, 16, Layout(tp=8, pp=1, dp=8 // cp, micro_batch=1, recompute=recompute, cp=cp), h100).compute
             for cp in (1, 2, 4, 8)]
    assert all(b <= a * (1 + 1e-12) for a, b in zip(fixed, fixed[1:]))


@pytest.mark.parametrize("tp, cp", [(1, 8), (8, 2), (8, 8), (2, 16)])
def test_ring_attention_exposes_at_most_its_raw_time(h100, tp, cp):
    tc = _llama_long()
    lay = Layout(tp=tp, pp=2, dp=1, micro_batch=1, vpp=2, cp=cp)
    step = estimate(tc, 8, lay, h100)
    # Written out: K and V of s/cp tokens, g/t groups, head size 128, bf16; NVLink if t cp fits a node.
    kv = 2 * 1 * (131072 / cp) * (8 / tp) * 128 * 2
    link = h100.nvlink_gb_per_s if tp * cp <= 8 else h100.ib_gb_per_s
    per_layer_raw = (cp - 1) * _transfer(kv, link) + (cp - 1) * 2 * _transfer(kv, link) + _transfer(kv, link)
    runs = 8 + (2 - 1) / 2  # (m + (p-1)/v) micro-batch slots on the critical path
    raw = runs * 16 * per_layer_raw  # 16 layers per stage
    last_hop = runs * 16 * _transfer(kv, link)  # the dK/dV accumulators' hop home is never hidden
    assert last_hop <= step.cp_comm < raw
    # At 128k tokens every exchange hides behind its block's attention: only the last hop shows.
    assert step.cp_comm == pytest.approx(last_hop, rel=1e-12)


def test_ring_step_formula():
    from megatron_hydra.planning.context_parallel import ring_seconds

    # Communication shorter than a block's attention: only the last dK/dV hop shows.
    assert ring_seconds(4, 1.0, 3.0, replays=0) == (3 * 1.0 + 3 * 2.0 + 1.0, 1.0)
    # Longer: each forward step shows 2 - 1.5, each backward step 4 - 3, plus the hop.
    assert ring_seconds(4, 2.0, 1.5, replays=0) == (3 * 2 + 3 * 4 + 2, 3 * 0.5 + 3 * 1.0 + 2)
    # A recomputed forward runs the ring again.
    assert ring_seconds(4, 2.0, 1.5, replays=1) == (2 * 3 * 2 + 3 * 4 + 2, 2 * 3 * 0.5 + 3 * 1.0 + 2)
    assert ring_seconds(1, 2.0, 1.5, replays=1) == (0.0, 0.0)


@pytest.mark.parametrize("tp, cp", [(1, 4), (4, 2), (2, 8), (1, 16)])
def test_ulysses_volume_and_time(h100, tp, cp):
    from megatron_hydra.planning.context_parallel import a2a_bytes_per_gpu, a2a_tensor_bytes

    tc = _llama_long()
    local = 1 * (131072 / cp) * (32 / tp) * 128 * 2  # [b, a/t, s/cp, k] in bf16
    assert a2a_tensor_bytes(1, 131072, cp, 32, 128, tp, 2) == local
    assert a2a_bytes_per_gpu(cp, local) == 4 * (cp - 1) / cp * local
    step = estimate(tc, 8, Layout(tp=tp, pp=1, dp=1, micro_batch=1, cp=cp, cp_comm="a2a"), h100)
    link = h100.nvlink_gb_per_s if tp * cp <= 8 else h100.ib_gb_per_s
    # 4 all-to-alls forward, 4 backward, none hidden; 32 layers, 8 micro-batches, no pipeline.
    assert step.cp_comm == pytest.approx(8 * 32 * 8 * _transfer((cp - 1) / cp * local, link), rel=1e-12)


def test_gradients_are_reduced_over_dp_times_cp(h100):
    tc = _llama_long()
    lay = Layout(tp=8, pp=1, dp=1, micro_batch=1, cp=2, overlap_grad_reduce=False)
    params = (32 * (4096 * (32 + 2 * 8) * 128 + 32 * 128 * 4096 + 3 * 4096 * 14336) + 128256 * 4096) / 8
    # dp = 1 but 2 CP ranks hold the same weights: a 2-rank ring all-reduce of fp32 grads over 16 ranks' span (IB).
    expected = (2 - 1) / 2 * params * 2 * 4 / (h100.ib_gb_per_s * 1e9 * 0.75) + 2 * CALIBRATED.latency_s
    assert estimate(tc, 8, lay, h100).dp_comm == pytest.approx(expected, rel=1e-12)
    assert estimate(tc, 8, dataclasses.replace(lay, cp=1), h100).dp_comm == 0.0


def test_context_parallelism_is_searched_for_long_sequences_only():
    from megatron_hydra.planning.layouts import overrides

    short = compose_config(["model=gpt_8b", "cluster=a100_40g_x64", "data.global_batch_size=256"])
    assert {lay.cp for lay in layouts(short, short.cluster)} == {1}
    long = compose_config(["model=llama3_8b", "model.seq_length=16384", "cluster=h100_80g_x1024", "cluster.num_nodes=2",
                           "data.global_batch_size=16"])
    opts = Options(micro_batches=(1,), recompute=(None,), distributed_optimizer=(False,), data_parallel=("ddp",))
    found = list(layouts(long, long.cluster, opts))
    assert {lay.cp for lay in found} == {1, 2, 4, 8, 16}
    a2a = next(lay for lay in found if lay.cp == 4 and lay.cp_comm == "a2a")
    assert {"parallel.context_parallel_size=4", "parallel.cp_comm_type=a2a"} <= set(overrides(a2a))
    for lay in found:  # every layout the enumeration yields for cp > 1 derives as that layout
        if lay.cp > 1:
            derived = derive(layout_config(long, long.cluster, lay))
            assert (derived.cp, derived.transformer.cp_comm_type, derived.dp) == (lay.cp, lay.cp_comm, lay.dp)


def _derives(cfg) -> bool:
    try:
        derive(cfg)
    except ConfigError:
        return False
    return True


def test_llama3_8b_at_128k_tokens_plans_context_parallelism():
    base = ["model=llama3_8b", "model.seq_length=131072", "data.global_batch_size=16"]
    cfg = compose_config([*base, "cluster=h100_80g_x1024", "cluster.num_nodes=8"])
    opts = Options(micro_batches=(1,), recompute=(None, "selective", "full"), sequence_parallel=(True,),
                   distributed_optimizer=(True,), data_parallel=("ddp",), max_vpp=1, cp_comm_types=("p2p",))
    found = plan_layouts(cfg, cfg.cluster, opts)
    top = found[0]
    assert top.layout.cp > 1 and top.layout.recompute is None
    # Without context parallelism a rank holds all 128k tokens: only full recompute fits, and it is slower.
    without = [c for c in found if c.layout.cp == 1]
    assert without and all(c.layout.recompute == "full" for c in without)
    assert any(_derives(layout_config(cfg, cfg.cluster, lay)) for lay in layouts(cfg, cfg.cluster, opts)
               if lay.cp == 1 and lay.recompute != "full")  # valid layouts, rejected by the memory plan
    assert all(c.step.total > top.step.total for c in without)
    words = [*base, "precision=bf16", "trainer=gpu", "trainer.devices=8", "trainer.num_nodes=8", *top.overrides]
    derived = derive(compose_config(words))
    assert (derived.world_size, derived.cp, derived.tp, derived.dp) == (64, top.layout.cp, top.layout.tp, top.layout.dp)


# Mixture of Experts --------------------------------------------------------------------------------


def _mixtral(*more: str):
    cfg = compose_config(["model=mixtral_8x7b", "cluster=h100_80g_x1024", "data.global_batch_size=64",
                          "trainer.devices=8", *more])
    return cfg, derive(cfg).transformer


@pytest.mark.parametrize("ep, recompute", [(2, None), (8, None), (8, "full")])
def test_expert_all_to_all_time_is_its_volume(ep, recompute):
    cfg, tc = _mixtral()
    lay = Layout(tp=1, pp=1, dp=8, micro_batch=1, ep=ep, recompute=recompute)
    # Each all-to-all sends (ep-1)/ep of the micro-batch's 4096 tokens x top-2 choices x h in bf16;
    # dispatch + combine forward and backward (and the forward again under full recompute), in all
    # 32 layers, for 64 / 8 = 8 micro-batches, over NVLink (ep ranks within a node).
    volume = (ep - 1) / ep * 4096 * 2 * 4096 * 2
    count = 6 if recompute else 4
    expected = count * 32 * 8 * _transfer(volume, cfg.cluster.nvlink_gb_per_s)
    assert estimate(tc, 64, lay, cfg.cluster).ep_comm == pytest.approx(expected, rel=1e-12)
    assert estimate(tc, 64, dataclasses.replace(lay, ep=1), cfg.cluster).ep_comm == 0.0


def test_moe_step_counts_the_active_flops_and_splits_expert_gradients():
    from megatron_hydra.planning.flops import model_flops_per_step

    cfg, tc = _mixtral()
    lay = Layout(tp=1, pp=1, dp=8, micro_batch=1, ep=8, overlap_grad_reduce=False)
    assert estimate(tc, 64, lay, cfg.cluster).model_flops == pytest.approx(model_flops_per_step(tc, 64), rel=1e-12)
    # ep = dp: every rank holds its own expert, so only the dense weights (attention, routers,
    # norms left out, one vocabulary table on the fullest rank) are all-reduced, in fp32 over 8 ranks.
    h, g = 4096, 8
    dense = 32 * (h * (32 + 2 * g) * 128 + 32 * 128 * h + h * 8) + 32000 * h
    expected = _transfer(7 / 8 * dense * 2 * 4, cfg.cluster.nvlink_gb_per_s) + CALIBRATED.latency_s
    assert estimate(tc, 64, lay, cfg.cluster).dp_comm == pytest.approx(expected, rel=1e-12)
    # ep = 1: the experts' gradients (8 of 3 h f per layer) are all-reduced as well.
    experts = 32 * 8 * 3 * h * 14336
    more = _transfer(7 / 8 * experts * 2 * 4, cfg.cluster.nvlink_gb_per_s) + CALIBRATED.latency_s
    assert estimate(tc, 64, dataclasses.replace(lay, ep=1), cfg.cluster).dp_comm == pytest.approx(expected + more,
                                                                                                  rel=1e-12)


def test_moe_layouts_search_expert_parallelism_and_their_commands_derive():
    cfg, _ = _mixtral("cluster.num_nodes=2")
    opts = Options(micro_batches=(1,), recompute=(None, "full"), sequence_parallel=(True,),
                   distributed_optimizer=(True,), data_parallel=("ddp", "fsdp"), max_vpp=1)
    found = list(layouts(cfg, cfg.cluster, opts))
    assert not any(lay.fsdp for lay in found)  # config.moe: no FSDP with experts
    split = [lay for lay in found if not lay.whole_experts]
    assert {lay.ep for lay in split if lay.tp == 2 and lay.pp == 1} == {1, 2, 4, 8}  # dp 8: every divisor of 8 experts
    assert all(lay.dp % lay.ep == 0 and 8 % lay.ep == 0 for lay in split)
    # Whole experts (etp 1) carve ep from dp x tp: at tp8 x dp2, ep8 exceeds dp.
    whole = [lay for lay in found if lay.whole_experts]
    assert all(lay.tp > 1 and (lay.dp * lay.tp) % lay.ep == 0 for lay in whole)
    assert {lay.ep for lay in whole if lay.tp == 8 and lay.pp == 1} == {1, 2, 4, 8}
    best = plan_layouts(cfg, cfg.cluster, Options(micro_batches=(1,), recompute=("full",), sequence_parallel=(True,),
                                                  distributed_optimizer=(True,), data_parallel=("ddp",), max_vpp=1))
    assert any(c.layout.ep > 1 for c in best)
    for cand in best[:3]:
        words = ["model=mixtral_8x7b", "data.global_batch_size=64", "precision=bf16", "trainer=gpu",
                 "trainer.devices=8", "trainer.num_nodes=2", *cand.overrides]
        derived = derive(compose_config(words))
        assert (derived.world_size, derived.ep, derived.tp, derived.pp) == (16, cand.layout.ep, cand.layout.tp,
                                                                            cand.layout.pp)
        assert (derived.etp == 1) == cand.layout.whole_experts
    lay = next(c.layout for c in best if c.layout.whole_experts)
    assert derive(layout_config(cfg, cfg.cluster, lay)).etp == 1


def test_whole_experts_dispatch_their_own_tokens():
    cfg, tc = _mixtral()
    split = Layout(tp=2, pp=1, dp=4, micro_batch=1, ep=2)
    whole = dataclasses.replace(split, whole_experts=True)
    # Each TP rank sends its half of the tokens, within its TP pair (NVLink either way).
    assert estimate(tc, 64, whole, cfg.cluster).ep_comm == pytest.approx(
        4 * 32 * 16 * _transfer(1 / 2 * 2048 * 2 * 4096 * 2, cfg.cluster.nvlink_gb_per_s), rel=1e-12)
    assert estimate(tc, 64, split, cfg.cluster).ep_comm == pytest.approx(
        4 * 32 * 16 * _transfer(1 / 2 * 4096 * 2 * 4096 * 2, cfg.cluster.nvlink_gb_per_s), rel=1e-12)


def _square_layer():
    """One GPT layer of h = 1000 over 1000 tokens: an activation is 2e6 bytes in bf16."""
    from megatron_hydra.config.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=1000, num_attention_heads=10, num_query_groups=10,
                             kv_channels=100, ffn_hidden_size=4000, seq_length=1000, max_position_embeddings=1000,
                             vocab_size=1000, padded_vocab_size=1000)


@pytest.mark.parametrize("recompute, passes", [(None, 2), ("full", 3)])
def test_ring_collective_matmul_exposes_each_step_beyond_its_partial_matmul(recompute, passes):
    from megatron_hydra.config.schema import ClusterConfig
    from megatron_hydra.planning.performance import tp_layer_seconds

    c = Constants(link_efficiency=1.0, latency_s=0.0)
    cluster = ClusterConfig(nvlink_gb_per_s=1.0)  # 1e9 bytes/s
    lay = Layout(tp=4, pp=1, dp=1, micro_batch=1, recompute=recompute, sequence_parallel=True,
                 tp_comm_overlap=True, tp_comm_ring=True)
    # An all-gather moves 3/4 of 2e6 bytes: 1.5 ms, in 3 ring steps of 0.5 ms; each step hides
    # behind a quarter of its matmul (0.4, 2, 0, 0 ms): 0.4 + 0 + 0.5 + 0.5 ms per step exposed.
    gemms = [0.4e-3, 2e-3, 0.0, 0.0]
    on = tp_layer_seconds(_square_layer(), lay, cluster, c, gemms)
    assert on == pytest.approx(passes * 3 * (0.4e-3 + 0.0 + 0.5e-3 + 0.5e-3), rel=1e-12)
    off = tp_layer_seconds(_square_layer(), dataclasses.replace(lay, tp_comm_overlap=False), cluster, c, gemms)
    assert off == pytest.approx(passes * 2 * 3e-3, rel=1e-12) and on < off  # 2 all-reduces of 3e6 bytes a pass


def test_layouts_overlap_tensor_parallelism_only_with_sequence_parallelism():
    from megatron_hydra.planning.layouts import overrides

    cfg = compose_config(["model=gpt_8b", "cluster=a100_40g_x64", "data.global_batch_size=256"])
    found = list(layouts(cfg, cfg.cluster, Options(micro_batches=(1,), recompute=(None,), max_vpp=1)))
    assert any(lay.sequence_parallel for lay in found) and any(not lay.sequence_parallel for lay in found)
    for lay in found:
        assert lay.tp_comm_overlap == lay.sequence_parallel and lay.tp_comm_ring
        assert ("parallel.tp_comm_overlap=true" in overrides(lay)) == lay.sequence_parallel
        assert not any("overlap_grad_reduce" in o or "overlap_param_gather" in o for o in overrides(lay))
    te = compose_config(["model=gpt_8b", "cluster=a100_40g_x64", "data.global_batch_size=256",
                         "model.transformer_impl=transformer_engine"])  # TE's own userbuffers are not wired
    assert not any(lay.tp_comm_overlap for lay in layouts(te, te.cluster, Options(micro_batches=(1,), max_vpp=1)))
    lay = next(x for x in found if x.sequence_parallel and x.tp == 8 and x.pp == 2)
    run = layout_config(cfg, cfg.cluster, lay)
    assert run.parallel.tp_comm_overlap and run.parallel.sequence_parallel
    off = Options(micro_batches=(1,), recompute=(None,), max_vpp=1, distributed_optimizer=(True,),
                  data_parallel=("ddp",), overlap_grad_reduce=False, overlap_param_gather=False)
    words = overrides(next(x for x in layouts(cfg, cfg.cluster, off) if x.dp > 1))
    assert {"parallel.overlap_grad_reduce=false", "parallel.overlap_param_gather=false"} <= set(words)


def test_overlapped_parameter_gather_hides_behind_the_first_forward(h100):
    tc = _square_layer()
    lay = Layout(tp=1, pp=1, dp=8, micro_batch=1, distributed_optimizer=True)
    both = estimate(tc, 8, lay, h100).dp_comm
    no_gather = estimate(tc, 8, dataclasses.replace(lay, overlap_param_gather=False), h100).dp_comm
    no_reduce = estimate(tc, 8, dataclasses.replace(lay, overlap_grad_reduce=False), h100).dp_comm
    neither = estimate(tc, 8, dataclasses.replace(lay, overlap_grad_reduce=False, overlap_param_gather=False), h100)
    assert both < no_gather < neither.dp_comm and both < no_reduce < neither.dp_comm


def test_compile_fuses_the_element_passes_once(h100):
    tc = _square_layer()
    eager = Layout(tp=2, pp=1, dp=1, micro_batch=1, sequence_parallel=True)
    compiled, fused = dataclasses.replace(eager, compiled=True), dataclasses.replace(eager, fused_kernels=True)
    both = dataclasses.replace(fused, compiled=True)
    times = {name: estimate(tc, 4, lay, h100).compute for name, lay in
             (("eager", eager), ("compiled", compiled), ("fused", fused), ("both", both))}
    assert times["compiled"] < times["eager"]
    assert times["compiled"] == times["fused"] == times["both"]  # the same passes fused: no stacking
    cfg = compose_config(["model=gpt_8b", "cluster=a100_40g_x64", "data.global_batch_size=256", "trainer.compile=true"])
    from megatron_hydra.planning.layouts import overrides

    found = list(layouts(cfg, cfg.cluster, Options(micro_batches=(1,), recompute=(None,), max_vpp=1)))
    assert all(lay.compiled and "trainer.compile=true" in overrides(lay) for lay in found)
    plain = compose_config(["model=gpt_8b", "cluster=a100_40g_x64", "data.global_batch_size=256"])
    assert not any(lay.compiled for lay in layouts(plain, plain.cluster, Options(micro_batches=(1,), max_vpp=1)))


def test_interleaved_layouts_overlap_pipeline_transfers():
    """torch's interleaved schedules post receives without waiting (``docs/parallelism.md``): the
    planner's layouts with virtual stages overlap their point-to-point transfers, 1F1B's do not."""
    cfg = compose_config(["model=gpt_8b", "cluster=a100_40g_x64", "data.global_batch_size=256"])
    found = plan_layouts(cfg, cfg.cluster, Options(micro_batches=(1,), recompute=("full",), sequence_parallel=(True,),
                                                   distributed_optimizer=(True,), data_parallel=("ddp",), max_vpp=2))
    assert {c.layout.vpp for c in found} == {1, 2}
    assert all(c.layout.pp_comm_overlap == (c.layout.vpp > 1) for c in found)
