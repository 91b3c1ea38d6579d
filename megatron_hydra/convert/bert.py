"""Hugging Face BERT (``BertForMaskedLM``, ``BertForPreTraining``) <-> our BERT.

- Attention: HF's separate query / key / value projections are fused per head into our QKV
  layout (``mapping.fuse_qkv``; BERT has no grouped-query attention). Its ``attention.output``
  dense is our ``attention.proj``, ``intermediate`` / ``output`` dense are ``mlp.fc1`` / ``fc2``.
- Post-LN: ``attention.output.LayerNorm`` follows the attention's residual sum (our ``norm1``),
  ``output.LayerNorm`` the MLP's (``norm2``), as in the post-norm ``models.transformer.Block``.
- Masked-LM head: ``cls.predictions.transform`` is our ``lm_head.dense`` / ``lm_head.norm``;
  its decoder is tied to the word embedding and its bias is ``lm_head.bias``. The pooler and
  ``cls.seq_relationship`` (``BertForPreTraining`` only) are our ``pooler`` / ``binary_head``;
  a directory whose architecture is not ``BertForPreTraining`` imports without them (as
  ``BertForMaskedLM`` loads it: many published BERTs carry the pretraining heads).
"""

from __future__ import annotations

from typing import Optional

from megatron_hydra.config.schema import ModelConfig
from megatron_hydra.config.transformer_config import TransformerConfig
from megatron_hydra.convert.mapping import HFConfig
from megatron_hydra.convert.name_map import QKV, NameMap, Rule, weight_and_bias
from megatron_hydra.errors import ConfigError

MODEL_TYPE, ARCH = "bert", "bert"  # Hugging Face's model_type; our model.arch
ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}

E, L, B, LAYERS = "bert.embeddings.", "layers.{i}.", "bert.encoder.layer.{i}.", "num_layers"
P = "cls.predictions."


def _binary_head(cfg: TransformerConfig) -> bool:
    return cfg.binary_head


NAME_MAP = NameMap(
    MODEL_TYPE,
    rules=(
        Rule("embedding.weight", E + "word_embeddings.weight"),
        Rule("embedding.weight", P + "decoder.weight", tied=True),
        Rule("position_embedding.weight", E + "position_embeddings.weight"),
        Rule("token_type_embedding.weight", E + "token_type_embeddings.weight"),
        *weight_and_bias("embedding_norm", E + "LayerNorm"),
        Rule(L + "attention.qkv.weight", tuple(f"{B}attention.self.{x}.weight" for x in ("query", "key", "value")),
             QKV, per=LAYERS),
        Rule(L + "attention.qkv.bias", tuple(f"{B}attention.self.{x}.bias" for x in ("query", "key", "value")),
             QKV, per=LAYERS),
        *weight_and_bias(L + "attention.proj", B + "attention.output.dense", per=LAYERS),
        *weight_and_bias(L + "norm1", B + "attention.output.LayerNorm", per=LAYERS),
        *weight_and_bias(L + "mlp.fc1", B + "intermediate.dense", per=LAYERS),
        *weight_and_bias(L + "mlp.fc2", B + "output.dense", per=LAYERS),
        *weight_and_bias(L + "norm2", B + "output.LayerNorm", per=LAYERS),
        *weight_and_bias("lm_head.dense", P + "transform.dense"),
        *weight_and_bias("lm_head.norm", P + "transform.LayerNorm"),
        Rule("lm_head.bias", P + "bias"),
        Rule("lm_head.bias", P + "decoder.bias", tied=True),
        *weight_and_bias("pooler", "bert.pooler.dense", when=_binary_head),
        *weight_and_bias("binary_head", "cls.seq_relationship", when=_binary_head),
    ),
    # Buffers older files carry, and the pretraining heads a BertForMaskedLM import leaves out.
    ignored=("embeddings.position_ids", "pooler.dense.weight", "pooler.dense.bias", "seq_relationship.weight",
             "seq_relationship.bias"),
)


def model_config(hf: dict, name: str, binary_head: Optional[bool] = None) -> ModelConfig:
    """Our BERT for a ``config.json``; with the sentence-order head when ``binary_head`` or, left
    None, when the directory is a ``BertForPreTraining``."""
    hf = hf if isinstance(hf, HFConfig) else HFConfig(hf, "config.json")
    act = hf.value("hidden_act", str, "gelu")
    if act not in ACTIVATIONS:
        raise ConfigError(f"BERT hidden_act={act!r} is not supported: use one of {', '.join(ACTIVATIONS)}")
    types = hf.value("type_vocab_size", int, 2)
    if types != 2:
        raise ConfigError(f"BERT type_vocab_size={types} is not supported: only 2 segments")
    positions_kind = hf.value("position_embedding_type", str, "absolute")
    if positions_kind != "absolute":
        raise ConfigError(f"BERT position_embedding_type={positions_kind!r} is not supported: only absolute")
    if binary_head is None:
        binary_head = "BertForPreTraining" in hf.value("architectures", list, [])
    positions = hf.value("max_position_embeddings", int, 512)
    return ModelConfig(
        name=name, arch="bert", num_layers=hf.value("num_hidden_layers", int), hidden_size=hf.value("hidden_size", int),
        num_attention_heads=hf.value("num_attention_heads", int), ffn_hidden_size=hf.value("intermediate_size", int),
        seq_length=positions, max_position_embeddings=positions, vocab_size=hf.value("vocab_size", int),
        position_embedding="learned", normalization="layernorm", norm_eps=hf.value("layer_norm_eps", float, 1e-12),
        activation=ACTIVATIONS[act], add_bias_linear=True, tie_embeddings=True,
        hidden_dropout=hf.value("hidden_dropout_prob", float, 0.1),
        attention_dropout=hf.value("attention_probs_dropout_prob", float, 0.1),
        init_std=hf.value("initializer_range", float, 0.02),
        binary_head=binary_head,
    )


def compatible(cfg: TransformerConfig) -> str:
    """Why ``cfg`` has no BERT counterpart, or '' when it has one."""
    if cfg.normalization != "layernorm" or cfg.activation not in ACTIVATIONS.values():
        return "BERT needs layernorm and gelu"
    if not cfg.add_bias_linear or not cfg.tie_embeddings:
        return "BERT needs biases and a masked-LM decoder tied to the word embedding"
    if cfg.num_query_groups != cfg.num_attention_heads or cfg.kv_channels * cfg.num_attention_heads != cfg.hidden_size:
        return "BERT needs plain multi-head attention with head size hidden_size / heads"
    return ""


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
