"""GPT-2 (``GPT2LMHeadModel``) <-> our GPT.

- ``c_attn``, ``c_proj``, ``c_fc`` are ``Conv1D`` layers: weights stored [in, out], the transpose
  of a linear layer's [out, in].
- ``c_attn`` fuses q, k, v as [all q | all k | all v] along its output; ours is per head
  [q, k, v] (GPT-2 is multi-head: one query group per head), see ``mapping.fuse_qkv``.
- Learned absolute positions (``wpe``), LayerNorm with biases, GELU with the tanh approximation
  (``gelu_new``), tied input/output embeddings (no separate ``lm_head`` tensor in the files).
"""

from __future__ import annotations

from typing import Dict

import torch

from megatron_hydra.config.schema import ModelConfig
from megatron_hydra.convert.mapping import HFConfig, HFWeights, fuse_qkv, split_qkv
from megatron_hydra.errors import ConfigError
from megatron_hydra.config.transformer_config import TransformerConfig

ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
# Non-persistent buffers some older GPT-2 files still carry: not weights.
IGNORED = (".attn.bias", ".attn.masked_bias")


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


def import_weights(w: HFWeights, cfg: TransformerConfig) -> Dict[str, torch.Tensor]:
    """Our logical tensors (vocabulary unpadded) from a GPT-2 state dict."""
    p = "transformer." if "transformer.wte.weight" in w else ""
    h, f, v = cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size
    out = {"embedding.weight": w.take(f"{p}wte.weight", [v, h]),
           "position_embedding.weight": w.take(f"{p}wpe.weight", [cfg.max_position_embeddings, h]),
           "final_norm.weight": w.take(f"{p}ln_f.weight", [h]), "final_norm.bias": w.take(f"{p}ln_f.bias", [h])}
    if not cfg.tie_embeddings:
        out["output_weight"] = w.take("lm_head.weight", [v, h])
    elif "lm_head.weight" in w:
        w.take("lm_head.weight", [v, h])  # the tied copy some files carry
    for i in range(cfg.num_layers):
        src, dst = f"{p}h.{i}.", f"layers.{i}."
        qkv_w = w.take(src + "attn.c_attn.weight", [h, 3 * h]).t()
        qkv_b = w.take(src + "attn.c_attn.bias", [3 * h])
        out[dst + "attention.qkv.weight"] = fuse_qkv(*qkv_w.split(h), cfg)
        out[dst + "attention.qkv.bias"] = fuse_qkv(*qkv_b.split(h), cfg)
        out[dst + "attention.proj.weight"] = w.take(src + "attn.c_proj.weight", [h, h]).t()
        out[dst + "attention.proj.bias"] = w.take(src + "attn.c_proj.bias", [h])
        out[dst + "mlp.fc1.weight"] = w.take(src + "mlp.c_fc.weight", [h, f]).t()
        out[dst + "mlp.fc1.bias"] = w.take(src + "mlp.c_fc.bias", [f])
        out[dst + "mlp.fc2.weight"] = w.take(src + "mlp.c_proj.weight", [f, h]).t()
        out[dst + "mlp.fc2.bias"] = w.take(src + "mlp.c_proj.bias", [h])
        for n in ("1", "2"):
            out[dst + f"norm{n}.weight"] = w.take(src + f"ln_{n}.weight", [h])
            out[dst + f"norm{n}.bias"] = w.take(src + f"ln_{n}.bias", [h])
    return out


def compatible(cfg: TransformerConfig) -> str:
    """Why ``cfg`` has no GPT-2 counterpart, or '' when it has one."""
    if cfg.position_embedding != "learned" or cfg.normalization != "layernorm" or cfg.activation == "swiglu":
        return "GPT-2 needs learned positions, layernorm and gelu"
    if not cfg.add_bias_linear:
        return "GPT-2 needs biases (model.add_bias_linear=true)"
    if cfg.num_query_groups != cfg.num_attention_heads or cfg.kv_channels * cfg.num_attention_heads != cfg.hidden_size:
        return "GPT-2 needs plain multi-head attention with head size hidden_size / heads"
    return ""


def export_weights(sd: Dict[str, torch.Tensor], cfg: TransformerConfig) -> Dict[str, torch.Tensor]:
    """GPT2LMHeadModel's state dict (without the tied lm_head) from our logical tensors."""
    out = {"transformer.wte.weight": sd["embedding.weight"], "transformer.wpe.weight": sd["position_embedding.weight"]}
    for i in range(cfg.num_layers):
        src, dst = f"layers.{i}.", f"transformer.h.{i}."
        for n in ("1", "2"):
            out[dst + f"ln_{n}.weight"] = sd[src + f"norm{n}.weight"]
            out[dst + f"ln_{n}.bias"] = sd[src + f"norm{n}.bias"]
        out[dst + "attn.c_attn.weight"] = torch.cat(split_qkv(sd[src + "attention.qkv.weight"], cfg)).t()
        out[dst + "attn.c_attn.bias"] = torch.cat(split_qkv(sd[src + "attention.qkv.bias"], cfg))
        out[dst + "attn.c_proj.weight"] = sd[src + "attention.proj.weight"].t()
        out[dst + "attn.c_proj.bias"] = sd[src + "attention.proj.bias"]
        out[dst + "mlp.c_fc.weight"] = sd[src + "mlp.fc1.weight"].t()
        out[dst + "mlp.c_fc.bias"] = sd[src + "mlp.fc1.bias"]
        out[dst + "mlp.c_proj.weight"] = sd[src + "mlp.fc2.weight"].t()
        out[dst + "mlp.c_proj.bias"] = sd[src + "mlp.fc2.bias"]
    out["transformer.ln_f.weight"], out["transformer.ln_f.bias"] = sd["final_norm.weight"], sd["final_norm.bias"]
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = sd["output_weight"]
    return out


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
