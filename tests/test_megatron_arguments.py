"""Megatron-LM's arguments -> our model and training settings, and our model -> Megatron-LM's flags.

The rules are Megatron-Core 0.16's own (its MLP, ``linear_qkv``, ``TransformerConfig``) and
Megatron-LM's argument defaults, checked here on the arguments ``megatron_reference.args_of``
gives its models (without Megatron-Core: it is imported nowhere here). A feature we lack is one
line naming the argument; the export's flags must give back the activation and biases the
import read.
"""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("key,value,shown", [
    ("rotary_percent", 0.5, "rotary_percent=0.5"), ("num_experts", 8, "num_experts=8"),
    ("position_embedding_type", "mrope", "position_embedding_type='mrope'"),
    ("rotary_interleaved", True, "rotary_interleaved=true"), ("no_rope_freq", 4, "no_rope_freq=4"),
    ("softmax_type", "off-by-one", "softmax_type='off-by-one'"),
    ("attention_output_gate", True, "attention_output_gate"),
    ("glu_linear_offset", 1.0, "glu_linear_offset=1.0"), ("activation_func_clamp_value", 7.0, "clamp_value=7.0"),
    ("experimental_attention_variant", "gated_delta_net", "gated_delta_net"),
    ("linear_attention_freq", 4, "linear_attention_freq=4"),
])
def test_features_we_lack_are_one_line(key, value, shown):
    import megatron_reference as ref

    from megatron_hydra.convert.megatron_args import model_of
    from megatron_hydra.errors import MegatronHydraError

    args = ref.args_of("llama", 1, 1, enums=False)
    setattr(args, key, value)
    with pytest.raises(MegatronHydraError) as e:
        model_of(args, "common.pt", "x")
    assert shown in str(e.value) and "\n" not in str(e.value)


def test_learned_positions_switched_off_are_one_line():
    import megatron_reference as ref

    from megatron_hydra.convert.megatron_args import model_of
    from megatron_hydra.errors import ConfigError

    args = ref.args_of("gpt", 1, 1, enums=False)
    args.add_position_embedding = False
    with pytest.raises(ConfigError, match="add_position_embedding=false .*without position embeddings"):
        model_of(args, "common.pt", "x")
    args.position_embedding_type = "rope"  # ignored with RoPE, as Megatron-LM ignores it
    assert model_of(args, "common.pt", "x").model.position_embedding == "rope"


def test_vocabulary_from_arguments():
    import megatron_reference as ref

    from megatron_hydra.convert.megatron_args import model_of

    assert model_of(ref.args_of("gpt", 1, 1, enums=False), "common.pt", "x").model.vocab_size == 100
    args = ref.args_of("gpt", 1, 1, enums=False)
    args.tokenizer_type = "GPT2BPETokenizer"
    other = model_of(args, "common.pt", "x")
    assert other.model.vocab_size == 256 and "padded" in other.notes[0]


def _transformer(model):
    from megatron_hydra.checkpoint import standalone
    from megatron_hydra.config import RunConfig

    return standalone.single_process(RunConfig(model=model, run_dir="unused"))[1].transformer


# Megatron-Core's MLP: the tanh GeLU is its fused bias-GeLU (bias_gelu_fusion, which needs biases)
# or Transformer Engine's activation; openai_gelu reaches the pre-Megatron-Core models only.
GELU_CASES = [  # add_bias_linear, bias_gelu_fusion, use_te_activation_func, openai_gelu, use_legacy_models
    ((True, True, False, False, False), "gelu_tanh"), ((True, False, False, False, False), "gelu"),
    ((False, True, False, False, False), "gelu"), ((False, False, True, False, False), "gelu_tanh"),
    ((True, False, False, True, False), "gelu"), ((True, False, False, True, True), "gelu_tanh"),
]


@pytest.mark.parametrize("flags,expected", GELU_CASES)
def test_gelu_follows_megatron_core_and_goes_back(flags, expected):
    """The activation Megatron-Core computes, and the export's flags giving it back (or refusing)."""
    import megatron_reference as ref

    from megatron_hydra.convert.megatron_args import model_of
    from megatron_hydra.convert.megatron_export import flags as export_flags, why_not

    args = ref.args_of("gpt", 1, 1, enums=False)
    (args.add_bias_linear, args.bias_gelu_fusion, args.use_te_activation_func, args.openai_gelu,
     args.use_legacy_models) = flags
    args.add_qkv_bias = args.add_bias_linear
    model = model_of(args, "common.pt", "x").model
    assert model.activation == expected
    tcfg = _transformer(model)
    if expected == "gelu_tanh" and not model.add_bias_linear:
        assert "gelu_tanh without biases" in why_not(tcfg)
        return
    back = export_flags(tcfg, "out")
    assert why_not(tcfg) == "" and "--openai-gelu" not in back
    bias, fused = "--disable-bias-linear" not in back, "--no-bias-gelu-fusion" not in back
    assert ("gelu_tanh" if bias and fused else "gelu") == expected


def test_qkv_bias_and_rope_base_go_both_ways():
    import megatron_reference as ref

    from megatron_hydra.convert.megatron_args import model_of
    from megatron_hydra.convert.megatron_export import flags as export_flags, why_not

    args = ref.args_of("gpt", 1, 1, enums=False)
    args.add_qkv_bias = False  # linear_qkv keeps its bias with add_bias_linear
    model = model_of(args, "common.pt", "x").model
    assert _transformer(model).qkv_bias
    model.qkv_bias = False
    assert "model.qkv_bias=false" in why_not(_transformer(model))
    args = ref.args_of("llama", 1, 1, enums=False)
    args.add_qkv_bias = True  # Qwen2's layout: biases on QKV only
    model = model_of(args, "common.pt", "x").model
    back = export_flags(_transformer(model), "out")
    assert model.qkv_bias is True and "--disable-bias-linear" in back and "--add-qkv-bias" in back
    assert back[back.index("--seq-length") + 1] == "16" and back[back.index("--rotary-base") + 1] == "50000"
    model.rope_theta = 10000.5
    assert "--rotary-base is an integer" in why_not(_transformer(model))


def test_export_names_the_tokenizer():
    from megatron_hydra.config.schema import DataConfig, TokenizerConfig
    from megatron_hydra.convert.megatron_export import tokenizer_flags

    assert tokenizer_flags(DataConfig(name="synthetic"), 100) == (["--tokenizer-type", "NullTokenizer",
                                                                   "--vocab-size", 99], [])
    hf = DataConfig(name="indexed", tokenizer=TokenizerConfig(type="hf", path="tok/tokenizer.json"))
    assert tokenizer_flags(hf, 100) == (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "tok"], [])
    flags, notes = tokenizer_flags(DataConfig(name="demo"), 8192)
    assert flags[-1] == 8191 and "no Megatron-LM counterpart" in notes[0]
    missing = DataConfig(name="indexed", tokenizer=TokenizerConfig(type="gpt2_bpe", path="no/such/vocab.json"))
    flags, notes = tokenizer_flags(missing, 100)  # its files are not here: the stand-in, and why
    assert flags[:2] == ["--tokenizer-type", "NullTokenizer"] and "data.tokenizer.path=no/such/vocab.json" in notes[0]


def test_training_settings_from_arguments():
    """What the run trained with becomes our overrides (Megatron-LM's warmup fraction of the decay)."""
    import megatron_reference as ref

    from megatron_hydra.config import bundled
    from megatron_hydra.convert.megatron_args import training

    args = ref.args_of("gpt", 1, 1, enums=False)
    args.bf16, args.lr_decay_style, args.lr_decay_iters, args.lr_warmup_fraction = True, "cosine", 16, 0.25
    overrides, notes = training(args, "common.pt")
    assert overrides == {"precision": "bf16", "optim.lr": 1e-2, "optim.min_lr": 0.0, "optim.adam_beta1": 0.9,
                         "optim.adam_beta2": 0.999, "optim.adam_eps": 1e-8, "optim.weight_decay": 0.01,
                         "optim.clip_grad": 0.0, "optim.lr_schedule": "cosine", "trainer.max_steps": 20,
                         "optim.decay_steps": 16, "optim.warmup_steps": 4, "data.global_batch_size": 8,
                         "data.micro_batch_size": 4} and notes == []
    cfg = bundled.compose([f"{k}={v}" for k, v in overrides.items()])  # every key is one of ours
    assert (cfg.optim.adam_beta2, cfg.optim.warmup_steps) == (0.999, 4)
    args.lr_decay_style = "WSD"
    assert "lr_decay_style=WSD has no equivalent" in training(args, "common.pt")[1][0]
