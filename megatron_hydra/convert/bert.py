"""Hugging Face BERT (``BertForMaskedLM``, ``BertForPreTraining``) -> our BERT.

- Attention: HF's separate query / key / value projections are fused per head into our QKV
  layout (``mapping.fuse_qkv``; BERT has no grouped-query attention). Its ``attention.output``
  dense is our ``attention.proj``, ``intermediate`` / ``output`` dense are ``mlp.fc1`` / ``fc2``.
- Post-LN: ``attention.output.LayerNorm`` follows the attention's residual sum (our ``norm1``),
  ``output.LayerNorm`` the MLP's (``norm2``), as in the post-norm ``models.transformer.Block``.
- Masked-LM head: ``cls.predictions.transform`` is our ``lm_head.dense`` / ``lm_head.norm``;
  its decoder is tied to the word embedding and its bias is ``lm_head.bias``. The pooler and
  ``cls.seq_relationship`` (``BertForPreTraining`` only) are our ``pooler`` / ``binary_head``.
"""

from __future__ import annotations

from typing import Dict

import torch

from megatron_hydra.config.schema import ModelConfig
from megatron_hydra.convert.mapping import HFWeights, fuse_qkv, split_qkv
from megatron_hydra.errors import ConfigError
from megatron_hydra.config.transformer_config import TransformerConfig

ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}


def model_config(hf: dict, name: str, binary_head: bool = False) -> ModelConfig:
    act = hf.get("hidden_act", "gelu")
    if act not in ACTIVATIONS:
        raise ConfigError(f"BERT hidden_act={act!r} is not supported: use one of {', '.join(ACTIVATIONS)}")
    if hf.get("type_vocab_size", 2) != 2:
        raise ConfigError(f"BERT type_vocab_size={hf['type_vocab_size']} is not supported: only 2 segments")
    positions = hf.get("max_position_embeddings", 512)
    return ModelConfig(
        name=name, arch="bert", num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
        num_attention_heads=hf["num_attention_heads"], ffn_hidden_size=hf["intermediate_size"],
        seq_length=positions, max_position_embeddings=positions, vocab_size=hf["vocab_size"],
        position_embedding="learned", normalization="layernorm", norm_eps=hf.get("layer_norm_eps", 1e-12),
        activation=ACTIVATIONS[act], add_bias_linear=True, tie_embeddings=True,
        hidden_dropout=hf.get("hidden_dropout_prob", 0.1), attention_dropout=hf.get("attention_probs_dropout_prob", 0.1),
        init_std=hf.get("initializer_range", 0.02),
        binary_head=binary_head,
    )


def _linear(w: HFWeights, out: dict, src: str, dst: str, shape) -> None:
    out[dst + ".weight"] = w.take(src + ".weight", shape)
    out[dst + ".bias"] = w.take(src + ".bias", shape[:1])


def _norm(w: HFWeights, out: dict, src: str, dst: str, h: int) -> None:
    out[dst + ".weight"] = w.take(src + ".weight", [h])
    out[dst + ".bias"] = w.take(src + ".bias", [h])


def import_weights(w: HFWeights, cfg: TransformerConfig) -> Dict[str, torch.Tensor]:
    """Our logical tensors (vocabulary unpadded) from a BERT state dict."""
    h, f, v = cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size
    e = "bert.embeddings."
    out = {"embedding.weight": w.take(e + "word_embeddings.weight", [v, h]),
           "position_embedding.weight": w.take(e + "position_embeddings.weight", [cfg.max_position_embeddings, h]),
           "token_type_embedding.weight": w.take(e + "token_type_embeddings.weight", [cfg.num_tokentypes, h])}
    _norm(w, out, e + "LayerNorm", "embedding_norm", h)
    for i in range(cfg.num_layers):
        src, dst = f"bert.encoder.layer.{i}.", f"layers.{i}."
        a = src + "attention.self."
        for kind, shape in (("weight", [h, h]), ("bias", [h])):
            q, k, val = (w.take(a + f"{n}.{kind}", shape) for n in ("query", "key", "value"))
            out[dst + f"attention.qkv.{kind}"] = fuse_qkv(q, k, val, cfg)
        _linear(w, out, src + "attention.output.dense", dst + "attention.proj", [h, h])
        _norm(w, out, src + "attention.output.LayerNorm", dst + "norm1", h)
        _linear(w, out, src + "intermediate.dense", dst + "mlp.fc1", [f, h])
        _linear(w, out, src + "output.dense", dst + "mlp.fc2", [h, f])
        _norm(w, out, src + "output.LayerNorm", dst + "norm2", h)
    p = "cls.predictions."
    _linear(w, out, p + "transform.dense", "lm_head.dense", [h, h])
    _norm(w, out, p + "transform.LayerNorm", "lm_head.norm", h)
    out["lm_head.bias"] = w.take(p + "bias", [v])
    if cfg.binary_head:
        _linear(w, out, "bert.pooler.dense", "pooler", [h, h])
        _linear(w, out, "cls.seq_relationship", "binary_head", [2, h])
    return out


def export_weights(sd: Dict[str, torch.Tensor], cfg: TransformerConfig) -> Dict[str, torch.Tensor]:
    """A ``BertForMaskedLM`` (or, with the binary head, ``BertForPreTraining``) state dict from
    our logical tensors; the decoder weight is the tied word embedding."""
    e = "bert.embeddings."
    out = {e + "word_embeddings.weight": sd["embedding.weight"],
           e + "position_embeddings.weight": sd["position_embedding.weight"],
           e + "token_type_embeddings.weight": sd["token_type_embedding.weight"],
           e + "LayerNorm.weight": sd["embedding_norm.weight"], e + "LayerNorm.bias": sd["embedding_norm.bias"]}
    names = (("attention.proj", "attention.output.dense"), ("norm1", "attention.output.LayerNorm"),
             ("mlp.fc1", "intermediate.dense"), ("mlp.fc2", "output.dense"), ("norm2", "output.LayerNorm"))
    for i in range(cfg.num_layers):
        src, dst = f"layers.{i}.", f"bert.encoder.layer.{i}."
        for kind in ("weight", "bias"):
            q, k, v = split_qkv(sd[src + f"attention.qkv.{kind}"], cfg)
            for name, t in (("query", q), ("key", k), ("value", v)):
                out[dst + f"attention.self.{name}.{kind}"] = t
            for ours, theirs in names:
                out[dst + f"{theirs}.{kind}"] = sd[src + f"{ours}.{kind}"]
    p = "cls.predictions."
    for kind in ("weight", "bias"):
        out[p + f"transform.dense.{kind}"] = sd[f"lm_head.dense.{kind}"]
        out[p + f"transform.LayerNorm.{kind}"] = sd[f"lm_head.norm.{kind}"]
        if cfg.binary_head:
            out[f"bert.pooler.dense.{kind}"] = sd[f"pooler.{kind}"]
            out[f"cls.seq_relationship.{kind}"] = sd[f"binary_head.{kind}"]
    out[p + "bias"] = sd["lm_head.bias"]
    out[p + "decoder.weight"] = sd["embedding.weight"]
    return out


def hf_config(cfg: TransformerConfig) -> dict:
    """``config.json`` of the exported model (``BertForPreTraining`` with the binary head)."""
    act = {v: k for k, v in ACTIVATIONS.items() if k != "gelu_pytorch_tanh"}[cfg.activation]
    return {
        "architectures": ["BertForPreTraining" if cfg.binary_head else "BertForMaskedLM"], "model_type": "bert",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads, "intermediate_size": cfg.ffn_hidden_size,
        "hidden_act": act, "max_position_embeddings": cfg.max_position_embeddings,
        "type_vocab_size": cfg.num_tokentypes, "layer_norm_eps": cfg.norm_eps, "initializer_range": cfg.init_std,
        "hidden_dropout_prob": cfg.hidden_dropout, "attention_probs_dropout_prob": cfg.attention_dropout,
        "tie_word_embeddings": True,
    }
