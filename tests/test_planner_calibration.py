"""The step-time model's modern terms against published throughputs (the fitting rows of
``planning.calibration``; the held-out rows are reported by ``benchmarks/planner_validation.py``,
not asserted), monotonic sanity of every switch, and the planner's commands with them."""

from __future__ import annotations

import dataclasses

import pytest

from conftest import compose_config
from megatron_hydra.config import derive
from megatron_hydra.errors import ConfigError
from megatron_hydra.planning import calibration
from megatron_hydra.planning.layouts import Options, _command, layout_config, memory_peak, plan_layouts, report, run_planner
from megatron_hydra.planning.performance import CALIBRATED, estimate

FITTING = [r for r in calibration.ROWS if not r.held_out]
LABEL = lambda r: f"{r.source}-{r.gpu}-{r.model}-{r.gpus}"  # noqa: E731


@pytest.mark.parametrize("row", FITTING, ids=LABEL)
def test_fitting_rows_within_15_percent(row):
    assert calibration.predicted(row) == pytest.approx(row.published, rel=0.15)


def test_shipped_hopper_constants_are_the_fit():
    """A sync check, not a correctness one (the published rows' tests are): the constants in the
    code must be what the fit gives, so a change of the model or the rows forces a re-fit."""
    (eta, fp8, attn), _ = calibration.fit()
    shipped = (CALIBRATED.matmul_eta("H100-SXM5-80GB"), CALIBRATED.fp8_efficiency, CALIBRATED.attention_efficiency)
    assert (eta, fp8, attn) == pytest.approx(shipped, abs=0.01)
    assert CALIBRATED.matmul_eta("A100-SXM4-80GB") == CALIBRATED.eta  # A100: SC21's fit


def _step(row, cluster=None, **changes):
    lay = dataclasses.replace(row.layout(), **changes)
    return estimate(row.transformer(), row.batch, lay, cluster or calibration.cluster_for(row.gpu, row.gpus)).total


@pytest.mark.parametrize("row", calibration.ROWS, ids=LABEL)
def test_more_bandwidth_never_predicts_slower(row):
    base = calibration.cluster_for(row.gpu, row.gpus)
    before = _step(row, base)
    for field in ("nvlink_gb_per_s", "ib_gb_per_s", "hbm_gb_per_s"):
        faster = dataclasses.replace(base, **{field: 2 * getattr(base, field)})
        assert _step(row, faster) <= before * (1 + 1e-12), field


@pytest.mark.parametrize("row", calibration.ROWS, ids=LABEL)
def test_overlap_and_fusion_never_predict_slower(row):
    for switch in ("tp_comm_overlap", "pp_comm_overlap", "overlap_grad_reduce", "flash_attention", "fused_kernels",
                   "fp8"):
        assert _step(row, **{switch: True}) <= _step(row, **{switch: False}) * (1 + 1e-12), switch


def test_tp_overlap_hides_at_most_the_collectives():
    row = next(r for r in FITTING if r.model == "Llama2-70B")
    on = estimate(row.transformer(), row.batch, row.layout(), calibration.cluster_for(row.gpu, row.gpus))
    off = estimate(row.transformer(), row.batch, dataclasses.replace(row.layout(), tp_comm_overlap=False),
                   calibration.cluster_for(row.gpu, row.gpus))
    assert 0 < on.tp_comm < off.tp_comm and on.compute == off.compute
    assert off.total - on.total == pytest.approx(off.tp_comm - on.tp_comm, rel=1e-9)


def test_pp_overlap_leaves_only_the_warm_up_and_cool_down_messages():
    # Megatron-Bridge's Llama 3 70B, tp4 pp8 vp5, 64 micro-batches: a 2-layer chunk computes for
    # milliseconds, a 32 MiB stage-to-stage message takes under one, so only the 2 (p - 1) messages
    # of the warm-up and cool-down remain of the 2 v m + 2 (p - 1).
    row = next(r for r in calibration.ROWS if r.source == "bridge-25.11" and r.model == "Llama3-70B")
    cluster = calibration.cluster_for(row.gpu, row.gpus)
    on = estimate(row.transformer(), row.batch, row.layout(), cluster)
    off = estimate(row.transformer(), row.batch, dataclasses.replace(row.layout(), pp_comm_overlap=False), cluster)
    p, v, m = 8, 5, 128 // 2
    assert on.pp_comm == pytest.approx(off.pp_comm * 2 * (p - 1) / (2 * v * m + 2 * (p - 1)), rel=1e-12)
    assert on.compute == off.compute and off.total - on.total == pytest.approx(off.pp_comm - on.pp_comm, rel=1e-9)


def test_bigger_micro_batch_never_uses_less_memory():
    cfg = compose_config(["model=llama3_8b", "cluster=h100_80g_x1024", "cluster.num_nodes=2",
                          "data.global_batch_size=64"])
    lay = next(lay for lay in (r.layout() for r in FITTING) if lay.tp == 1 and lay.pp == 1 and lay.cp == 1)
    peaks = []
    for b in (1, 2, 4):
        run = layout_config(cfg, cfg.cluster, dataclasses.replace(lay, dp=16, micro_batch=b, fsdp=False))
        peaks.append(memory_peak(run, derive(run))[1])
    assert peaks == sorted(peaks) and peaks[0] < peaks[-1]


def test_fp8_transformer_engine_commands_derive_and_report_mfu():
    base = ["model=llama3_8b", "model.transformer_impl=transformer_engine", "data.global_batch_size=64"]
    cfg = compose_config([*base, "precision=fp8", "cluster=h100_80g_x1024", "cluster.num_nodes=2"])
    opts = Options(micro_batches=(1,), recompute=(None,), data_parallel=("ddp",), max_vpp=1)
    found = plan_layouts(cfg, cfg.cluster, opts)
    assert found and all(c.layout.fp8 and c.layout.fused_kernels and c.layout.flash_attention for c in found)
    for cand in found[:3]:
        words = _command(base, cand, cfg.cluster).split()
        run = compose_config(words[4:])
        derived = derive(run)
        assert run.precision.fp8 is not None and run.model.transformer_impl == "transformer_engine"
        assert derived.world_size == 16 and derived.tp == cand.layout.tp and derived.pp == cand.layout.pp
    text = report(cfg, cfg.cluster, found, base, top=1)
    mfu = found[0].step.model_tflops_per_gpu / cfg.cluster.peak_tflops
    assert " MFU " in text.splitlines()[1] and f"{mfu:.1%}" in text.splitlines()[2]


@pytest.mark.parametrize("model", ["bert_large", "t5_base"])
def test_plan_layouts_names_why_no_layout_derives(model):
    # BERT and T5 are planned (tests/test_memory_plan_archs.py), on their own data only.
    arch = model.split("_")[0]
    cfg = compose_config([f"model={model}", "cluster=h100_80g_x1024", "data.global_batch_size=1024"])
    with pytest.raises(ConfigError, match=f"no layout of h100_80g_x1024 derives.*use data=indexed_{arch}"):
        run_planner(cfg)


def test_dp_overlap_per_virtual_chunk_hand_computed():
    from megatron_hydra.planning.performance import _chunk_overlap

    assert _chunk_overlap(10.0, 8.0, 1, 4) == pytest.approx(2.0)  # v = 1: what outlasts the backward
    assert _chunk_overlap(10.0, 8.0, 4, 2) == pytest.approx(0.5)  # the last chunk's 2.5 s behind its 2 s
    assert _chunk_overlap(10.0, 1.0, 4, 2) == pytest.approx(10.0 - 0.25 * 7)  # the cool-down hides 1.75 s


def test_tp_overlap_hand_computed():
    from megatron_hydra.config.schema import ClusterConfig
    from megatron_hydra.config.transformer_config import TransformerConfig
    from megatron_hydra.planning.performance import Constants, Layout, tp_layer_seconds

    tc = TransformerConfig(num_layers=1, hidden_size=1000, num_attention_heads=10, num_query_groups=10, kv_channels=100,
                           ffn_hidden_size=4000, seq_length=1000, max_position_embeddings=1000, vocab_size=1000,
                           padded_vocab_size=1000)
    c = Constants(link_efficiency=1.0, latency_s=0.0)
    cluster = ClusterConfig(nvlink_gb_per_s=1.0)  # 1e9 bytes/s
    lay = Layout(tp=2, pp=1, dp=1, micro_batch=1, sequence_parallel=True, tp_comm_overlap=True)
    # A half-size collective: 1/2 of 1000 tokens x 1000 x 2 bytes = 1e6 bytes: 1 ms. Matmuls: 0.4, 2, 0 and 0 ms.
    gemms = [0.4e-3, 2e-3, 0.0, 0.0]
    forward = (0.5e-3 + 0.5 * 0.6e-3) + 0.5e-3 + 2 * (0.5e-3 + 0.5 * 1e-3)
    backward = 0.2e-3 + 0.0 + 2 * 1e-3
    assert tp_layer_seconds(tc, lay, cluster, c, gemms) == pytest.approx(forward + backward)
    off = tp_layer_seconds(tc, dataclasses.replace(lay, tp_comm_overlap=False), cluster, c, gemms)
    assert off == pytest.approx(4 * 2e-3)  # 4 all-reduce-sized messages of 2e6 bytes
