"""GPT-2 (``GPT2LMHeadModel``) <-> our GPT.

- ``c_attn``, ``c_proj``, ``c_fc`` are ``Conv1D`` layers: weights stored [in, out], the transpose
  of a linear layer's [out, in].
- ``c_attn`` fuses q, k, v as [all q | all k | all v] along its output; ours is per head
  [q, k, v] (GPT-2 is multi-head: one query group per head), see ``mapping.fuse_qkv``.
- Learned absolute positions (``wpe``), LayerNorm with biases, GELU with the tanh approximation
  (``gelu_new``), tied input/output embeddings (no separate ``lm_head`` tensor in the files).
"""

from __future__ import annotations

import torch

from megatron_hydra.config.schema import ModelConfig
from megatron_hydra.config.transformer_config import TransformerConfig
from megatron_hydra.convert.mapping import HFConfig, fuse_qkv, split_qkv
from megatron_hydra.convert.name_map import TRANSPOSE, NameMap, Rule, Transform, tied, untied, weight_and_bias
from megatron_hydra.errors import ConfigError

MODEL_TYPE, ARCH = "gpt2", "gpt"  # Hugging Face's model_type; our model.arch
ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}

# c_attn's output [all q | all k | all v] <-> our QKV per head; the weight also transposed (Conv1D).
QKV_BLOCKS = Transform(lambda t, cfg: fuse_qkv(*t.split(cfg.hidden_size), cfg),
                       lambda t, cfg: (torch.cat(split_qkv(t, cfg)),))
CONV1D_QKV = Transform(lambda t, cfg: fuse_qkv(*t.t().split(cfg.hidden_size), cfg),
                       lambda t, cfg: (torch.cat(split_qkv(t, cfg)).t(),))

L, H, LAYERS = "layers.{i}.", "transformer.h.{i}.", "num_layers"


def _conv1d(ours: str, theirs: str):
    """A layer's Conv1D: the weight transposed, the bias as it is."""
    return (Rule(f"{L}{ours}.weight", f"{H}{theirs}.weight", TRANSPOSE, per=LAYERS),
            Rule(f"{L}{ours}.bias", f"{H}{theirs}.bias", per=LAYERS))


NAME_MAP = NameMap(
    MODEL_TYPE,
    rules=(
        Rule("embedding.weight", "transformer.wte.weight"),
        Rule("embedding.weight", "lm_head.weight", when=tied, tied=True),
        Rule("output_weight", "lm_head.weight", when=untied),
        Rule("position_embedding.weight", "transformer.wpe.weight"),
        Rule("final_norm.weight", "transformer.ln_f.weight"),
        Rule("final_norm.bias", "transformer.ln_f.bias"),
        *weight_and_bias(L + "norm1", H + "ln_1", per=LAYERS),
        Rule(L + "attention.qkv.weight", H + "attn.c_attn.weight", CONV1D_QKV, per=LAYERS),
        Rule(L + "attention.qkv.bias", H + "attn.c_attn.bias", QKV_BLOCKS, per=LAYERS),
        *_conv1d("attention.proj", "attn.c_proj"),
        *weight_and_bias(L + "norm2", H + "ln_2", per=LAYERS),
        *_conv1d("mlp.fc1", "mlp.c_fc"),
        *_conv1d("mlp.fc2", "mlp.c_proj"),
    ),
    # Non-persistent buffers some older GPT-2 files still carry: not weights.
    ignored=(".attn.bias", ".attn.masked_bias"),
    optional_prefix="transformer.",  # GPT2Model's files name its tensors without it
)


def model_config(hf: HFConfig, name: str) -> ModelConfig:
    act = hf.value("activation_function", str, "gelu_new")
    if act not in ACTIVATIONS:
        raise ConfigError(f"GPT-2 activation_function={act!r} is not supported: use one of {', '.join(ACTIVATIONS)}")
    if (hf.value("scale_attn_by_inverse_layer_idx", bool, False) or not hf.value("scale_attn_weights", bool, True)
            or hf.value("add_cross_attention", bool, False)):
        raise ConfigError("GPT-2 variants with scale_attn_by_inverse_layer_idx, scale_attn_weights=false or "
                          "cross-attention are not supported")
    hidden, positions = hf.value("n_embd", int), hf.value("n_positions", int)
    return ModelConfig(
        name=name, num_layers=hf.value("n_layer", int), hidden_size=hidden, num_attention_heads=hf.value("n_head", int),
        ffn_hidden_size=hf.value("n_inner", int, 4 * hidden), seq_length=positions, max_position_embeddings=positions,
        vocab_size=hf.value("vocab_size", int), position_embedding="learned", normalization="layernorm",
        norm_eps=hf.value("layer_norm_epsilon", float, 1e-5), activation=ACTIVATIONS[act], add_bias_linear=True,
        tie_embeddings=hf.value("tie_word_embeddings", bool, True), hidden_dropout=hf.value("resid_pdrop", float, 0.1),
        attention_dropout=hf.value("attn_pdrop", float, 0.1), init_std=hf.value("initializer_range", float, 0.02),
    )


def compatible(cfg: TransformerConfig) -> str:
    """Why ``cfg`` has no GPT-2 counterpart, or '' when it has one."""
    if cfg.position_embedding != "learned" or cfg.normalization != "layernorm" or cfg.activation == "swiglu":
        return "GPT-2 needs learned positions, layernorm and gelu"
    if not cfg.add_bias_linear:
        return "GPT-2 needs biases (model.add_bias_linear=true)"
    if cfg.num_query_groups != cfg.num_attention_heads or cfg.kv_channels * cfg.num_attention_heads != cfg.hidden_size:
        return "GPT-2 needs plain multi-head attention with head size hidden_size / heads"
    return ""


def hf_config(cfg: TransformerConfig) -> dict:
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "n_layer": cfg.num_layers, "n_embd": cfg.hidden_size, "n_head": cfg.num_attention_heads,
        "n_inner": cfg.ffn_hidden_size, "n_positions": cfg.max_position_embeddings, "vocab_size": cfg.vocab_size,
        "activation_function": "gelu_new" if cfg.activation == "gelu_tanh" else "gelu",
        "layer_norm_epsilon": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "resid_pdrop": cfg.hidden_dropout, "embd_pdrop": cfg.hidden_dropout, "attn_pdrop": cfg.attention_dropout,
        "initializer_range": cfg.init_std, "scale_attn_weights": True,
    }
