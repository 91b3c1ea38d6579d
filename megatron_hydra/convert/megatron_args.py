"""Our model config from the arguments a Megatron-LM checkpoint stores (``args``).

Megatron-LM saves its whole ``argparse.Namespace`` in every checkpoint (``common.pt`` of
``torch_dist``, each ``model_optim_rng.pt`` of the legacy format), read as data
(``megatron_pickle``). Its names changed over versions: Megatron-Core 0.16's Megatron-LM builds
the TransformerConfig fields from its arguments (``layernorm_epsilon``,
``layernorm_zero_centered_gamma``), older ones had ``norm_epsilon`` and ``apply_layernorm_1p``;
both are read. Every value is type-checked where it is read (``mapping.HFConfig``).

Semantics taken over exactly:

- GeLU: Megatron-LM's ``bias_gelu_fusion`` (on by default with biases) computes the tanh
  approximation, as does ``openai_gelu`` and Transformer Engine's fused MLP; the exact erf form
  only runs unfused in the local spec. So the activation is ``gelu_tanh`` in those cases.
- RoPE: rotate-half over the whole head (``rotary_percent`` 1, not interleaved), base
  ``rotary_base``; ``use_rope_scaling`` is Llama 3.1's scaling with Megatron's fixed constants
  (low 1, high 4, original context 8192), ``rotary_seq_len_interpolation_factor`` the linear one.
- ``apply_query_key_layer_scaling`` divides the scores by the layer number and multiplies them
  back in fp32: the same attention, kept without a setting of ours.
- The vocabulary: ``padded_vocab_size`` rows are stored; the real size is known for the
  ``NullTokenizer`` (``vocab_size`` + its end-of-document token). Otherwise the padded size is
  kept as ours, said in the notes: the padding rows then are ordinary (never seen) tokens.

A feature we do not compute (MoE, multi-latent attention, partial or interleaved rotary, sliding
windows, squared ReLU, multi-token prediction, ...) is one line naming the argument.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import List, Optional

from megatron_hydra.config.schema import ModelConfig, RopeScalingConfig
from megatron_hydra.convert.mapping import HFConfig
from megatron_hydra.convert.megatron_pickle import MegatronEnum
from megatron_hydra.errors import CheckpointError

# Arguments naming a feature our model lacks, and the value that means "not used".
UNSUPPORTED = {
    "num_experts": None, "multi_latent_attention": False, "rotary_interleaved": False, "squared_relu": False,
    "quick_geglu": False, "apply_residual_connection_post_layernorm": False, "window_size": None,
    "mtp_num_layers": None, "heterogeneous_layers_config_path": None, "softmax_scale": None, "qk_l2_norm": False,
    "is_hybrid_model": False,
}


@dataclass
class MegatronModel:
    """What the arguments say about the model: our config, the padded vocabulary the tensors
    have, the source's layout, and notes for the user."""

    model: ModelConfig
    padded_vocab: int
    tp: int
    pp: int
    params_dtype: str
    notes: List[str] = field(default_factory=list)


def arguments(args, path: str) -> HFConfig:
    """The checkpoint's ``args`` as a checked mapping (``path``: the file, named in errors)."""
    if not isinstance(args, argparse.Namespace):
        raise CheckpointError(f"{path} holds no Megatron-LM arguments ('args' is "
                              f"{type(args).__name__}): it was not saved by Megatron-LM's training loop, so the "
                              "model's shape is unknown; save it with Megatron-LM's save_checkpoint")
    view = HFConfig(vars(args), f"{path} (args)")
    view.model_type = "Megatron-LM"
    return view


def _refuse_features(a: HFConfig) -> None:
    for key, unused in UNSUPPORTED.items():
        value = a.get(key)
        if value in (unused, None, False, 0):
            continue
        raise a.unsupported(key, value if isinstance(value, (int, float, str, bool)) else str(value),
                            "our models have no such feature; only Megatron GPT models with dense MLPs import")
    if a.get("transformer_impl") not in (None, "local", "transformer_engine"):
        raise a.unsupported("transformer_impl", str(a.get("transformer_impl")), "local and transformer_engine are")


def _position(a: HFConfig) -> str:
    kind = a.value("position_embedding_type", str, "learned_absolute")
    if a.value("use_rotary_position_embeddings", bool, False):
        kind = "rope"  # Megatron-LM's older switch for the same thing
    if kind not in ("learned_absolute", "rope"):
        raise a.unsupported("position_embedding_type", kind, "learned_absolute and rope are")
    if kind == "rope" and a.value("rotary_percent", float, 1.0) != 1.0:
        raise a.unsupported("rotary_percent", a.value("rotary_percent", float), "only 1.0 is (rotary over whole heads)")
    return "learned" if kind == "learned_absolute" else "rope"


def _rope_scaling(a: HFConfig) -> Optional[RopeScalingConfig]:
    linear = a.value("rotary_seq_len_interpolation_factor", float, None)
    if a.value("use_rope_scaling", bool, False):
        if linear is not None:
            raise a.unsupported("rotary_seq_len_interpolation_factor", linear, "not together with use_rope_scaling")
        return RopeScalingConfig(type="llama3", factor=a.value("rope_scaling_factor", float, 8.0),
                                 original_max_position_embeddings=8192, low_freq_factor=1.0, high_freq_factor=4.0)
    return RopeScalingConfig(type="linear", factor=linear) if linear is not None else None


def _activation(a: HFConfig, bias: bool) -> str:
    if a.value("swiglu", bool, False):
        return "swiglu"
    impl = a.get("transformer_impl")
    fused = a.value("bias_gelu_fusion", bool, False) and bias
    te = impl == "transformer_engine" or (isinstance(impl, MegatronEnum) and "transformer_engine" in str(impl.value))
    return "gelu_tanh" if a.value("openai_gelu", bool, False) or fused or te else "gelu"


def _normalization(a: HFConfig) -> str:
    norm = a.value("normalization", str, "LayerNorm")
    if norm not in ("LayerNorm", "RMSNorm"):
        raise a.unsupported("normalization", norm, "LayerNorm and RMSNorm are")
    return norm.lower()


def _vocab(a: HFConfig, padded: int, notes: List[str]) -> int:
    """The real vocabulary size where the arguments say it, else the padded one (with a note)."""
    tokenizer = a.value("tokenizer_type", str, None)
    size = a.value("vocab_size", int, None)
    if tokenizer == "NullTokenizer" and size is not None and 0 < size < padded:
        return size + 1  # its end-of-document token comes after the vocabulary
    notes.append(f"the real vocabulary size is not recorded for tokenizer_type={tokenizer}: kept Megatron's "
                 f"padded {padded} rows as model.vocab_size (set data.tokenizer to the same tokenizer)")
    return padded


def _dtype(a: HFConfig) -> str:
    if a.value("bf16", bool, False):
        return "bfloat16"
    return "float16" if a.value("fp16", bool, False) else "float32"


def model_of(args, path: str, name: str) -> MegatronModel:
    """Our GPT model config for Megatron-LM's ``args`` (read from ``path``), named ``name``."""
    a = arguments(args, path)
    _refuse_features(a)
    heads, hidden = a.count("num_attention_heads"), a.count("hidden_size")
    groups = a.count("num_query_groups", heads) if a.value("group_query_attention", bool, False) else heads
    bias = a.value("add_bias_linear", bool, True)
    qkv_bias = a.value("add_qkv_bias", bool, bias)
    seq = a.count("seq_length")
    padded = a.count("padded_vocab_size")
    notes: List[str] = []
    model = ModelConfig(
        name=name, arch="gpt", num_layers=a.count("num_layers"), hidden_size=hidden, num_attention_heads=heads,
        num_query_groups=groups, ffn_hidden_size=a.count("ffn_hidden_size", 4 * hidden),
        kv_channels=a.count("kv_channels", hidden // heads), seq_length=seq,
        max_position_embeddings=a.count("max_position_embeddings", seq), vocab_size=_vocab(a, padded, notes),
        make_vocab_size_divisible_by=a.count("make_vocab_size_divisible_by", 128),
        position_embedding=_position(a), rope_theta=float(a.value("rotary_base", float, 10000.0)),
        rope_scaling=_rope_scaling(a), normalization=_normalization(a),
        norm_eps=a.value("layernorm_epsilon", float, a.value("norm_epsilon", float, 1e-5)),
        zero_centered_gamma=a.value("layernorm_zero_centered_gamma", bool,
                                    a.value("apply_layernorm_1p", bool, False)),
        activation=_activation(a, bias), add_bias_linear=bias, qkv_bias=None if qkv_bias == bias else qkv_bias,
        qk_norm=a.value("qk_layernorm", bool, False),
        tie_embeddings=not a.value("untie_embeddings_and_output_weights", bool, False),
        hidden_dropout=a.value("hidden_dropout", float, 0.1),
        attention_dropout=a.value("attention_dropout", float, 0.1),
        init_std=a.value("init_method_std", float, 0.02),
    )
    return MegatronModel(model, padded, a.count("tensor_model_parallel_size", 1),
                         a.count("pipeline_model_parallel_size", 1), _dtype(a), notes)
