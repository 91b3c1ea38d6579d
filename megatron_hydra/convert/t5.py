"""Hugging Face T5 (``T5ForConditionalGeneration``) -> our T5.

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

from typing import Dict

import torch

from megatron_hydra.config.schema import ModelConfig
from megatron_hydra.convert.mapping import HFWeights, fuse_qkv, split_qkv
from megatron_hydra.errors import ConfigError
from megatron_hydra.config.transformer_config import TransformerConfig

ACTIVATIONS = {"relu": "relu", "gated-gelu": "geglu"}


def model_config(hf: dict, name: str) -> ModelConfig:
    act = hf.get("feed_forward_proj", "relu")
    if act not in ACTIVATIONS:
        raise ConfigError(f"T5 feed_forward_proj={act!r} is not supported: use one of {', '.join(ACTIVATIONS)}")
    return ModelConfig(
        name=name, arch="t5", num_layers=hf["num_layers"], num_decoder_layers=hf.get("num_decoder_layers"),
        hidden_size=hf["d_model"], num_attention_heads=hf["num_heads"], kv_channels=hf["d_kv"],
        ffn_hidden_size=hf["d_ff"], seq_length=512, decoder_seq_length=128, vocab_size=hf["vocab_size"],
        position_embedding="relative", normalization="rmsnorm", norm_eps=hf.get("layer_norm_epsilon", 1e-6),
        activation=ACTIVATIONS[act], add_bias_linear=False, tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        hidden_dropout=hf.get("dropout_rate", 0.1), attention_dropout=hf.get("dropout_rate", 0.1),
        relative_attention_num_buckets=hf.get("relative_attention_num_buckets", 32),
        relative_attention_max_distance=hf.get("relative_attention_max_distance", 128),
    )


def _mlp(w: HFWeights, out: dict, src: str, dst: str, cfg: TransformerConfig) -> None:
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    if cfg.activation == "geglu":
        out[dst + "mlp.gate.weight"] = w.take(src + "wi_0.weight", [f, h])
        out[dst + "mlp.fc1.weight"] = w.take(src + "wi_1.weight", [f, h])
    else:
        out[dst + "mlp.fc1.weight"] = w.take(src + "wi.weight", [f, h])
    out[dst + "mlp.fc2.weight"] = w.take(src + "wo.weight", [h, f])


def import_weights(w: HFWeights, cfg: TransformerConfig) -> Dict[str, torch.Tensor]:
    """Our logical tensors (vocabulary unpadded) from a T5 state dict."""
    h, v, inner = cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads * cfg.kv_channels
    out = {"embedding.weight": w.take("shared.weight", [v, h])}
    buckets = [cfg.relative_attention_num_buckets, cfg.num_attention_heads]
    bias = "block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    out["encoder_position_bias.weight"] = w.take("encoder." + bias, buckets)
    out["decoder_position_bias.weight"] = w.take("decoder." + bias, buckets)
    for stack, layers in (("encoder", cfg.num_layers), ("decoder", cfg.num_decoder_layers)):
        for i in range(layers):
            src, dst = f"{stack}.block.{i}.layer.", f"{stack}.{i}."
            a = src + "0.SelfAttention."
            q, k, val = (w.take(a + f"{n}.weight", [inner, h]) for n in "qkv")
            out[dst + "attention.qkv.weight"] = fuse_qkv(q, k, val, cfg)
            out[dst + "attention.proj.weight"] = w.take(a + "o.weight", [h, inner])
            out[dst + "norm1.weight"] = w.take(src + "0.layer_norm.weight", [h])
            ff = 1
            if stack == "decoder":
                c = src + "1.EncDecAttention."
                out[dst + "cross_attention.q.weight"] = w.take(c + "q.weight", [inner, h])
                k, val = (w.take(c + f"{n}.weight", [inner, h]) for n in "kv")
                g, d = cfg.num_query_groups, cfg.kv_channels
                out[dst + "cross_attention.kv.weight"] = torch.cat([k.reshape(g, d, h), val.reshape(g, d, h)], 1).reshape(-1, h)
                out[dst + "cross_attention.proj.weight"] = w.take(c + "o.weight", [h, inner])
                out[dst + "norm_cross.weight"] = w.take(src + "1.layer_norm.weight", [h])
                ff = 2
            _mlp(w, out, src + f"{ff}.DenseReluDense.", dst, cfg)
            out[dst + "norm2.weight"] = w.take(src + f"{ff}.layer_norm.weight", [h])
        out[f"{stack}_norm.weight"] = w.take(f"{stack}.final_layer_norm.weight", [h])
    if not cfg.tie_embeddings:
        out["output_weight"] = w.take("lm_head.weight", [v, h])
    return out


def export_weights(sd: Dict[str, torch.Tensor], cfg: TransformerConfig) -> Dict[str, torch.Tensor]:
    """A ``T5ForConditionalGeneration`` state dict from our logical tensors."""
    h = cfg.hidden_size
    out = {"shared.weight": sd["embedding.weight"], "encoder.embed_tokens.weight": sd["embedding.weight"],
           "decoder.embed_tokens.weight": sd["embedding.weight"],
           "lm_head.weight": sd["embedding.weight"] if cfg.tie_embeddings else sd["output_weight"]}
    bias = "block.0.layer.0.SelfAttention.relative_attention_bias.weight"
    out["encoder." + bias] = sd["encoder_position_bias.weight"]
    out["decoder." + bias] = sd["decoder_position_bias.weight"]
    for stack, layers in (("encoder", cfg.num_layers), ("decoder", cfg.num_decoder_layers)):
        for i in range(layers):
            src, dst = f"{stack}.{i}.", f"{stack}.block.{i}.layer."
            q, k, v = split_qkv(sd[src + "attention.qkv.weight"], cfg)
            out.update({dst + "0.SelfAttention.q.weight": q, dst + "0.SelfAttention.k.weight": k,
                        dst + "0.SelfAttention.v.weight": v})
            out[dst + "0.SelfAttention.o.weight"] = sd[src + "attention.proj.weight"]
            out[dst + "0.layer_norm.weight"] = sd[src + "norm1.weight"]
            ff = 1
            if stack == "decoder":
                c = dst + "1.EncDecAttention."
                kv = sd[src + "cross_attention.kv.weight"].reshape(cfg.num_query_groups, 2, cfg.kv_channels, h)
                out[c + "q.weight"] = sd[src + "cross_attention.q.weight"]
                out[c + "k.weight"], out[c + "v.weight"] = kv[:, 0].reshape(-1, h), kv[:, 1].reshape(-1, h)
                out[c + "o.weight"] = sd[src + "cross_attention.proj.weight"]
                out[dst + "1.layer_norm.weight"] = sd[src + "norm_cross.weight"]
                ff = 2
            m = dst + f"{ff}.DenseReluDense."
            if cfg.activation == "geglu":
                out[m + "wi_0.weight"], out[m + "wi_1.weight"] = sd[src + "mlp.gate.weight"], sd[src + "mlp.fc1.weight"]
            else:
                out[m + "wi.weight"] = sd[src + "mlp.fc1.weight"]
            out[m + "wo.weight"] = sd[src + "mlp.fc2.weight"]
            out[dst + f"{ff}.layer_norm.weight"] = sd[src + "norm2.weight"]
        out[f"{stack}.final_layer_norm.weight"] = sd[f"{stack}_norm.weight"]
    return out


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
