"""Every family's name map, in both directions, for the variants the transformers parity tests do
not build (Llama with biases or tied, GPT-2 untied, ...): export then import gives back our tensors
bitwise, and what does not fit is one line naming the tensor. Needs neither transformers nor
files: the tables and their transforms alone."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_hydra.checkpoint.sharded import logical_shapes
from megatron_hydra.config import RunConfig, derive
from megatron_hydra.convert import bert, gemma2, gemma3, gpt2, llama, mistral, mixtral, qwen2, qwen3, qwen3_moe, t5
from megatron_hydra.convert.families import why_not
from megatron_hydra.convert.mapping import HFConfig, HFWeights
from megatron_hydra.convert.name_map import export_weights, import_weights
from megatron_hydra.errors import CheckpointError, ConfigError
from megatron_hydra.models.archs import ARCHS
from megatron_hydra.parallel.state import ParallelState

GPT2 = dict(n_embd=32, n_layer=2, n_head=4, n_positions=16, vocab_size=50)
LLAMA = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=50, max_position_embeddings=16)
BERT = dict(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
            max_position_embeddings=16)
MIXTRAL = dict(LLAMA, num_local_experts=4, num_experts_per_tok=2)
T5 = dict(vocab_size=50, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=3, num_heads=4)
QWEN3_MOE = dict(LLAMA, num_hidden_layers=4, head_dim=12, num_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=16, decoder_sparse_step=2, norm_topk_prob=True)
GEMMA = dict(LLAMA, num_hidden_layers=4, head_dim=12, query_pre_attn_scalar=144, sliding_window=8)

VARIANTS = {
    "gpt2-tied": (gpt2, GPT2),
    "gpt2-untied": (gpt2, dict(GPT2, tie_word_embeddings=False)),
    "llama-gqa-untied": (llama, LLAMA),
    "llama-biases-tied": (llama, dict(LLAMA, attention_bias=True, mlp_bias=True, tie_word_embeddings=True)),
    "bert-masked-lm": (bert, dict(BERT, architectures=["BertForMaskedLM"])),
    "bert-pretraining": (bert, dict(BERT, architectures=["BertForPreTraining"])),
    "mixtral-untied": (mixtral, MIXTRAL),
    "mixtral-tied": (mixtral, dict(MIXTRAL, tie_word_embeddings=True)),
    "t5-v1.0": (t5, T5),
    "t5-v1.1": (t5, dict(T5, feed_forward_proj="gated-gelu", tie_word_embeddings=False)),
    # The Hub's Llama 3.1 layout: rope_scaling beside a top-level rope_theta.
    "llama3.1-rope-scaling": (llama, dict(LLAMA, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8})),
    "qwen2-max-window-layers": (qwen2, dict(LLAMA, num_hidden_layers=3, use_sliding_window=True, sliding_window=4,
                                            max_window_layers=2)),
    "qwen3-tied-yarn": (qwen3, dict(LLAMA, head_dim=12, tie_word_embeddings=True, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 8,
        "beta_fast": 16.0, "attention_factor": 1.5, "truncate": False})),
    "qwen3_moe-every-other-layer": (qwen3_moe, QWEN3_MOE),
    "qwen3_moe-every-layer-windowed": (qwen3_moe, dict(QWEN3_MOE, decoder_sparse_step=1, use_sliding_window=True,
                                                       sliding_window=4)),
    "mistral-no-window": (mistral, dict(LLAMA, sliding_window=None)),
    "gemma2-untied-default-pattern": (gemma2, dict(GEMMA, tie_word_embeddings=False)),
    # Gemma 3's older layout: rope_theta, rope_scaling (the global layers') and rope_local_base_freq.
    "gemma3-older-rope-keys": (gemma3, dict(GEMMA, num_hidden_layers=6, rope_theta=1e6, rope_local_base_freq=1e4,
                                            rope_scaling={"rope_type": "linear", "factor": 8.0},
                                            final_logit_softcapping=30.0)),
}


def _model(family, hf: dict):
    """(TransformerConfig, our logical shapes, random logical tensors) for ``hf``'s config."""
    cfg = RunConfig(model=family.model_config(HFConfig(hf, "config.json"), "test"), run_dir="unused")
    if family.ARCH != "gpt":
        cfg.data.name = "indexed"
    tcfg = derive(cfg).transformer
    shapes = logical_shapes(ARCHS[tcfg.arch].build(tcfg, ParallelState.single(), device="meta"), 1, tcfg.vocab_size)
    gen = torch.Generator().manual_seed(0)
    return tcfg, shapes, {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}


@pytest.mark.parametrize("with_tied", [True, False], ids=["state-dict", "files"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_then_import_gives_back_our_tensors(variant, with_tied):
    family, hf = VARIANTS[variant]
    tcfg, shapes, ours = _model(family, hf)
    theirs = export_weights(family.NAME_MAP, ours, tcfg, with_tied=with_tied)
    weights = HFWeights(dict(theirs), "test")
    back = import_weights(family.NAME_MAP, weights, tcfg, shapes)
    assert sorted(back) == sorted(ours)
    assert all(torch.equal(back[name], tensor) for name, tensor in ours.items())
    assert not weights.unused()
    tied = {n for rule in family.NAME_MAP.rules if rule.tied for _, names in rule.instances(tcfg) for n in names}
    assert (tied <= set(theirs)) if with_tied else not tied & set(theirs)


def _gpt2():
    tcfg, shapes, ours = _model(gpt2, GPT2)
    return tcfg, shapes, export_weights(gpt2.NAME_MAP, ours, tcfg)


def test_bare_gpt2_model_names_import():
    """GPT2Model's files name tensors without ``transformer.``."""
    tcfg, shapes, theirs = _gpt2()
    bare = {name.removeprefix("transformer."): t for name, t in theirs.items()}
    assert len(import_weights(gpt2.NAME_MAP, HFWeights(bare, "test"), tcfg, shapes)) == len(shapes)


def test_missing_and_leftover_tensors_are_one_line_naming_them():
    tcfg, shapes, theirs = _gpt2()
    missing = {n: t for n, t in theirs.items() if n != "transformer.h.1.mlp.c_fc.bias"}
    with pytest.raises(CheckpointError, match=r"input=test has no tensor transformer\.h\.1\.mlp\.c_fc\.bias, which "):
        import_weights(gpt2.NAME_MAP, HFWeights(missing, "test"), tcfg, shapes)
    extra = {**theirs, "transformer.h.0.attn.q_norm.weight": torch.ones(8), "transformer.h.0.attn.bias": torch.ones(1)}
    with pytest.raises(CheckpointError, match=r"tensor transformer\.h\.0\.attn\.q_norm\.weight has no place in a "
                                              "gpt2 model of this config; this variant is not supported"):
        import_weights(gpt2.NAME_MAP, HFWeights(extra, "test"), tcfg, shapes)  # .attn.bias: an ignored buffer


def test_a_table_that_misses_a_tensor_is_one_line_each_way():
    tcfg, shapes, theirs = _gpt2()
    rules = tuple(r for r in gpt2.NAME_MAP.rules if "ln_f" not in str(r.theirs))
    partial = dataclasses.replace(gpt2.NAME_MAP, rules=rules)
    with pytest.raises(CheckpointError, match=r"nothing maps to our tensor final_norm\.(weight|bias); this variant"):
        import_weights(partial, HFWeights(theirs, "test"), tcfg, shapes)
    ours = {name: torch.zeros(shape) for name, shape in shapes.items()}
    with pytest.raises(ConfigError, match="our tensor final_norm.bias has no place in a Hugging Face gpt2 model"):
        export_weights(partial, ours, tcfg)
    with pytest.raises(ConfigError, match="this model has no tensor position_embedding.weight"):
        export_weights(gpt2.NAME_MAP, {n: t for n, t in ours.items() if n != "position_embedding.weight"}, tcfg)


def test_mixtral_experts_by_name_and_the_refusals():
    """Each expert's w1 / w3 / w2 (the names of Mixtral's files) is our gate / fc1 / fc2; a
    sliding window is refused on import, and the GPT families' export checks tell MoE from dense."""
    tcfg, shapes, ours = _model(mixtral, MIXTRAL)
    theirs = export_weights(mixtral.NAME_MAP, ours, tcfg)
    layer = "model.layers.1.block_sparse_moe."
    for hf_name, our_name in (("experts.3.w1", "experts.3.gate"), ("experts.3.w3", "experts.3.fc1"),
                              ("experts.0.w2", "experts.0.fc2"), ("gate", "router")):
        assert torch.equal(theirs[f"{layer}{hf_name}.weight"], ours[f"layers.1.mlp.{our_name}.weight"])
    assert tcfg.moe.router == "softmax" and tcfg.moe.norm_topk and tcfg.moe_layers == (0, 1)
    with pytest.raises(ConfigError, match="Mixtral sliding_window=4096 is not supported"):
        mixtral.model_config(HFConfig(dict(MIXTRAL, sliding_window=4096), "config.json"), "test")
    dense, _, _ = _model(llama, LLAMA)
    assert why_not(llama, tcfg) and why_not(mixtral, dense) and not why_not(mixtral, tcfg)


GPT_VARIANTS = [name for name, (family, _) in VARIANTS.items() if family.ARCH == "gpt"]


@pytest.mark.parametrize("variant", GPT_VARIANTS)
def test_config_json_round_trip_gives_back_our_model_config(variant):
    """model_config(hf_config(model)) is the model: every key each family writes, it reads back."""
    family, hf = VARIANTS[variant]
    model = family.model_config(HFConfig(hf, "config.json"), "test")
    tcfg = derive(RunConfig(model=model, run_dir="unused")).transformer
    assert why_not(family, tcfg) == ""
    assert family.model_config(HFConfig(family.hf_config(tcfg), "config.json"), "test") == model


def test_the_keys_each_family_reads():
    def model(variant):
        family, hf = VARIANTS[variant]
        return family.model_config(HFConfig(hf, "config.json"), "test")

    rope = model("llama3.1-rope-scaling").rope_scaling
    assert (rope.type, rope.factor, rope.original_max_position_embeddings) == ("llama3", 8.0, 8)
    assert model("llama3.1-rope-scaling").rope_theta == 500000.0
    yarn = model("qwen3-tied-yarn").rope_scaling
    assert (yarn.beta_fast, yarn.beta_slow, yarn.attention_factor, yarn.truncate) == (16.0, 1.0, 1.5, False)
    qwen2_window = model("qwen2-max-window-layers")
    assert (qwen2_window.sliding_window, qwen2_window.sliding_window_pattern) == (4, [0, 0, 1])
    moe = model("qwen3_moe-every-other-layer").moe
    assert (moe.layer_freq, moe.ffn_hidden_size, moe.norm_topk) == ([0, 1, 0, 1], 16, True)
    assert model("qwen3_moe-every-layer-windowed").sliding_window_pattern == 1
    assert model("gemma2-untied-default-pattern").sliding_window_pattern == 2  # every other layer, from the first
    gemma = model("gemma3-older-rope-keys")
    assert (gemma.rope_theta, gemma.local_rope_theta, gemma.rope_scaling.type, gemma.sliding_window_pattern) == (
        1e6, 1e4, "linear", 6)


@pytest.mark.parametrize("family, hf, message", [
    (llama, dict(LLAMA, rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}),
     "config.json: rope_type='longrope' is not supported: llama3, linear, yarn are"),
    (llama, dict(LLAMA, rope_scaling={"type": "dynamic", "factor": 2.0}),
     "config.json: rope_scaling.rope_type='dynamic' is not supported: llama3, linear, yarn are"),
    (qwen3, dict(LLAMA, partial_rotary_factor=0.5), "config.json: partial_rotary_factor=0.5 is not supported"),
    (qwen3, dict(LLAMA, rope_parameters={"rope_type": "yarn", "factor": 4.0, "mscale": 0.7}),
     "config.json: mscale=0.7 is not supported"),
    (llama, dict(LLAMA, attention_bias=True), "config.json: attention_bias=true is not supported"),
    (qwen3_moe, dict(QWEN3_MOE, decoder_sparse_step=0), "config.json: decoder_sparse_step=0 is not supported"),
    (gemma2, dict(GEMMA, layer_types=["sliding_attention", "chunked_attention"] * 2),
     'config.json: layer_types=["sliding_attention", "chunked_attention", '),
    (gemma3, dict(GEMMA, rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                          "sliding_attention": {"rope_type": "linear", "factor": 2.0}}),
     "config.json: rope_parameters.sliding_attention.rope_type='linear' is not supported"),
    (gemma3, dict(GEMMA, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
     "config.json: rope_parameters={"),
], ids=["longrope", "dynamic-older-layout", "partial-rotary", "yarn-mscale", "llama-attention-bias-alone",
        "sparse-step", "layer-type", "gemma3-scaled-local-rope", "gemma3-one-rope"])
def test_unsupported_values_are_one_line_naming_file_key_and_value(family, hf, message):
    with pytest.raises(ConfigError) as err:
        family.model_config(HFConfig(hf, "config.json"), "test")
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def _tcfg(overrides: dict):
    from megatron_hydra.config.schema import ModelConfig

    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=50,
                position_embedding="rope", normalization="rmsnorm", activation="swiglu", add_bias_linear=False)
    return derive(RunConfig(model=ModelConfig(**{**base, **overrides}), run_dir="unused")).transformer


@pytest.mark.parametrize("overrides, family", [
    ({}, "llama"),
    ({"rope_scaling": {"type": "llama3"}}, "llama"),
    ({"qkv_bias": True}, "qwen2"),
    ({"sliding_window": 8}, "mistral"),
    ({"sliding_window": 8, "sliding_window_pattern": [1, 0], "qkv_bias": True}, "qwen2"),
    ({"qk_norm": True}, "qwen3"),
    ({"qk_norm": True, "moe": {"num_experts": 4, "top_k": 2, "layer_freq": [0, 1], "norm_topk": False}}, "qwen3_moe"),
    ({"moe": {"num_experts": 4, "top_k": 2}}, "mixtral"),
    (dict(activation="geglu", zero_centered_gamma=True, post_sublayer_norm=True, scale_embeddings=True,
          attn_logit_softcapping=50.0), "gemma2"),
    (dict(activation="geglu", zero_centered_gamma=True, post_sublayer_norm=True, scale_embeddings=True,
          qk_norm=True, sliding_window=8, sliding_window_pattern=2, local_rope_theta=1e4), "gemma3_text"),
])
def test_export_picks_the_plainest_family_that_expresses_the_model(overrides, family):
    from megatron_hydra.config.schema import MoEConfig, RopeScalingConfig
    from megatron_hydra.convert.families import family_for

    if "rope_scaling" in overrides:
        overrides = dict(overrides, rope_scaling=RopeScalingConfig(**overrides["rope_scaling"]))
    if "moe" in overrides:
        overrides = dict(overrides, moe=MoEConfig(**overrides["moe"]))
    assert family_for(_tcfg(overrides)).MODEL_TYPE == family


@pytest.mark.parametrize("overrides, reason", [
    ({"sliding_window": 8, "sliding_window_pattern": [1, 0]}, "Mistral windows every layer or none"),
    ({"final_logit_softcapping": 30.0}, "llama has no model.final_logit_softcapping"),
    ({"qkv_bias": False, "add_bias_linear": True}, "Qwen2 has biases on q, k and v alone"),
])
def test_a_model_no_family_expresses_is_one_line_with_each_reason(overrides, reason):
    from megatron_hydra.convert.families import family_for

    with pytest.raises(ConfigError) as err:
        family_for(_tcfg(overrides))
    assert "has no Hugging Face counterpart" in str(err.value) and reason in str(err.value)


def test_shapes_are_checked_on_a_model_cut_to_one_layer_of_each_kind():
    """An MoE model with dense layers keeps one of each; per-layer lists are cut alike, the
    window dropped (it holds no tensor)."""
    from megatron_hydra.convert.name_map import first_layers

    model = qwen3_moe.model_config(HFConfig(dict(QWEN3_MOE, use_sliding_window=True, sliding_window=4), "c"), "t")
    model.sliding_window_pattern = [0, 1, 1, 0]
    cut = first_layers(model)
    assert (cut.num_layers, cut.moe.layer_freq, cut.sliding_window) == (2, [0, 1], None)
    tcfg = derive(RunConfig(model=cut, run_dir="unused")).transformer
    assert tcfg.moe_layers == (1,)
    assert first_layers(llama.model_config(HFConfig(LLAMA, "c"), "t")).num_layers == 1


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}


@pytest.mark.parametrize("family, hf, message", [
    *((gemma3, dict(GEMMA, rope_parameters={"full_attention": bad, "sliding_attention": {"rope_type": "default"}}),
       "config.json: rope_parameters.full_attention=") for bad in ("abc", [1, 2], 5)),
    (gemma3, dict(GEMMA, rope_parameters={"full_attention": {}, "sliding_attention": [[1]]}),
     "config.json: rope_parameters.sliding_attention=[[1]] should be an object"),
    (qwen3_moe, dict(QWEN3_MOE, mlp_only_layers=[[1]]), "config.json: mlp_only_layers=[[1]] is not supported"),
    (qwen3_moe, dict(QWEN3_MOE, mlp_only_layers=[0.5]), "config.json: mlp_only_layers=[0.5] is not supported"),
    (qwen3, dict(LLAMA, rope_parameters=dict(YARN, original_max_position_embeddings=0)),
     "config.json: original_max_position_embeddings=0 is not supported"),
    (qwen3, dict(LLAMA, original_max_position_embeddings=0, rope_parameters={"rope_type": "yarn"}),
     "config.json: original_max_position_embeddings=0 is not supported"),
    (qwen3, dict(LLAMA, max_position_embeddings=0, rope_parameters={"rope_type": "yarn", "factor": 0}),
     "config.json: max_position_embeddings=0 is not supported"),
    (llama, dict(LLAMA, rope_theta=0), "config.json: rope_theta=0.0 is not supported"),
    (llama, dict(LLAMA, num_attention_heads=0), "config.json: num_attention_heads=0 is not supported"),
    (mistral, dict(LLAMA, sliding_window=-4), "config.json: sliding_window=-4 is not supported"),
], ids=["full-str", "full-list", "full-int", "sliding-nested-list", "mlp-only-nested-list", "mlp-only-float",
        "yarn-original-0", "yarn-top-original-0", "yarn-positions-0", "theta-0", "heads-0", "window-negative"])
def test_hostile_values_are_one_line_not_a_traceback(family, hf, message):
    """Values of the right JSON kind in the wrong place (an object where a number is, a list in a
    list, a zero that is divided by) from a crafted config.json: one line naming the key."""
    with pytest.raises((CheckpointError, ConfigError)) as err:
        family.model_config(HFConfig(hf, "config.json"), "test")
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


@pytest.mark.timeout(20)
def test_window_pattern_of_a_million_layers_is_read_at_once():
    """One candidate n per pattern (the first full layer's number + 1), checked in one pass: the
    smallest n that gives the flags, or the 0/1 list when none does, as a search over every n would
    give, in time linear in the layers (a search over every n takes days at a million)."""
    from megatron_hydra.convert import layer_types

    million = 10**6
    assert layer_types.pattern([bool((i + 1) % 6) for i in range(million)]) == 6
    assert layer_types.pattern([True] * million) == 1
    irregular = [bool((i + 1) % 2) for i in range(million - 1)] + [True]  # the last one would be global
    assert layer_types.pattern(irregular) == [int(f) for f in irregular]
    assert layer_types.pattern([bool((i + 1) % 6) for i in range(12)], declared=6) == 6
    assert layer_types.pattern([True, True, False, True, True], declared=2) == 3  # the file's own, if it fits


def test_every_family_is_held_to_the_keys_it_expresses(monkeypatch):
    """The architecture-key check is made for every family by ``families``, not left to each
    family's ``compatible``: a family that forgets it still cannot export a model that computes
    something its architecture does not."""
    import types

    from megatron_hydra.convert import families

    careless = types.SimpleNamespace(MODEL_TYPE="careless", ARCH="gpt", EXPRESSES=("rope_scaling",),
                                     FEATURES=("rope_scaling",), compatible=lambda cfg: "")
    monkeypatch.setattr(families, "FAMILIES", {"careless": careless, **families.FAMILIES})
    tcfg = _tcfg({"qk_norm": True})
    assert families.why_not(careless, tcfg) == "careless has no model.qk_norm"
    assert families.family_for(tcfg).MODEL_TYPE == "qwen3"


def test_import_is_one_lazy_walk_that_reads_each_tensor_when_made():
    """``import_tensors`` (what a conversion streams) reads nothing until a tensor is made, then only
    its sources, each once; ``import_weights`` is the same walk made at once."""
    from megatron_hydra.convert.name_map import import_tensors

    tcfg, shapes, ours = _model(qwen3, VARIANTS["qwen3-tied-yarn"][1])
    theirs = {n: t.to(torch.bfloat16 if "norm" in n else torch.float32)
              for n, t in export_weights(qwen3.NAME_MAP, ours, tcfg).items()}
    reads = []

    class Counting(dict):
        def __getitem__(self, name):
            reads.append(name)
            return dict.__getitem__(self, name)

    weights = HFWeights(Counting(theirs), "test")
    lazy = import_tensors(qwen3.NAME_MAP, weights, tcfg, shapes)
    assert reads == [] and sorted(lazy) == sorted(shapes)
    qkv = lazy["layers.1.attention.qkv.weight"]
    assert (qkv.shape, qkv.dtype, lazy["layers.0.attention.q_norm.weight"].dtype) == (
        tuple(shapes["layers.1.attention.qkv.weight"]), torch.float32, torch.bfloat16)
    assert torch.equal(qkv.make(), ours["layers.1.attention.qkv.weight"])
    assert sorted(reads) == [f"model.layers.1.self_attn.{x}_proj.weight" for x in "kqv"]
    reads.clear()
    made = {name: t.make() for name, t in lazy.items()}
    assert all(torch.equal(made[n], t.to(made[n].dtype)) for n, t in ours.items())
    assert sorted(reads) == sorted(n for n in theirs if n != "lm_head.weight")  # each once; the tied copy never
