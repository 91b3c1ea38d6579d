"""Llama family (``LlamaForCausalLM``) <-> our GPT.

- RoPE: Hugging Face's Llama applies rotary embeddings in the rotate-half convention to q and k
  as its q_proj / k_proj produce them (its conversion from Meta's interleaved layout permuted the
  weights once). Our ``RotaryEmbedding`` is rotate-half with the same frequencies, so q_proj and
  k_proj rows are taken in order, with no permutation.
- Grouped-query attention: q_proj [heads*d, h], k_proj / v_proj [groups*d, h], fused per group
  (``mapping.fuse_qkv``). ``head_dim`` may differ from hidden / heads (our kv_channels).
- SwiGLU: down(silu(gate(x)) * up(x)); ours is fc2(silu(gate(x)) * fc1(x)), so up -> fc1.
- RMSNorm weights, no biases, untied output head (tied when tie_word_embeddings is set).
"""

from __future__ import annotations

from typing import Dict

import torch

from megatron_hydra.config.schema import ModelConfig
from megatron_hydra.convert.mapping import HFConfig, HFWeights, fuse_qkv, split_qkv
from megatron_hydra.errors import ConfigError
from megatron_hydra.config.transformer_config import TransformerConfig

IGNORED = ("rotary_emb.inv_freq",)
# Rotary tables are built per layer for seq_length positions; a model that allows 128k positions
# trains at a shorter length, which the user raises with model.seq_length.
MAX_DEFAULT_SEQ_LENGTH = 4096


def _rope_theta(hf: HFConfig) -> float:
    params = HFConfig(hf.value("rope_parameters", dict, {}), hf.path)
    scaling = HFConfig(hf.value("rope_scaling", dict, {}), hf.path)
    kind = params.value("rope_type", str, scaling.value("rope_type", str, scaling.value("type", str, "default")))
    if kind != "default":
        raise ConfigError(f"Llama rope_type={kind!r} (rope scaling) is not supported: only plain RoPE is")
    return params.value("rope_theta", float, hf.value("rope_theta", float, 10000.0))


def model_config(hf: HFConfig, name: str) -> ModelConfig:
    act = hf.value("hidden_act", str, "silu")
    if act != "silu":
        raise ConfigError(f"Llama hidden_act={act!r} is not supported: only silu (SwiGLU) is")
    bias = hf.value("attention_bias", bool, False)
    if bias != hf.value("mlp_bias", bool, False):
        raise ConfigError("Llama with attention_bias != mlp_bias is not supported: our model has biases on all "
                          "linear layers or on none")
    heads, hidden = hf.value("num_attention_heads", int), hf.value("hidden_size", int)
    positions = hf.value("max_position_embeddings", int, 2048)
    return ModelConfig(
        name=name, num_layers=hf.value("num_hidden_layers", int), hidden_size=hidden, num_attention_heads=heads,
        num_query_groups=hf.value("num_key_value_heads", int, heads),
        ffn_hidden_size=hf.value("intermediate_size", int), kv_channels=hf.value("head_dim", int, hidden // max(heads, 1)),
        seq_length=min(positions, MAX_DEFAULT_SEQ_LENGTH),
        max_position_embeddings=positions, vocab_size=hf.value("vocab_size", int), position_embedding="rope",
        rope_theta=_rope_theta(hf), normalization="rmsnorm", norm_eps=hf.value("rms_norm_eps", float, 1e-6),
        activation="swiglu", add_bias_linear=bias, tie_embeddings=hf.value("tie_word_embeddings", bool, False),
        hidden_dropout=0.0, attention_dropout=hf.value("attention_dropout", float, 0.0),
        init_std=hf.value("initializer_range", float, 0.02),
    )


def _linear(w: HFWeights, out: dict, src: str, dst: str, shape, bias: bool) -> None:
    out[dst + ".weight"] = w.take(src + ".weight", shape)
    if bias:
        out[dst + ".bias"] = w.take(src + ".bias", shape[:1])


def import_weights(w: HFWeights, cfg: TransformerConfig) -> Dict[str, torch.Tensor]:
    """Our logical tensors (vocabulary unpadded) from a Llama state dict."""
    h, f, v, d = cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size, cfg.kv_channels
    qd, kd, bias = cfg.num_attention_heads * d, cfg.num_query_groups * d, cfg.add_bias_linear
    out = {"embedding.weight": w.take("model.embed_tokens.weight", [v, h]),
           "final_norm.weight": w.take("model.norm.weight", [h])}
    if not cfg.tie_embeddings:
        out["output_weight"] = w.take("lm_head.weight", [v, h])
    elif "lm_head.weight" in w:
        w.take("lm_head.weight", [v, h])
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        a = src + "self_attn."
        out[dst + "attention.qkv.weight"] = fuse_qkv(w.take(a + "q_proj.weight", [qd, h]), w.take(a + "k_proj.weight", [kd, h]),
                                                     w.take(a + "v_proj.weight", [kd, h]), cfg)
        if bias:
            out[dst + "attention.qkv.bias"] = fuse_qkv(w.take(a + "q_proj.bias", [qd]), w.take(a + "k_proj.bias", [kd]),
                                                       w.take(a + "v_proj.bias", [kd]), cfg)
        _linear(w, out, a + "o_proj", dst + "attention.proj", [h, qd], bias)
        _linear(w, out, src + "mlp.gate_proj", dst + "mlp.gate", [f, h], bias)
        _linear(w, out, src + "mlp.up_proj", dst + "mlp.fc1", [f, h], bias)
        _linear(w, out, src + "mlp.down_proj", dst + "mlp.fc2", [h, f], bias)
        out[dst + "norm1.weight"] = w.take(src + "input_layernorm.weight", [h])
        out[dst + "norm2.weight"] = w.take(src + "post_attention_layernorm.weight", [h])
    return out


def compatible(cfg: TransformerConfig) -> str:
    """Why ``cfg`` has no Llama counterpart, or '' when it has one."""
    if cfg.position_embedding != "rope" or cfg.normalization != "rmsnorm" or cfg.activation != "swiglu":
        return "Llama needs rope, rmsnorm and swiglu"
    return ""


def export_weights(sd: Dict[str, torch.Tensor], cfg: TransformerConfig) -> Dict[str, torch.Tensor]:
    """LlamaForCausalLM's state dict (lm_head only when untied) from our logical tensors."""
    out = {"model.embed_tokens.weight": sd["embedding.weight"]}
    names = (("attention.proj", "self_attn.o_proj"), ("mlp.gate", "mlp.gate_proj"), ("mlp.fc1", "mlp.up_proj"),
             ("mlp.fc2", "mlp.down_proj"))
    kinds = ("weight", "bias") if cfg.add_bias_linear else ("weight",)
    for i in range(cfg.num_layers):
        src, dst = f"layers.{i}.", f"model.layers.{i}."
        out[dst + "input_layernorm.weight"] = sd[src + "norm1.weight"]
        for kind in kinds:
            q, k, v = split_qkv(sd[src + f"attention.qkv.{kind}"], cfg)
            out.update({dst + f"self_attn.q_proj.{kind}": q, dst + f"self_attn.k_proj.{kind}": k,
                        dst + f"self_attn.v_proj.{kind}": v})
            for ours, theirs in names:
                out[dst + f"{theirs}.{kind}"] = sd[src + f"{ours}.{kind}"]
        out[dst + "post_attention_layernorm.weight"] = sd[src + "norm2.weight"]
    out["model.norm.weight"] = sd["final_norm.weight"]
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["output_weight"]
    return out


def hf_config(cfg: TransformerConfig) -> dict:
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "num_hidden_layers": cfg.num_layers, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_query_groups,
        "head_dim": cfg.kv_channels, "hidden_act": "silu", "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta,
        "rope_parameters": rope, "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": cfg.add_bias_linear,
        "mlp_bias": cfg.add_bias_linear, "attention_dropout": cfg.attention_dropout, "initializer_range": cfg.init_std,
    }
