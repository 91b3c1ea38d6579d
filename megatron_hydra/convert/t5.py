"""Hugging Face T5 (``T5ForConditionalGeneration``) <-> our T5.

- Attention: HF's q / k / v (no biases) are fused per head into our QKV layout; in the
  decoder's cross-attention (``EncDecAttention``) q stays alone and k / v are fused per head
  into our ``kv`` ([k, v] per query group). ``o`` is our ``proj``.
- The relative position bias lives in HF's layer 0 of each stack and is shared by all layers;
  ours is one table per stack (``encoder_position_bias``, ``decoder_position_bias``).
- FFN: ``DenseReluDense.wi`` / ``wo`` are ``mlp.fc1`` / ``fc2`` (ReLU, v1.0); gated-gelu (v1.1)
  computes gelu(wi_0 x) * wi_1 x, i.e. our ``mlp.gate`` (wi_0) and ``mlp.fc1`` (wi_1).
- Norms: each sub-layer's ``layer_norm`` comes before it (pre-norm); the stacks end with
  ``final_layer_norm``. ``shared`` is the word embedding of both stacks and, when tied, the head.
"""

from __future__ import annotations

from typing import Tuple

from megatron_hydra.config.schema import ModelConfig
from megatron_hydra.config.transformer_config import TransformerConfig
from megatron_hydra.convert.mapping import HFConfig
from megatron_hydra.convert.name_map import KV, QKV, NameMap, Rule, tied, untied
from megatron_hydra.errors import ConfigError

MODEL_TYPE, ARCH = "t5", "t5"  # Hugging Face's model_type; our model.arch
ACTIVATIONS = {"relu": "relu", "gated-gelu": "geglu"}
BIAS = "block.0.layer.0.SelfAttention.relative_attention_bias.weight"


def _gated(cfg: TransformerConfig) -> bool:
    return cfg.activation == "geglu"


def _plain(cfg: TransformerConfig) -> bool:
    return cfg.activation != "geglu"


def _stack(stack: str, layers: str) -> Tuple[Rule, ...]:
    """One stack's layers: self-attention, (decoder) cross-attention, then the MLP, each a
    pre-norm sub-layer ``layer.<n>`` of HF's block."""
    ours, theirs = f"{stack}.{{i}}.", f"{stack}.block.{{i}}.layer."
    attention = theirs + "0.SelfAttention."
    rules = [
        Rule(ours + "norm1.weight", theirs + "0.layer_norm.weight", per=layers),
        Rule(ours + "attention.qkv.weight", tuple(f"{attention}{x}.weight" for x in "qkv"), QKV, per=layers),
        Rule(ours + "attention.proj.weight", attention + "o.weight", per=layers),
    ]
    ffn = 1
    if stack == "decoder":
        cross = theirs + "1.EncDecAttention."
        rules += [
            Rule(ours + "norm_cross.weight", theirs + "1.layer_norm.weight", per=layers),
            Rule(ours + "cross_attention.q.weight", cross + "q.weight", per=layers),
            Rule(ours + "cross_attention.kv.weight", (cross + "k.weight", cross + "v.weight"), KV, per=layers),
            Rule(ours + "cross_attention.proj.weight", cross + "o.weight", per=layers),
        ]
        ffn = 2
    mlp = f"{theirs}{ffn}.DenseReluDense."
    return (*rules,
            Rule(ours + "norm2.weight", f"{theirs}{ffn}.layer_norm.weight", per=layers),
            Rule(ours + "mlp.gate.weight", mlp + "wi_0.weight", per=layers, when=_gated),
            Rule(ours + "mlp.fc1.weight", mlp + "wi_1.weight", per=layers, when=_gated),
            Rule(ours + "mlp.fc1.weight", mlp + "wi.weight", per=layers, when=_plain),
            Rule(ours + "mlp.fc2.weight", mlp + "wo.weight", per=layers))


NAME_MAP = NameMap(
    MODEL_TYPE,
    rules=(
        Rule("embedding.weight", "shared.weight"),
        Rule("embedding.weight", "encoder.embed_tokens.weight", tied=True),
        Rule("embedding.weight", "decoder.embed_tokens.weight", tied=True),
        Rule("embedding.weight", "lm_head.weight", when=tied, tied=True),
        Rule("output_weight", "lm_head.weight", when=untied),
        Rule("encoder_position_bias.weight", "encoder." + BIAS),
        Rule("decoder_position_bias.weight", "decoder." + BIAS),
        *_stack("encoder", "num_layers"),
        Rule("encoder_norm.weight", "encoder.final_layer_norm.weight"),
        *_stack("decoder", "num_decoder_layers"),
        Rule("decoder_norm.weight", "decoder.final_layer_norm.weight"),
    ),
)


def model_config(hf: dict, name: str) -> ModelConfig:
    hf = hf if isinstance(hf, HFConfig) else HFConfig(hf, "config.json")
    act = hf.value("feed_forward_proj", str, "relu")
    if act not in ACTIVATIONS:
        raise ConfigError(f"T5 feed_forward_proj={act!r} is not supported: use one of {', '.join(ACTIVATIONS)}")
    dropout = hf.value("dropout_rate", float, 0.1)
    return ModelConfig(
        name=name, arch="t5", num_layers=hf.value("num_layers", int),
        num_decoder_layers=hf.value("num_decoder_layers", int, None), hidden_size=hf.value("d_model", int),
        num_attention_heads=hf.value("num_heads", int), kv_channels=hf.value("d_kv", int),
        ffn_hidden_size=hf.value("d_ff", int), seq_length=512, decoder_seq_length=128,
        vocab_size=hf.value("vocab_size", int), position_embedding="relative", normalization="rmsnorm",
        norm_eps=hf.value("layer_norm_epsilon", float, 1e-6), activation=ACTIVATIONS[act], add_bias_linear=False,
        tie_embeddings=hf.value("tie_word_embeddings", bool, True), hidden_dropout=dropout, attention_dropout=dropout,
        relative_attention_num_buckets=hf.value("relative_attention_num_buckets", int, 32),
        relative_attention_max_distance=hf.value("relative_attention_max_distance", int, 128),
    )


def compatible(cfg: TransformerConfig) -> str:
    """Why ``cfg`` has no T5 counterpart, or '' when it has one."""
    if cfg.normalization != "rmsnorm" or cfg.activation not in ACTIVATIONS.values():
        return "T5 needs rmsnorm and relu or geglu"
    if cfg.add_bias_linear:
        return "T5 has no biases (model.add_bias_linear=false)"
    if cfg.num_query_groups != cfg.num_attention_heads:
        return "T5 needs plain multi-head attention"
    return ""


def hf_config(cfg: TransformerConfig) -> dict:
    """``config.json`` of the exported ``T5ForConditionalGeneration``."""
    return {
        "architectures": ["T5ForConditionalGeneration"], "model_type": "t5", "vocab_size": cfg.vocab_size,
        "d_model": cfg.hidden_size, "d_kv": cfg.kv_channels, "d_ff": cfg.ffn_hidden_size, "num_layers": cfg.num_layers,
        "num_decoder_layers": cfg.num_decoder_layers, "num_heads": cfg.num_attention_heads,
        "relative_attention_num_buckets": cfg.relative_attention_num_buckets,
        "relative_attention_max_distance": cfg.relative_attention_max_distance,
        "feed_forward_proj": {v: k for k, v in ACTIVATIONS.items()}[cfg.activation],
        "layer_norm_epsilon": cfg.norm_eps, "dropout_rate": cfg.hidden_dropout,
        "tie_word_embeddings": cfg.tie_embeddings, "decoder_start_token_id": 0,
    }
