"""The presets of today's open models (``conf/model/``) and what the planning counts of their keys.

References: the published config.json of each model, as the Hugging Face import reads it; the
parameter counts transformers' models of those configs hold (their model cards' totals; Gemma 3's
language model alone); the layout each preset states in its own comment,
which the memory plan must fit and the dry run must step at full width; a brute-force count of the
keys sliding-window attention reads; and, for the presets with the new keys, the bytes one more
layer adds to the dry run's peak against the plan's per-layer terms. (The plan's parameters and
buffers against the model built with every new key: tests/test_memory_plan_archs.py.)
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import pytest

from conftest import CONF, compose_config
from megatron_hydra.config import derive
from megatron_hydra.planning.flops import model_flops_per_step
from megatron_hydra.planning.memory import GIB, plan_memory, rank_memory

# Parameters of the published checkpoints (transformers' models of their config.json, vocabulary
# unpadded): Llama 3.1 8B / 70B, Llama 3.2 1B / 3B, Qwen2.5 7B, Qwen3 8B, Qwen3-30B-A3B, Mistral 7B
# v0.1, Gemma 2 9B, and Gemma 3 12B's language model (its 12.2B total includes the vision tower).
PUBLISHED = {
    "llama3.1_8b": 8_030_261_248, "llama3.1_70b": 70_553_706_496, "llama3.2_1b": 1_235_814_400,
    "llama3.2_3b": 3_212_749_824, "qwen2.5_7b": 7_615_616_512, "qwen3_8b": 8_190_735_360,
    "qwen3_30b_a3b": 30_532_122_624, "mistral_7b": 7_241_732_096, "gemma2_9b": 9_241_705_984,
    "gemma3_12b": 11_766_034_176,
}
PRESETS = tuple(PUBLISHED)

# The published config.json of each (the keys our import reads; Hugging Face's defaults left out).
_LLAMA3 = dict(vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5, hidden_act="silu",
               max_position_embeddings=131072)
_QWEN = dict(rope_theta=1e6, rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=False, use_sliding_window=False)
_GEMMA = dict(head_dim=256, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256,
              num_attention_heads=16, num_key_value_heads=8)


def _llama3_scaling(factor: float) -> dict:
    return dict(rope_type="llama3", factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=8192)


HF_CONFIGS = {
    "llama3.1_8b": ("llama", dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                  num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False,
                                  rope_scaling=_llama3_scaling(8.0))),
    "llama3.1_70b": ("llama", dict(_LLAMA3, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                   num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False,
                                   rope_scaling=_llama3_scaling(8.0))),
    "llama3.2_1b": ("llama", dict(_LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, head_dim=64,
                                  num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True,
                                  rope_scaling=_llama3_scaling(32.0))),
    "llama3.2_3b": ("llama", dict(_LLAMA3, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, head_dim=128,
                                  num_attention_heads=24, num_key_value_heads=8, tie_word_embeddings=True,
                                  rope_scaling=_llama3_scaling(32.0))),
    "qwen2.5_7b": ("qwen2", dict(_QWEN, vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                                 num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                                 max_position_embeddings=131072)),
    "qwen3_8b": ("qwen3", dict(_QWEN, vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                               num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960)),
    "qwen3_30b_a3b": ("qwen3_moe", dict(_QWEN, vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                        max_position_embeddings=40960, moe_intermediate_size=768, num_experts=128,
                                        num_experts_per_tok=8, norm_topk_prob=True, router_aux_loss_coef=0.001)),
    "mistral_7b": ("mistral", dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                   num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768,
                                   rope_theta=10000.0, rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=False,
                                   sliding_window=4096)),
    "gemma2_9b": ("gemma2", dict(_GEMMA, vocab_size=256000, hidden_size=3584, intermediate_size=14336,
                                 num_hidden_layers=42, max_position_embeddings=8192, rope_theta=10000.0,
                                 sliding_window=4096, final_logit_softcapping=30.0, attn_logit_softcapping=50.0)),
    "gemma3_12b": ("gemma3_text", dict(_GEMMA, vocab_size=262208, hidden_size=3840, intermediate_size=15360,
                                       num_hidden_layers=48, max_position_embeddings=131072, rope_theta=1e6,
                                       rope_local_base_freq=10000.0, rope_scaling=dict(rope_type="linear", factor=8.0),
                                       sliding_window=1024, sliding_window_pattern=6)),
}
# The dry run's depth: a layer or two per pipeline stage at full width; Gemma 3's five local layers
# to one global become one to one, so that both kinds run.
FEW_LAYERS = {"llama3.1_70b": ["model.num_layers=4"], "gemma3_12b": ["model.num_layers=2", "model.sliding_window_pattern=2"]}
# Presets with the new keys whose per-layer bytes the dry run checks: a window with grouped-query
# K/V repeated (Mistral); soft-capped scores under selective recompute, windowed and global layers,
# zero-centred pre- and post-sub-layer norms (Gemma 2); QK-norm over query heads gathered from
# several groups (Gemma 3, at tp4: two groups a rank).
PER_LAYER = ("mistral_7b", "gemma2_9b", "gemma3_12b")


def stated_layout(name: str) -> List[str]:
    """The overrides of the layout a preset's comment states (``# Layout ...`` and its ``#   `` lines)."""
    lines = (CONF / "model" / f"{name}.yaml").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# Layout"))
    words = []
    for line in lines[start + 1:]:
        if not line.startswith("#   "):
            break
        words += line[1:].split()
    return words


def _compose(name: str, *overrides: str):
    cfg = compose_config([f"model={name}", "data=synthetic", *overrides])
    return cfg, derive(cfg)


@pytest.mark.parametrize("name", PRESETS)
def test_preset_has_the_published_size(name):
    cfg, derived = _compose(name)
    tc = derived.transformer
    padding = (tc.padded_vocab_size - tc.vocab_size) * tc.hidden_size * (1 if tc.tie_embeddings else 2)
    assert rank_memory(cfg, derived, 0).params - padding == PUBLISHED[name]


@pytest.mark.parametrize("name", PRESETS)
def test_preset_is_what_the_published_config_imports_as(name):
    """Every model key of the preset equals what ``convert from_hf`` reads from the published
    config.json, but the training length (the import keeps at most 4096 positions' tables)."""
    from megatron_hydra.convert import families
    from megatron_hydra.convert.mapping import HFConfig

    kind, hf = HF_CONFIGS[name]
    imported = families.FAMILIES[kind].model_config(HFConfig({"model_type": kind, **hf}, "config.json"), name)
    preset = compose_config([f"model={name}"]).model
    for m in (preset, imported):
        m.kv_channels = m.kv_channels or m.hidden_size // m.num_attention_heads
        m.seq_length = None
    assert preset == imported


def test_every_preset_states_a_layout_that_fits():
    for name in PRESETS:
        layout = stated_layout(name)
        assert "trainer=gpu" in layout and "precision=bf16" in layout, name
        cfg, derived = _compose(name, *layout)
        plan = plan_memory(cfg, derived)
        assert plan.fits and plan.device_bytes == 80 * GIB, (name, plan.peak.needed_bytes / GIB)


# The dry runs: every preset at its layout, in one process of their own --------------------------

def _dry_runs(cases):
    """Every case's dry run, in this (fresh) process: the stand-in GPU is registered before any
    backward runs, as ``training.dry_run`` does for a process of its own."""
    from megatron_hydra.training import dry_run as D
    from megatron_hydra.training import fake_gpu

    fake_gpu.register(own_process=True)
    return [D.simulate_rank(cfg, derived, rank) for cfg, derived, rank in cases]


@pytest.fixture(scope="module")
def dry_runs() -> Dict[Tuple[str, int], tuple]:
    """(preset, layers) -> (cfg, derived, rank, result): each preset at its stated layout with few
    layers, on its last rank (last stage, last TP rank: the head and the vocabulary's padding); the
    PER_LAYER presets at two more layers too."""
    from megatron_hydra.training.dry_run import run_in_own_process

    cases = {}
    for name in PRESETS:
        depth = FEW_LAYERS.get(name, ["model.num_layers=2"])
        layers = int(depth[0].split("=")[1])
        for extra in ((0, 2) if name in PER_LAYER else (0,)):
            cfg, derived = _compose(name, *stated_layout(name), *depth, f"model.num_layers={layers + extra}")
            cases[name, layers + extra] = (cfg, derived, derived.world_size - 1)
    results = run_in_own_process(_dry_runs, list(cases.values()))
    return {key: (*case, result) for (key, case), result in zip(cases.items(), results)}


@pytest.mark.parametrize("name", PRESETS)
def test_preset_steps_at_its_layout_within_plan(name, dry_runs):
    """Weights, grads, fp32 main weights, Adam state and the rotary tables (several MiB) after the
    step are the plan's to within 1 MiB; nothing reads a device value in the step."""
    (cfg, derived, rank, result), = [v for (n, _), v in sorted(dry_runs.items()) if n == name][:1]
    assert result.loss_dtype == "float32" and result.host_syncs == []
    assert abs(result.static_bytes - result.plan_static_bytes) < 2**20
    assert result.peak_bytes > result.static_bytes and result.save_items > 0


@pytest.mark.parametrize("name", PER_LAYER)
def test_one_more_layer_adds_the_plans_bytes(name, dry_runs):
    """Two more layers (one windowed and one global for Gemma) add to the step's peak what the
    plan's per-layer terms say, to 1%."""
    runs = sorted((layers, v) for (n, layers), v in dry_runs.items() if n == name)
    (few, (cfg, derived, rank, small)), (more, (cfg2, derived2, _, large)) = runs
    stage = derived.pp - 1
    measured = (large.peak_bytes - large.static_bytes) - (small.peak_bytes - small.static_bytes)
    planned = rank_memory(cfg2, derived2, stage).activation_bytes - rank_memory(cfg, derived, stage).activation_bytes
    assert measured == pytest.approx(planned, rel=0.01)


# FLOPs of sliding-window attention ----------------------------------------------------------------

def test_window_flops_count_the_keys_each_query_sees():
    """Model FLOPs of a model whose even layers have a window, against a count over every query:
    a windowed layer's query at position i reads min(window, i + 1) keys, a global layer's all s
    (Megatron counts causal attention unmasked); a window as long as the sequence binds nothing."""
    from megatron_hydra.planning.performance import Layout, estimate

    shape = ["model=gpt_tiny", "model.position_embedding=rope", "model.seq_length=96", "model.num_layers=4",
             "model.sliding_window_pattern=2", "cluster=h100_80g_x1024", "data.global_batch_size=8"]
    for window, windowed_keys in ((20, sum(min(20, i + 1) for i in range(96))), (96, 96 * 96), (500, 96 * 96)):
        cfg, derived = _compose("gpt_tiny", *shape, f"model.sliding_window={window}")
        tc = derived.transformer
        h, a, d, g, f, s = tc.hidden_size, tc.num_attention_heads, tc.kv_channels, tc.num_query_groups, tc.ffn_hidden_size, 96
        per_token = 2 * h * (a + 2 * g) * d + 2 * a * d * h + 2 * 2 * h * f  # QKV, output, MLP (gelu: 2 matrices)
        keys = sum(windowed_keys if layer % 2 == 0 else s * s for layer in range(4))  # layers 0, 2 windowed
        by_hand = 3 * 8 * (s * (4 * per_token + 2 * h * tc.padded_vocab_size) + 2 * 2 * a * d * keys)
        assert model_flops_per_step(tc, 8) == pytest.approx(by_hand, rel=1e-12), window
        step = estimate(tc, 8, Layout(tp=1, pp=1, dp=1, micro_batch=8), cfg.cluster)
        assert step.model_flops == pytest.approx(by_hand, rel=1e-12), window


def test_gpu_kernels_compute_what_their_masks_cannot_skip():
    """The step-time model's attention work per layer (planning.performance): a causal flash kernel
    computes half the scores Megatron counts; a binding window runs the masked kernel, which
    computes every score though the model FLOPs count only the window's; soft-capped scores run in
    plain ops, every score at the matmuls' rate plus their element passes, which cost time."""
    from megatron_hydra.planning.performance import Layout, estimate, layer_stacks

    base = ["model.position_embedding=rope", "model.seq_length=4096", "model.num_layers=2", "cluster=h100_80g_x1024"]
    runs = {name: _compose("gpt_tiny", *base, *extra) for name, extra in (
        ("plain", []), ("window", ["model.sliding_window=64"]), ("capped", ["model.attn_logit_softcapping=50"]))}
    (plain,), (window,), (capped,) = (layer_stacks(d.transformer) for _, d in runs.values())
    dense = plain.attention_dense
    assert (plain.attention, plain.attention_fused, plain.attention_plain, plain.capped) == (dense, dense / 2, 0, 0)
    assert window.attention == dense * (64 * 4096 - 64 * 63 / 2) / 4096 ** 2
    assert (window.attention_fused, window.attention_plain, window.attention_dense) == (dense, 0, dense)
    assert (capped.attention, capped.attention_fused, capped.attention_plain, capped.capped) == (dense, 0, dense, 1)
    lay = Layout(tp=1, pp=1, dp=1, micro_batch=1)
    seconds = {name: estimate(d.transformer, 1, lay, cfg.cluster).compute for name, (cfg, d) in runs.items()}
    assert seconds["plain"] < seconds["window"] < seconds["capped"]
