"""The layout planner: predictions against SC21's published TFLOP/s, the pipeline-bubble formula,
memory-infeasible layouts never proposed (checked against a static lower bound computed here),
and mode=plan_layouts printing commands that compose into the planned layout."""

from __future__ import annotations

import dataclasses
import subprocess

import pytest

from conftest import compose_config, launch_cmd
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


def test_plan_layouts_prints_runnable_commands(env_no_launcher, tmp_path):
    out = subprocess.run(launch_cmd("model=gpt_8b", "cluster=a100_40g_x64", "mode=plan_layouts",
                                    "data.global_batch_size=256", f"hydra.run.dir={tmp_path}"),
                         env=env_no_launcher, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
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
