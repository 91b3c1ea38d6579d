"""The memory plan and the layout planner for BERT and T5.

References: the parameters of the real models built in this process (any TP rank through stub
groups, any pipeline stage), the bytes the dry run measures over fake tensors for one step of a
GPU rank (as tests/test_dry_run.py holds GPT's layers to the plan), and T5's FLOPs counted by hand
from its layers' matmuls.
"""

from __future__ import annotations

import math

import pytest

from conftest import StubGroup, compose_config, stub_groups
from megatron_hydra.config import derive
from megatron_hydra.models.archs import ARCHS
from megatron_hydra.parallel.pipeline import stage_layers
from megatron_hydra.parallel.state import ParallelState
from megatron_hydra.planning.memory import plan_memory, rank_memory

SHAPE = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.ffn_hidden_size=256",
         "model.seq_length=32", "model.max_position_embeddings=32", "model.vocab_size=500", "precision=bf16",
         "data.micro_batch_size=2", "data.global_batch_size=8"]
BERT = ["model=bert_base", "data=indexed_bert", *SHAPE]
T5 = ["model=t5_base", "data=indexed_t5", *SHAPE, "model.kv_channels=16", "model.num_decoder_layers=3",
      "model.decoder_seq_length=16"]


def _real_model(derived, tp_rank: int, pp_rank: int):
    """The model TP rank ``tp_rank`` of pipeline rank ``pp_rank`` builds (meta device)."""
    tc, tp, pp = derived.transformer, derived.tp, derived.pp
    ps = ParallelState(sizes={"pp": pp, "dp": 1, "cp": 1, "tp": tp}, rank=pp_rank * tp + tp_rank,
                       groups={"tp": StubGroup(tp, tp_rank)} if tp > 1 else None)
    stage = {} if pp == 1 else dict(layers=stage_layers(derived.layers_per_stage, pp_rank), pre_process=pp_rank == 0,
                                    post_process=pp_rank == pp - 1)
    with stub_groups():
        return ARCHS[tc.arch].build(tc, ps, device="meta", **stage)


def _real_params(derived, tp_rank: int, pp_rank: int):
    return list(_real_model(derived, tp_rank, pp_rank).parameters())


# A GPT with every architecture key of today's open models (docs/models.md) on: Gemma 3's
# (QK-norm, head size apart from hidden / heads, zero-centred pre- and post-sub-layer norms, scaled
# embeddings, windowed and global layers with their own RoPE bases, linear RoPE scaling), plus a
# QKV-only bias and Gemma 2's soft-capping, at a small shape.
EVERY_KEY = ["model=gemma3_12b", "data=synthetic", "model.num_layers=4", "model.hidden_size=64",
             "model.num_attention_heads=4", "model.num_query_groups=2", "model.kv_channels=24",
             "model.ffn_hidden_size=96", "model.seq_length=32", "model.vocab_size=500", "model.sliding_window=8",
             "model.sliding_window_pattern=2", "model.qkv_bias=true", "model.attn_logit_softcapping=50",
             "model.final_logit_softcapping=30", "model.query_pre_attn_scalar=24", "precision=bf16",
             "data.micro_batch_size=2", "data.global_batch_size=8"]


@pytest.mark.parametrize("overrides", [
    BERT, [*BERT, "parallel=tp2", "trainer.devices=2"], [*BERT, "parallel=pp2", "trainer.devices=2"],
    [*BERT, "model.binary_head=false", "parallel=tp2_pp2", "trainer.devices=4"],
    T5, [*T5, "parallel=tp2", "trainer.devices=2"], [*T5, "model.activation=geglu", "model.tie_embeddings=false"],
    [*EVERY_KEY, "parallel=tp2_pp2", "trainer.devices=4", "model.tie_embeddings=false"],
    [*EVERY_KEY, "parallel=tp2", "trainer.devices=2"],
], ids=["bert", "bert_tp2", "bert_pp2", "bert_no_binary_head_tp2_pp2", "t5", "t5_tp2", "t5_v1.1_untied",
        "gpt_every_key_tp2_pp2_untied", "gpt_every_key_tp2"])
def test_plan_counts_the_real_models_parameters(overrides):
    """Parameters and buffers (the rotary tables) of every rank's model as built."""
    cfg = compose_config(overrides)
    derived = derive(cfg)
    for pp_rank in range(derived.pp):
        row = rank_memory(cfg, derived, pp_rank)
        for tp_rank in range(derived.tp):
            model = _real_model(derived, tp_rank, pp_rank)
            params = list(model.parameters())
            n = sum(p.numel() for p in params)
            assert row.params == n, (pp_rank, tp_rank)
            assert row.buffer_bytes == sum(b.numel() * b.element_size() for b in model.buffers())
            assert row.weight_bytes == sum(p.numel() * p.element_size() for p in params) == 2 * n  # bf16
            # fp32 gradient buffer, fp32 main weights, Adam's two fp32 moments
            assert (row.grad_bytes, row.main_weight_bytes, row.optimizer_bytes) == (4 * n, 4 * n, 8 * n)


@pytest.mark.parametrize("overrides", [BERT, T5], ids=["bert", "t5"])
def test_distributed_optimizer_shards_the_real_parameters(overrides):
    cfg = compose_config([*overrides, "trainer.devices=4", "optim.distributed_optimizer=true"])
    derived = derive(cfg)
    n = sum(p.numel() for p in _real_params(derived, 0, 0))
    shard = math.ceil(n / 4)  # one bucket (40M elements), padded to a multiple of dp
    row = plan_memory(cfg, derived).peak
    assert (row.weight_bytes, row.grad_bytes) == (2 * 4 * shard, 4 * 4 * shard)
    assert (row.main_weight_bytes, row.optimizer_bytes) == (4 * shard, 8 * shard)


# Activations against the dry run --------------------------------------------------------------------

DRY = ["trainer=gpu", "trainer.devices=1", "data.micro_batch_size=1", "data.global_batch_size=1", "precision=bf16",
       "model.hidden_size=512", "model.num_attention_heads=8", "model.ffn_hidden_size=2048", "model.seq_length=512",
       "model.max_position_embeddings=512", "model.vocab_size=256"]

NO_ATTENTION_DROPOUT = ("model.attention_dropout=0",)


def _dry(arch: str, layers: int, *overrides):
    from megatron_hydra.training import dry_run as D

    depth = [f"model.num_layers={layers}"] + ([f"model.num_decoder_layers={layers}"] if arch == "t5" else [])
    cfg = compose_config([f"model={arch}_base", f"data=indexed_{arch}", *DRY, *depth, *overrides])
    derived = derive(cfg)
    (result,) = D.dry_run(cfg, derived, [0])
    return cfg, derived, result


@pytest.mark.parametrize("arch,overrides", [
    ("bert", ()),  # post-LN, padding mask, hidden and attention dropout, the binary head
    # recompute without attention dropout: replaying it aborts on the stand-in GPU
    ("bert", ("parallel=tp2", "trainer.devices=2", "recompute.granularity=selective", *NO_ATTENTION_DROPOUT)),
    ("t5", ()),  # an encoder layer and a decoder layer (cross-attention, ReLU) per step of depth
    ("t5", ("parallel=tp2", "trainer.devices=2", "model.activation=geglu", "recompute.granularity=full",
            *NO_ATTENTION_DROPOUT)),
], ids=["bert", "bert_tp2_selective", "t5", "t5_tp2_geglu_full_recompute"])
def test_activations_match_the_dry_run(arch, overrides):
    """One more layer (T5: one more encoder and one more decoder layer) adds to the step's peak
    what the plan's per-layer terms say, to 1% (as GPT's, tests/test_dry_run.py); the whole step's
    activations and transients, and its state, are the plan's to 10% and 1%."""
    runs = {layers: _dry(arch, layers, *overrides) for layers in (2, 3)}
    peaks = {layers: r.peak_bytes - r.static_bytes for layers, (_, _, r) in runs.items()}
    plans = {layers: rank_memory(c, d, 0).activation_bytes for layers, (c, d, _) in runs.items()}
    # T5 under full recompute: the peak is in the encoder's backward, the decoder's inputs freed.
    assert peaks[3] - peaks[2] == pytest.approx(plans[3] - plans[2], rel=0.01)
    cfg, derived, result = runs[2]
    plan = rank_memory(cfg, derived, 0)
    assert peaks[2] == pytest.approx(plan.activation_bytes + plan.transient_bytes, rel=0.10)
    assert result.static_bytes == pytest.approx(plan.static_bytes, rel=0.01)


# The layout planner --------------------------------------------------------------------------------


def test_t5_flops_are_counted_by_hand():
    """T5-Base, written out per sample: every matmul of its encoder (512 tokens), decoder (128
    tokens, with cross-attention over the encoder's 512) and head, forward and backward (x 3)."""
    from megatron_hydra.planning.flops import model_flops_per_step
    from megatron_hydra.planning.performance import Layout, estimate

    cfg = compose_config(["model=t5_base", "data=indexed_t5", "cluster=a100_40g_x64", "precision=bf16", "trainer=gpu",
                          "trainer.devices=8", "data.global_batch_size=256"])
    tc = derive(cfg).transformer
    h, f, s, t, vocab = 768, 3072, 512, 128, tc.padded_vocab_size  # 12 heads of 64: a k = h
    encoder_layer = s * (2 * h * 3 * h + 2 * h * h + 2 * 2 * h * f + 4 * s * h)
    decoder_layer = (t * (2 * h * 3 * h + 2 * h * h + 2 * 2 * h * f + 4 * t * h)  # self-attention and MLP
                     + t * (2 * h * h + 2 * h * h + 4 * s * h) + s * 2 * h * 2 * h)  # cross: q, out, scores; k, v
    by_hand = 3 * 256 * (12 * encoder_layer + 12 * decoder_layer + t * 2 * h * vocab)
    assert model_flops_per_step(tc, 256) == pytest.approx(by_hand, rel=1e-12)
    step = estimate(tc, 256, Layout(tp=2, pp=1, dp=32, micro_batch=4), cfg.cluster)
    assert step.model_flops == pytest.approx(by_hand, rel=1e-12)
    # Full recompute replays every layer's forward: a quarter more than the model's FLOPs, head aside.
    full = estimate(tc, 256, Layout(tp=2, pp=1, dp=32, micro_batch=4, recompute="full"), cfg.cluster)
    assert full.hardware_flops - full.model_flops == pytest.approx(256 * (12 * encoder_layer + 12 * decoder_layer),
                                                                   rel=1e-12)


@pytest.mark.parametrize("model", ["bert_large", "t5_large"])
def test_plan_layouts_commands_derive(model):
    """``mode=plan_layouts`` for BERT and T5: every printed command derives as its layout, and its
    memory plan passes the launcher's fit check."""
    from megatron_hydra.planning.fit import check_fits
    from megatron_hydra.planning.layouts import Options, _command, base_overrides, plan_layouts

    cfg = compose_config([f"model={model}", f"data=indexed_{model[:model.index('_')]}", "cluster=a100_40g_x64",
                          "data.global_batch_size=256", "mode=plan_layouts"])
    found = plan_layouts(cfg, cfg.cluster, Options(micro_batches=(2, 8), max_vpp=2))
    assert found and not any(c.layout.sequence_parallel or c.layout.fsdp or c.layout.cp > 1 for c in found)
    if model.startswith("t5"):
        assert all(c.layout.pp == 1 for c in found)
    else:
        assert any(c.layout.pp > 1 for c in found)
    for cand in found[:3] + found[-2:]:
        words = _command(base_overrides(cfg), cand, cfg.cluster).split()
        assert words[:4] == ["python", "launch.py", "-m", "hydra/launcher=slurm"]
        run = compose_config([*words[4:], f"trainer.device_memory_gb={cfg.cluster.memory_gb}"])
        derived = derive(run)
        lay = cand.layout
        assert (derived.world_size, derived.tp, derived.pp, derived.dp, run.data.micro_batch_size) == (
            64, lay.tp, lay.pp, lay.dp, lay.micro_batch)
        check_fits(run, derived)


def test_the_plan_modules_import_no_cycle():
    """``planning.memory`` builds on ``planning.memory_archs``, which builds on the shared
    per-layer formulas below both; imports inside functions count, since they run all the same."""
    import ast
    from pathlib import Path

    import megatron_hydra.planning as planning

    folder = Path(planning.__file__).parent
    graph = {}
    for path in folder.glob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
        graph[path.stem] = {n.split(".")[2] for n in names if n.startswith("megatron_hydra.planning.")} - {path.stem}

    def reaches(start, goal, seen=()):
        return any(n == goal or (n not in seen and reaches(n, goal, (*seen, n))) for n in graph.get(start, ()))

    cycles = sorted(m for m in graph if reaches(m, m))
    assert not cycles, f"planning modules on an import cycle: {cycles}"
