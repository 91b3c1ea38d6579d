"""The architecture keys of today's open models (config/architecture.py): what each resolves to in
the model's TransformerConfig, and the one line each bad value gets before anything runs."""

from __future__ import annotations

import pytest

from conftest import compose_config
from megatron_hydra.config import derive
from megatron_hydra.config.schema import RopeScalingConfig
from megatron_hydra.errors import ConfigError

BASE = ["model.position_embedding=rope", "model.normalization=rmsnorm", "model.activation=swiglu",
        "model.add_bias_linear=false"]


def _derive(*overrides, **model):
    cfg = compose_config([*BASE, *overrides])
    for key, value in model.items():
        setattr(cfg.model, key, value)
    return derive(cfg).transformer


def test_defaults_change_nothing():
    t = _derive()
    assert (t.rope_scaling, t.local_rope_theta, t.sliding_window, t.window_layers) == (None, None, None, ())
    assert (t.qk_norm, t.zero_centered_gamma, t.post_sublayer_norm, t.scale_embeddings) == (False,) * 4
    assert (t.attn_logit_softcapping, t.final_logit_softcapping, t.softmax_scale) == (None, None, None)
    assert t.qkv_bias is False and _derive("model.add_bias_linear=true").qkv_bias is True


@pytest.mark.parametrize("pattern,expected", [
    (1, (0, 1, 2, 3, 4, 5)),  # every layer (Mistral)
    (2, (0, 2, 4)),  # Gemma 2: even layers windowed, odd global
    (6, (0, 1, 2, 3, 4)),  # Gemma 3: every sixth global
    ([0, 1, 1, 0, 0, 1], (1, 2, 5)),
])
def test_window_layers(pattern, expected):
    t = _derive("model.num_layers=6", "model.sliding_window=64", sliding_window_pattern=pattern)
    assert t.window_layers == expected
    assert [t.windowed(i) for i in range(6)] == [64 if i in expected else None for i in range(6)]


def test_no_window_no_windowed_layers():
    assert _derive("model.sliding_window_pattern=2").window_layers == ()


def test_resolved_values():
    t = _derive("model.qkv_bias=true", "model.query_pre_attn_scalar=144", "model.num_layers=2",
                "model.sliding_window=8", "model.local_rope_theta=10000",
                rope_scaling=RopeScalingConfig(type="yarn", factor=4.0, original_max_position_embeddings=64))
    assert t.qkv_bias is True and t.add_bias_linear is False
    assert t.softmax_scale == pytest.approx(1 / 12)
    assert t.rope_scaling.type == "yarn" and t.rope_scaling.factor == 4.0
    assert t.rope_scaling.original_max_position_embeddings == 64 and t.local_rope_theta == 10000


@pytest.mark.parametrize("overrides,model,key", [
    (["model.sliding_window=0"], {}, "model.sliding_window=0"),
    (["model.sliding_window=8"], {"sliding_window_pattern": [1, 0]}, "model.sliding_window_pattern"),
    (["model.sliding_window=8", "model.sliding_window_pattern=0"], {}, "model.sliding_window_pattern=0"),
    (["model.attn_logit_softcapping=-1"], {}, "model.attn_logit_softcapping=-1"),
    (["model.query_pre_attn_scalar=0"], {}, "model.query_pre_attn_scalar=0"),
    (["model.local_rope_theta=10000"], {}, "model.local_rope_theta"),
    (["model.qk_norm=true", "model.normalization=layernorm"], {}, "model.qk_norm"),
    ([], {"rope_scaling": RopeScalingConfig(factor=0.5)}, "model.rope_scaling.factor=0.5"),
    ([], {"rope_scaling": RopeScalingConfig(low_freq_factor=4.0, high_freq_factor=1.0)},
     "model.rope_scaling.low_freq_factor"),
    ([], {"rope_scaling": RopeScalingConfig(type="yarn", beta_fast=1.0, beta_slow=32.0)}, "model.rope_scaling.beta"),
    (["model.position_embedding=learned"], {"rope_scaling": RopeScalingConfig()}, "model.position_embedding=rope"),
    (["model.transformer_impl=transformer_engine", "model.qk_norm=true"], {}, "model.qk_norm"),
    (["model.transformer_impl=transformer_engine", "model.qkv_bias=true"], {}, "model.qkv_bias"),
])
def test_bad_values_are_one_line(overrides, model, key):
    with pytest.raises(ConfigError) as info:
        _derive(*overrides, **model)
    message = str(info.value)
    assert key in message and "\n" not in message


def test_gpt_only_keys_refused_for_other_archs():
    cfg = compose_config(["model=bert_base", "data=indexed_bert", "model.scale_embeddings=true"])
    with pytest.raises(ConfigError, match="model.scale_embeddings is a GPT-family key"):
        derive(cfg)
