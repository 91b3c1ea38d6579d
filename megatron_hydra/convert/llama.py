"""Llama family (``LlamaForCausalLM``, Llama 2 and 3.x) <-> our GPT; the rows and the config reading
the other Llama-shaped families (Mistral, Mixtral, Qwen, Gemma) build on.

- RoPE: Hugging Face's Llama applies rotary embeddings in the rotate-half convention to q and k
  as its q_proj / k_proj produce them (its conversion from Meta's interleaved layout permuted the
  weights once). Our ``RotaryEmbedding`` is rotate-half with the same frequencies, so q_proj and
  k_proj rows are taken in order, with no permutation. Llama 3.1+'s ``llama3`` scaling (and
  ``linear``, ``yarn``) is ``model.rope_scaling`` (``convert.rope_parameters``).
- Grouped-query attention: q_proj [heads*d, h], k_proj / v_proj [groups*d, h], fused per group
  (``mapping.fuse_qkv``). ``head_dim`` may differ from hidden / heads (our kv_channels).
- SwiGLU: down(silu(gate(x)) * up(x)); ours is fc2(silu(gate(x)) * fc1(x)), so up -> fc1.
- RMSNorm weights; biases on every linear layer (attention_bias and mlp_bias both) or on none;
  untied output head (tied when tie_word_embeddings is set).
"""

from __future__ import annotations

from megatron_hydra.config.schema import ModelConfig
from megatron_hydra.config.transformer_config import TransformerConfig
from megatron_hydra.convert import rope_parameters
from megatron_hydra.convert.mapping import HFConfig
from megatron_hydra.convert.name_map import QKV, NameMap, Rule, biased, tied, untied, weight_and_bias

MODEL_TYPE, ARCH = "llama", "gpt"  # Hugging Face's model_type; our model.arch
EXPRESSES = ("rope_scaling",)  # the architecture keys (convert.features) a Llama expresses
# Rotary tables are built per layer for seq_length positions; a model that allows 128k positions
# trains at a shorter length, which the user raises with model.seq_length.
MAX_DEFAULT_SEQ_LENGTH = 4096

L, M, LAYERS = "layers.{i}.", "model.layers.{i}.", "num_layers"


def qkv_biased(cfg: TransformerConfig) -> bool:
    return cfg.qkv_bias


# Embeddings, final norm and head (every Llama-shaped family).
OUTER_RULES = (
    Rule("embedding.weight", "model.embed_tokens.weight"),
    Rule("embedding.weight", "lm_head.weight", when=tied, tied=True),
    Rule("output_weight", "lm_head.weight", when=untied),
    Rule("final_norm.weight", "model.norm.weight"),
)
# Self-attention: q/k/v fused per query group, their bias where model.qkv_bias, o_proj.
ATTENTION_RULES = (
    Rule(L + "attention.qkv.weight", tuple(f"{M}self_attn.{x}_proj.weight" for x in "qkv"), QKV, per=LAYERS),
    Rule(L + "attention.qkv.bias", tuple(f"{M}self_attn.{x}_proj.bias" for x in "qkv"), QKV, per=LAYERS,
         when=qkv_biased),
    *weight_and_bias(L + "attention.proj", M + "self_attn.o_proj", per=LAYERS, bias=biased),
)
# Everything but the MLP (Mixtral, Mistral and Qwen share them).
BLOCK_RULES = (
    *OUTER_RULES,
    Rule(L + "norm1.weight", M + "input_layernorm.weight", per=LAYERS),
    *ATTENTION_RULES,
    Rule(L + "norm2.weight", M + "post_attention_layernorm.weight", per=LAYERS),
)
# The dense SwiGLU MLP (its bias only in a Llama with mlp_bias).
MLP_RULES = (
    *weight_and_bias(L + "mlp.gate", M + "mlp.gate_proj", per=LAYERS, bias=biased),
    *weight_and_bias(L + "mlp.fc1", M + "mlp.up_proj", per=LAYERS, bias=biased),
    *weight_and_bias(L + "mlp.fc2", M + "mlp.down_proj", per=LAYERS, bias=biased),
)
IGNORED = ("rotary_emb.inv_freq",)  # a buffer older files carry: not a weight
NAME_MAP = NameMap(MODEL_TYPE, rules=(*BLOCK_RULES, *MLP_RULES), ignored=IGNORED)


def check_activation(hf: HFConfig, key: str, expected: str, default: str) -> None:
    act = hf.value(key, str, default)
    if act != expected:
        raise hf.unsupported(key, act, f"only {expected} is")


def refuse_attention_bias(hf: HFConfig) -> None:
    """Families whose ``attention_bias`` puts biases on q, k, v and o but none on the MLP, which
    our model does not express (it has them on every linear layer or QKV alone)."""
    bias = hf.value("attention_bias", bool, False)
    if bias:
        raise hf.unsupported("attention_bias", bias, "only false is (biases on the attention without the MLP's)")


def no_biases(cfg: TransformerConfig, family: str) -> str:
    return f"{family} has no biases (model.add_bias_linear=false)" if cfg.add_bias_linear else ""


def base_config(hf: HFConfig, name: str, rope_theta: float = 10000.0, norm_eps: float = 1e-6,
                tie: bool = False) -> ModelConfig:
    """The model config every Llama-shaped ``config.json`` states alike (no biases; ``rope_theta``,
    ``norm_eps`` and ``tie``: the family's defaults where the file has no value)."""
    heads, hidden = hf.count("num_attention_heads"), hf.count("hidden_size")
    positions = hf.count("max_position_embeddings", 2048)
    theta, scaling = rope_parameters.rope_of(hf, rope_theta)
    return ModelConfig(
        name=name, num_layers=hf.count("num_hidden_layers"), hidden_size=hidden, num_attention_heads=heads,
        num_query_groups=hf.count("num_key_value_heads", heads), ffn_hidden_size=hf.count("intermediate_size"),
        kv_channels=hf.count("head_dim", max(hidden // heads, 1)),
        seq_length=min(positions, MAX_DEFAULT_SEQ_LENGTH),
        max_position_embeddings=positions, vocab_size=hf.count("vocab_size"), position_embedding="rope",
        rope_theta=theta, rope_scaling=scaling, normalization="rmsnorm",
        norm_eps=hf.value("rms_norm_eps", float, norm_eps),
        activation="swiglu", add_bias_linear=False, tie_embeddings=hf.value("tie_word_embeddings", bool, tie),
        hidden_dropout=0.0, attention_dropout=hf.value("attention_dropout", float, 0.0),
        init_std=hf.value("initializer_range", float, 0.02),
    )


def model_config(hf: HFConfig, name: str, rope_theta: float = 10000.0, norm_eps: float = 1e-6) -> ModelConfig:
    """Our model config for a Llama ``config.json`` (``rope_theta`` and ``norm_eps``: the defaults
    where the file has no value)."""
    check_activation(hf, "hidden_act", "silu", "silu")
    bias = hf.value("attention_bias", bool, False)
    if bias != hf.value("mlp_bias", bool, False):
        raise hf.unsupported("attention_bias", bias, "only attention_bias equal to mlp_bias is (our model has biases "
                     "on every linear layer or on none)")
    cfg = base_config(hf, name, rope_theta, norm_eps)
    cfg.add_bias_linear = bias
    return cfg


def plain(cfg: TransformerConfig, family: str) -> str:
    """Why ``cfg`` is not a Llama-shaped model of ``family`` (RoPE, RMSNorm, SwiGLU), or ''. The
    architecture keys it uses are checked for every family alike (``families.why_not``)."""
    if cfg.position_embedding != "rope" or cfg.normalization != "rmsnorm" or cfg.activation != "swiglu":
        return f"{family} needs rope, rmsnorm and swiglu"
    return ""


def compatible(cfg: TransformerConfig) -> str:
    """Why ``cfg`` has no Llama counterpart, or '' when it has one."""
    return plain(cfg, "Llama")


def hf_config(cfg: TransformerConfig) -> dict:
    """The config.json keys every Llama-shaped family writes alike."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "num_hidden_layers": cfg.num_layers, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_query_groups,
        "head_dim": cfg.kv_channels, "hidden_act": "silu", "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size, "rms_norm_eps": cfg.norm_eps,
        **rope_parameters.legacy(cfg.rope_theta, cfg.rope_scaling),
        "rope_parameters": rope_parameters.write(cfg.rope_theta, cfg.rope_scaling),
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": cfg.add_bias_linear,
        "mlp_bias": cfg.add_bias_linear, "attention_dropout": cfg.attention_dropout, "initializer_range": cfg.init_std,
    }
