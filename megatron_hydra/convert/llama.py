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

from megatron_hydra.config.schema import ModelConfig
from megatron_hydra.config.transformer_config import TransformerConfig
from megatron_hydra.convert.mapping import HFConfig
from megatron_hydra.convert.name_map import QKV, NameMap, Rule, biased, tied, untied, weight_and_bias
from megatron_hydra.errors import ConfigError

MODEL_TYPE, ARCH = "llama", "gpt"  # Hugging Face's model_type; our model.arch
# Rotary tables are built per layer for seq_length positions; a model that allows 128k positions
# trains at a shorter length, which the user raises with model.seq_length.
MAX_DEFAULT_SEQ_LENGTH = 4096

L, M, LAYERS = "layers.{i}.", "model.layers.{i}.", "num_layers"
# Everything but the MLP: embeddings, norms, attention, head (Mixtral shares them).
BLOCK_RULES = (
    Rule("embedding.weight", "model.embed_tokens.weight"),
    Rule("embedding.weight", "lm_head.weight", when=tied, tied=True),
    Rule("output_weight", "lm_head.weight", when=untied),
    Rule("final_norm.weight", "model.norm.weight"),
    Rule(L + "norm1.weight", M + "input_layernorm.weight", per=LAYERS),
    Rule(L + "attention.qkv.weight", tuple(f"{M}self_attn.{x}_proj.weight" for x in "qkv"), QKV, per=LAYERS),
    Rule(L + "attention.qkv.bias", tuple(f"{M}self_attn.{x}_proj.bias" for x in "qkv"), QKV, per=LAYERS,
         when=biased),
    *weight_and_bias(L + "attention.proj", M + "self_attn.o_proj", per=LAYERS, bias=biased),
    Rule(L + "norm2.weight", M + "post_attention_layernorm.weight", per=LAYERS),
)
IGNORED = ("rotary_emb.inv_freq",)  # a buffer older files carry: not a weight
NAME_MAP = NameMap(
    MODEL_TYPE,
    rules=(
        *BLOCK_RULES,
        *weight_and_bias(L + "mlp.gate", M + "mlp.gate_proj", per=LAYERS, bias=biased),
        *weight_and_bias(L + "mlp.fc1", M + "mlp.up_proj", per=LAYERS, bias=biased),
        *weight_and_bias(L + "mlp.fc2", M + "mlp.down_proj", per=LAYERS, bias=biased),
    ),
    ignored=IGNORED,
)


def _rope_theta(hf: HFConfig, family: str, default: float) -> float:
    params = HFConfig(hf.value("rope_parameters", dict, {}), hf.path)
    scaling = HFConfig(hf.value("rope_scaling", dict, {}), hf.path)
    kind = params.value("rope_type", str, scaling.value("rope_type", str, scaling.value("type", str, "default")))
    if kind != "default":
        raise ConfigError(f"{family} rope_type={kind!r} (rope scaling) is not supported: only plain RoPE is")
    return params.value("rope_theta", float, hf.value("rope_theta", float, default))


def model_config(hf: HFConfig, name: str, family: str = "Llama", rope_theta: float = 10000.0,
                 norm_eps: float = 1e-6) -> ModelConfig:
    """Our model config for a Llama-architecture ``config.json``: ``family`` names it in messages,
    ``rope_theta`` and ``norm_eps`` are its defaults where the file has no value."""
    act = hf.value("hidden_act", str, "silu")
    if act != "silu":
        raise ConfigError(f"{family} hidden_act={act!r} is not supported: only silu (SwiGLU) is")
    bias = hf.value("attention_bias", bool, False)
    if bias != hf.value("mlp_bias", bool, False):
        raise ConfigError(f"{family} with attention_bias != mlp_bias is not supported: our model has biases on all "
                          "linear layers or on none")
    heads, hidden = hf.value("num_attention_heads", int), hf.value("hidden_size", int)
    positions = hf.value("max_position_embeddings", int, 2048)
    return ModelConfig(
        name=name, num_layers=hf.value("num_hidden_layers", int), hidden_size=hidden, num_attention_heads=heads,
        num_query_groups=hf.value("num_key_value_heads", int, heads),
        ffn_hidden_size=hf.value("intermediate_size", int), kv_channels=hf.value("head_dim", int, hidden // max(heads, 1)),
        seq_length=min(positions, MAX_DEFAULT_SEQ_LENGTH),
        max_position_embeddings=positions, vocab_size=hf.value("vocab_size", int), position_embedding="rope",
        rope_theta=_rope_theta(hf, family, rope_theta), normalization="rmsnorm",
        norm_eps=hf.value("rms_norm_eps", float, norm_eps),
        activation="swiglu", add_bias_linear=bias, tie_embeddings=hf.value("tie_word_embeddings", bool, False),
        hidden_dropout=0.0, attention_dropout=hf.value("attention_dropout", float, 0.0),
        init_std=hf.value("initializer_range", float, 0.02),
    )


def compatible(cfg: TransformerConfig) -> str:
    """Why ``cfg`` has no Llama counterpart, or '' when it has one."""
    if cfg.position_embedding != "rope" or cfg.normalization != "rmsnorm" or cfg.activation != "swiglu":
        return "Llama needs rope, rmsnorm and swiglu"
    if cfg.moe is not None:
        return "Llama has no experts (model.moe)"
    return ""


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
