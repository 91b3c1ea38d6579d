"""Our model config from the arguments a Megatron-LM checkpoint stores (``args``).

Megatron-LM saves its whole ``argparse.Namespace`` in every checkpoint (``common.pt`` of
``torch_dist``, each ``model_optim_rng.pt`` of the legacy format), read as data
(``megatron_pickle``). Its names changed over versions: Megatron-Core 0.16's Megatron-LM builds
the TransformerConfig fields from its arguments (``layernorm_epsilon``,
``layernorm_zero_centered_gamma``), older ones had ``norm_epsilon`` and ``apply_layernorm_1p``;
both are read. Every value is type-checked where it is read (``mapping.HFConfig``).

Semantics taken over exactly:

- GeLU: Megatron-Core's MLP computes the tanh approximation in its fused bias-GeLU kernel
  (``bias_activation_fusion``, which Megatron-LM sets from ``bias_gelu_fusion``: on by default,
  forced off by ``--disable-bias-linear``) and in Transformer Engine's activation
  (``use_te_activation_func``); otherwise it calls the exact ``F.gelu``, whichever spec.
  ``openai_gelu`` only reaches the pre-Megatron-Core models (``use_legacy_models``). So the
  activation is ``gelu_tanh`` exactly when ``(bias_gelu_fusion and add_bias_linear) or
  use_te_activation_func`` (or ``openai_gelu`` with ``use_legacy_models``).
- QKV bias: ``linear_qkv`` has a bias when ``add_bias_linear or add_qkv_bias``.
- RoPE: rotate-half over the whole head (``rotary_percent`` 1, not interleaved), base
  ``rotary_base``; ``use_rope_scaling`` is Llama 3.1's scaling with Megatron's fixed constants
  (low 1, high 4, original context 8192), ``rotary_seq_len_interpolation_factor`` the linear one.
- ``apply_query_key_layer_scaling`` divides the scores by the layer number and multiplies them
  back in fp32: the same attention, kept without a setting of ours.
- The vocabulary: ``padded_vocab_size`` rows are stored; the real size is known for the
  ``NullTokenizer`` (``vocab_size`` + its end-of-document token). Otherwise the padded size is
  kept as ours, said in the notes: the padding rows then are ordinary (never seen) tokens.

A feature we do not compute (MoE, multi-latent attention, partial or interleaved rotary, sliding
windows, squared ReLU, multi-token prediction, layers without RoPE, other softmaxes, gated
attention output, ...) is one line naming the argument.

The arguments also say how the run trained: ``training`` turns exactly these of them into our
overrides, so that a run continuing from the import keeps them (Adam's moments built under
``adam_beta2`` 0.999 are not continued under another): ``lr``, ``min_lr``, ``adam_beta1``,
``adam_beta2``, ``adam_eps``, ``weight_decay``, ``clip_grad``, ``lr_decay_style`` (cosine, linear,
constant), ``train_iters``, ``lr_decay_iters``, ``lr_warmup_iters`` (or ``lr_warmup_fraction`` of
the decay length, as Megatron-LM computes it), ``global_batch_size``, ``micro_batch_size``, and
``bf16`` / ``fp16`` (else fp32). A schedule counted in samples or a decay style we lack is a note.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from megatron_hydra.config.schema import ModelConfig, RopeScalingConfig
from megatron_hydra.convert.mapping import HFConfig
from megatron_hydra.errors import CheckpointError

# Arguments naming a feature our model lacks, and the value that means "not used".
UNSUPPORTED = {
    "num_experts": None, "multi_latent_attention": False, "rotary_interleaved": False, "squared_relu": False,
    "quick_geglu": False, "apply_residual_connection_post_layernorm": False, "window_size": None,
    "mtp_num_layers": None, "heterogeneous_layers_config_path": None, "softmax_scale": None, "qk_l2_norm": False,
    "is_hybrid_model": False, "no_rope_freq": None, "softmax_type": "vanilla", "attention_output_gate": False,
    "glu_linear_offset": 0.0, "activation_func_clamp_value": None, "experimental_attention_variant": None,
    "linear_attention_freq": None,
}
SCHEDULES = ("cosine", "linear", "constant")


@dataclass
class MegatronModel:
    """What the arguments say about the model: our config, the source's layout, and notes for
    the user."""

    model: ModelConfig
    tp: int
    pp: int
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
                            "our models have no such feature; only Megatron GPT models with dense MLPs and plain "
                            "softmax attention import")
    if a.get("transformer_impl") not in (None, "local", "transformer_engine"):
        raise a.unsupported("transformer_impl", str(a.get("transformer_impl")), "local and transformer_engine are")


def _position(a: HFConfig) -> str:
    kind = a.value("position_embedding_type", str, "learned_absolute")
    if a.value("use_rotary_position_embeddings", bool, False):
        kind = "rope"  # Megatron-LM's older switch for the same thing
    if kind not in ("learned_absolute", "rope"):
        raise a.unsupported("position_embedding_type", kind, "learned_absolute and rope are")
    if kind == "learned_absolute" and not a.value("add_position_embedding", bool, True):
        raise a.unsupported("add_position_embedding", False, "with position_embedding_type=learned_absolute it means "
                            "a model without position embeddings (Megatron-LM's deprecated --no-position-embedding), "
                            "which our models do not compute; learned_absolute with its table, or rope, import")
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
    """The module docstring's GeLU rule."""
    if a.value("swiglu", bool, False):
        return "swiglu"
    fused = a.value("bias_gelu_fusion", bool, False) and bias
    legacy = a.value("openai_gelu", bool, False) and a.value("use_legacy_models", bool, False)
    return "gelu_tanh" if fused or a.value("use_te_activation_func", bool, False) or legacy else "gelu"


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


def _warmup(a: HFConfig, train: Optional[int], decay: Optional[int]) -> Optional[int]:
    """Warmup steps: Megatron-LM's ``lr_warmup_fraction`` of the decay length (``lr_decay_iters``,
    else ``train_iters``) when given, else ``lr_warmup_iters``."""
    fraction = a.value("lr_warmup_fraction", float, None)
    length = decay if decay is not None else train
    if fraction is not None:
        return round(fraction * length) if length is not None else None
    return a.value("lr_warmup_iters", int, None)


def training(args, path: str) -> Tuple[Dict[str, object], List[str]]:
    """Our overrides (key -> value) for the optimizer, schedule, batch and precision Megatron-LM's
    ``args`` (read from ``path``) trained with (the module docstring lists them), and notes on
    what has none."""
    a = arguments(args, path)
    precision = "bf16" if a.value("bf16", bool, False) else "fp16" if a.value("fp16", bool, False) else "fp32"
    out: Dict[str, object] = {"precision": precision}
    notes: List[str] = []
    for key in ("lr", "min_lr", "adam_beta1", "adam_beta2", "adam_eps", "weight_decay", "clip_grad"):
        out[f"optim.{key}"] = a.value(key, float, None)
    style = a.value("lr_decay_style", str, None)
    if style in SCHEDULES:
        out["optim.lr_schedule"] = style
    elif style is not None:
        notes.append(f"lr_decay_style={style} has no equivalent here: the command keeps our optim.lr_schedule")
    train, decay = a.value("train_iters", int, None), a.value("lr_decay_iters", int, None)
    out.update({"trainer.max_steps": train, "optim.decay_steps": decay, "optim.warmup_steps": _warmup(a, train, decay),
                "data.global_batch_size": a.value("global_batch_size", int, None),
                "data.micro_batch_size": a.value("micro_batch_size", int, None)})
    if train is None and a.value("train_samples", int, None) is not None:
        notes.append("the run counted its schedule in samples (train_samples): set trainer.max_steps, "
                     "optim.decay_steps and optim.warmup_steps in steps of data.global_batch_size")
    return {k: v for k, v in out.items() if v is not None}, notes


def model_of(args, path: str, name: str) -> MegatronModel:
    """Our GPT model config for Megatron-LM's ``args`` (read from ``path``), named ``name``."""
    a = arguments(args, path)
    _refuse_features(a)
    heads, hidden = a.count("num_attention_heads"), a.count("hidden_size")
    groups = a.count("num_query_groups", heads) if a.value("group_query_attention", bool, False) else heads
    bias = a.value("add_bias_linear", bool, True)
    qkv_bias = bias or a.value("add_qkv_bias", bool, False)
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
    return MegatronModel(model, a.count("tensor_model_parallel_size", 1), a.count("pipeline_model_parallel_size", 1),
                         notes)
