"""One path from the schema to the model: every ``model.*`` key reaches ``TransformerConfig``, each
key's allowed values stand beside it in the schema and are checked there, and the README's
config-group table lists every group and option."""

from __future__ import annotations

import dataclasses
import re
import typing

import pytest

from conftest import CONF, ROOT, compose_config
from megatron_hydra.config import derive
from megatron_hydra.config.schema import FP8Config, ModelConfig, MoEConfig, RunConfig
from megatron_hydra.errors import ConfigError

# model.* keys with no field of their own in TransformerConfig, and why.
NOT_IN_TRANSFORMER = {
    "name": "the preset's label (or from_checkpoint), not part of the network",
}

# Each model key: (override value, what TransformerConfig then holds, its field there). Every value
# differs from the schema's default, so arriving proves the copy rather than a default that agrees.
GPT = {
    "num_layers": ("6", 6, "num_layers"),
    "hidden_size": ("320", 320, "hidden_size"),
    "num_attention_heads": ("10", 10, "num_attention_heads"),
    "num_query_groups": ("5", 5, "num_query_groups"),
    "ffn_hidden_size": ("704", 704, "ffn_hidden_size"),
    "kv_channels": ("48", 48, "kv_channels"),
    "seq_length": ("96", 96, "seq_length"),
    "max_position_embeddings": ("200", 200, "max_position_embeddings"),
    "vocab_size": ("1001", 1001, "vocab_size"),
    # 1001 padded to a multiple of 100 x tp (tp = 1).
    "make_vocab_size_divisible_by": ("100", 1100, "padded_vocab_size"),
    "position_embedding": ("rope", "rope", "position_embedding"),
    "rope_theta": ("12345.0", 12345.0, "rope_theta"),
    "normalization": ("rmsnorm", "rmsnorm", "normalization"),
    "norm_eps": ("1e-6", 1e-6, "norm_eps"),
    "activation": ("swiglu", "swiglu", "activation"),
    "add_bias_linear": ("false", False, "add_bias_linear"),
    "tie_embeddings": ("false", False, "tie_embeddings"),
    "hidden_dropout": ("0.05", 0.05, "hidden_dropout"),
    "attention_dropout": ("0.07", 0.07, "attention_dropout"),
    "init_std": ("0.013", 0.013, "init_std"),
    "relative_attention_num_buckets": ("17", 17, "relative_attention_num_buckets"),
    "relative_attention_max_distance": ("77", 77, "relative_attention_max_distance"),
    "transformer_impl": ("transformer_engine", "transformer_engine", "transformer_impl"),
}
# The keys of today's open models (config/architecture.py), set together on a RoPE + RMSNorm GPT of
# 4 layers on the local layers (Transformer Engine refuses most of them).
OPEN_MODELS_BASE = ["model.position_embedding=rope", "model.normalization=rmsnorm"]
OPEN_MODELS = {
    "qkv_bias": ("true", True, "qkv_bias"),
    "qk_norm": ("true", True, "qk_norm"),
    "query_pre_attn_scalar": ("144", 1 / 12, "softmax_scale"),
    "sliding_window": ("16", 16, "sliding_window"),
    "sliding_window_pattern": ("2", (0, 2), "window_layers"),
    "local_rope_theta": ("12000.0", 12000.0, "local_rope_theta"),
    "attn_logit_softcapping": ("50.0", 50.0, "attn_logit_softcapping"),
    "final_logit_softcapping": ("30.0", 30.0, "final_logit_softcapping"),
    "zero_centered_gamma": ("true", True, "zero_centered_gamma"),
    "post_sublayer_norm": ("true", True, "post_sublayer_norm"),
    "scale_embeddings": ("true", True, "scale_embeddings"),
}
# Keys only a family reads (derive gives the others 0 or False).
BERT = {"arch": ("bert", "bert", "arch"), "binary_head": ("true", True, "binary_head")}
T5 = {"arch": ("t5", "t5", "arch"), "num_decoder_layers": ("3", 3, "num_decoder_layers"),
      "decoder_seq_length": ("40", 40, "decoder_seq_length")}
# model.moe.*: on moe_tiny (4 layers).
MOE = {
    "num_experts": ("6", 6, "num_experts"),
    "top_k": ("3", 3, "top_k"),
    "ffn_hidden_size": ("96", 96, "ffn_hidden_size"),
    "router": ("sigmoid", "sigmoid", "router"),
    "norm_topk": ("false", False, "norm_topk"),
    "aux_loss_coeff": ("0.011", 0.011, "aux_loss_coeff"),
    "z_loss_coeff": ("0.0013", 0.0013, "z_loss_coeff"),
    "expert_bias_rate": ("0.0017", 0.0017, "expert_bias_rate"),
    "capacity_factor": ("1.25", 1.25, "capacity_factor"),
    "shared_ffn_hidden_size": ("64", 64, "shared_ffn_hidden_size"),
}
MOE_LAYER_FREQ = ("2", (0, 2))  # every second of the 4 layers -> TransformerConfig.moe_layers
FP8 = {
    "recipe": ("current", "current", "recipe"),
    "format": ("e4m3", "e4m3", "format"),
    "amax_history_len": ("7", 7, "amax_history_len"),
    "amax_compute_algo": ("most_recent", "most_recent", "amax_compute_algo"),
    "margin": ("2", 2, "margin"),
}


def _names(cls) -> set:
    return {f.name for f in dataclasses.fields(cls)}


def _defaults(cls) -> dict:
    return {f.name: f.default for f in dataclasses.fields(cls)}


def _overrides(prefix: str, table: dict) -> list:
    return [f"{prefix}.{key}={value}" for key, (value, _, _) in table.items()]


def _assert_arrived(obj, table: dict, defaults: dict) -> None:
    wrong = {}
    for key, (_, expected, attribute) in table.items():
        assert expected != defaults.get(key), f"{key}: pick a value other than its default"
        got = getattr(obj, attribute)
        if not (got == pytest.approx(expected) if isinstance(expected, float) else got == expected):
            wrong[key] = (attribute, got, expected)
    assert not wrong, f"model keys that did not reach the model's config as set: {wrong}"


def test_every_model_key_has_a_place_in_the_transformer_config():
    """A key added to the schema without a way to the model fails here, not silently in training."""
    covered = set(GPT) | set(OPEN_MODELS) | set(BERT) | set(T5) | set(NOT_IN_TRANSFORMER) | {"moe", "rope_scaling"}
    assert _names(ModelConfig) == covered, f"list each new model key here: {_names(ModelConfig) ^ covered}"
    assert _names(MoEConfig) == set(MOE) | {"layer_freq"}
    assert _names(FP8Config) == set(FP8)


def test_every_gpt_model_key_reaches_the_transformer_config():
    tc = derive(compose_config(_overrides("model", GPT))).transformer
    _assert_arrived(tc, GPT, _defaults(ModelConfig))


@pytest.mark.parametrize("family,data", [(BERT, "indexed_bert"), (T5, "indexed_t5")])
def test_family_keys_reach_the_transformer_config(family, data):
    position = "relative" if family is T5 else "learned"
    tc = derive(compose_config(_overrides("model", family) + [f"data={data}",
                                                              f"model.position_embedding={position}"])).transformer
    _assert_arrived(tc, family, _defaults(ModelConfig))


def test_every_moe_key_reaches_the_transformer_config():
    cfg = compose_config(["model=moe_tiny", *_overrides("model.moe", MOE), f"model.moe.layer_freq={MOE_LAYER_FREQ[0]}"])
    tc = derive(cfg).transformer
    _assert_arrived(tc.moe, MOE, _defaults(MoEConfig))
    assert tc.moe_layers == MOE_LAYER_FREQ[1]


def test_every_fp8_key_reaches_the_transformer_config():
    cfg = compose_config(["precision=fp8", "model.transformer_impl=transformer_engine", *_overrides("precision.fp8", FP8)])
    _assert_arrived(derive(cfg).transformer.fp8, FP8, _defaults(FP8Config))


# The keys that take one of a few values (Megatron's and our documented enumerations).
KEYS_WITH_CHOICES = {
    "model.arch", "model.position_embedding", "model.normalization", "model.activation", "model.transformer_impl",
    "model.moe.router", "parallel.cp_comm_type", "parallel.pipeline_schedule", "parallel.data_parallel",
    "precision.params_dtype", "precision.fp8.recipe", "precision.fp8.format", "precision.fp8.amax_compute_algo",
    "recompute.granularity", "recompute.method", "data.name", "data.tokenizer.type", "optim.name",
    "optim.lr_schedule", "optim.impl", "trainer.accelerator", "checkpoint.resume", "mode", "model.rope_scaling.type",
    "peft.name", "objective.name", "trainer.compile_backend",
}
# What makes the optional nodes exist, so that their keys are checked.
NODE_PRESETS = {"model.moe": ["model=moe_tiny"], "model.rope_scaling": ["model=llama3.1_8b"], "precision.fp8": ["precision=fp8",
                                                                  "model.transformer_impl=transformer_engine"]}


def _nested(cls, name):
    """The schema class of field ``name`` of ``cls`` (through Optional), or None."""
    hint = typing.get_type_hints(cls)[name]
    return next((t for t in (hint, *typing.get_args(hint)) if dataclasses.is_dataclass(t)), None)


def test_every_open_model_key_reaches_the_transformer_config():
    tc = derive(compose_config([*OPEN_MODELS_BASE, *_overrides("model", OPEN_MODELS)])).transformer
    _assert_arrived(tc, OPEN_MODELS, _defaults(ModelConfig))


def test_rope_scaling_reaches_the_transformer_config():
    """The node as a preset sets it (Llama 3.1's published values)."""
    rs = derive(compose_config(["model=llama3.1_8b", "model.num_layers=2"])).transformer.rope_scaling
    assert (rs.type, rs.factor, rs.low_freq_factor, rs.high_freq_factor, rs.original_max_position_embeddings) == \
        ("llama3", 8.0, 1.0, 4.0, 8192)


def _schema_choices(cls=RunConfig, prefix=""):
    """(key, allowed values, default) of every schema field that lists its choices beside it."""
    for f in dataclasses.fields(cls):
        if "choices" in f.metadata:
            yield prefix + f.name, f.metadata["choices"], f.default
        if _nested(cls, f.name) is not None:
            yield from _schema_choices(_nested(cls, f.name), prefix + f.name + ".")


def test_each_key_lists_its_choices_in_the_schema():
    found = {key: (allowed, default) for key, allowed, default in _schema_choices()}
    assert set(found) == KEYS_WITH_CHOICES, f"differs: {set(found) ^ KEYS_WITH_CHOICES}"
    assert all(default in allowed for allowed, default in found.values())


@pytest.mark.parametrize("key", sorted(KEYS_WITH_CHOICES))
def test_a_value_outside_the_choices_is_one_line_naming_key_and_choices(key):
    node = next((n for n in NODE_PRESETS if key.startswith(n + ".")), None)
    cfg = compose_config(NODE_PRESETS.get(node, []))
    parent, _, name = key.rpartition(".")
    obj = cfg
    for part in filter(None, parent.split(".")):
        obj = getattr(obj, part)
    setattr(obj, name, "bogus")  # Hydra types these as str: any text composes
    with pytest.raises(ConfigError) as info:
        derive(cfg)
    message = str(info.value)
    allowed = next(a for k, a, _ in _schema_choices() if k == key)
    assert message.startswith(f"{key}='bogus' is not supported: use one of ") and "\n" not in message
    assert all(("null" if a is None else a) in message for a in allowed)


def test_readme_table_lists_every_config_group_and_option():
    rows = {}
    for line in (ROOT / "README.md").read_text().splitlines():
        m = re.match(r"\| `(\w+)` \| (.*?) \|", line)
        if m:
            rows[m.group(1)] = set(re.findall(r"`([^`]+)`", m.group(2)))
    groups = {g.name: {f.stem for f in g.glob("*.yaml")} for g in CONF.iterdir() if g.is_dir() and g.name != "hydra"}
    missing = {g: sorted(opts - rows.get(g, set())) for g, opts in groups.items() if opts - rows.get(g, set())}
    assert not missing, f"README's config-group table lacks: {missing}"
