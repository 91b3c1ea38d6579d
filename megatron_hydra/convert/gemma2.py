"""Gemma 2 (``Gemma2ForCausalLM``) <-> our GPT.

- Every RMSNorm scales by (1 + w) (``model.zero_centered_gamma``), with w stored as it is.
- Four norms per layer (``model.post_sublayer_norm``): ``x + post(f(pre(x)))`` for attention and
  MLP. ``input_layernorm`` / ``post_attention_layernorm`` are our ``norm1`` / ``norm1_out`` around
  the attention, ``pre_feedforward_layernorm`` / ``post_feedforward_layernorm`` our ``norm2`` /
  ``norm2_out`` around the MLP: ``post_attention_layernorm`` is not Llama's pre-MLP norm here.
- Word embeddings times sqrt(hidden) (``model.scale_embeddings``); the head tied to them by default.
- GeGLU with tanh GELU (``hidden_activation=gelu_pytorch_tanh``): down(gelu(gate(x)) * up(x)), our
  ``geglu``. No biases.
- Attention scores scaled by 1 / sqrt(``query_pre_attn_scalar``) and soft-capped,
  c tanh(s / c) (``attn_logit_softcapping``), the logits too (``final_logit_softcapping``); the
  sliding window on the layers ``layer_types`` marks (by default every other one, from the first).
"""

from __future__ import annotations

from megatron_hydra.config.schema import ModelConfig
from megatron_hydra.config.transformer_config import TransformerConfig
from megatron_hydra.convert import layer_types, llama
from megatron_hydra.convert.llama import LAYERS, L, M
from megatron_hydra.convert.mapping import HFConfig
from megatron_hydra.convert.name_map import NameMap, Rule

MODEL_TYPE, ARCH = "gemma2", "gpt"  # Hugging Face's model_type; our model.arch
EXPRESSES = ("rope_scaling", "sliding_window", "query_pre_attn_scalar", "attn_logit_softcapping",
            "final_logit_softcapping", "zero_centered_gamma", "post_sublayer_norm", "scale_embeddings")
ACTIVATION = "gelu_pytorch_tanh"
# Embeddings, head and the attention are Llama's; the norms are Gemma's four per layer.
BLOCK_RULES = (
    *llama.OUTER_RULES,
    *llama.ATTENTION_RULES,
    *(Rule(f"{L}{ours}.weight", f"{M}{theirs}.weight", per=LAYERS) for ours, theirs in (
        ("norm1", "input_layernorm"), ("norm1_out", "post_attention_layernorm"),
        ("norm2", "pre_feedforward_layernorm"), ("norm2_out", "post_feedforward_layernorm"))),
)
NAME_MAP = NameMap(MODEL_TYPE, rules=(*BLOCK_RULES, *llama.MLP_RULES), ignored=llama.IGNORED)


def _given(hf: HFConfig, key: str, default):
    """``hf[key]`` (a positive number, or null: off) when the file has the key, else the family's
    default: a zero would divide the scores (c tanh(s / c)), a negative one flip them."""
    if key not in hf:
        return default
    value = hf.value(key, float, None)
    if value is not None and not value > 0:
        raise hf.unsupported(key, value, "a positive number (or null: off) is")
    return value


def gemma_config(hf: HFConfig, name: str, rope_theta: float, attn_cap, final_cap, pattern: int) -> ModelConfig:
    """The model config of a Gemma 2 or 3 ``config.json``; the arguments: the family's defaults
    (``pattern``: every n-th layer global, where the file has no ``layer_types``)."""
    act = hf.value("hidden_activation", str, None) or hf.value("hidden_act", str, ACTIVATION)
    if act != ACTIVATION:
        raise hf.unsupported("hidden_activation", act, f"only {ACTIVATION} is")
    llama.refuse_attention_bias(hf)
    if hf.value("use_bidirectional_attention", bool, False):
        raise hf.unsupported("use_bidirectional_attention", True, "only causal attention (false) is")
    cfg = llama.base_config(hf, name, rope_theta=rope_theta, tie=True)
    cfg.activation, cfg.zero_centered_gamma, cfg.post_sublayer_norm, cfg.scale_embeddings = "geglu", True, True, True
    cfg.query_pre_attn_scalar = _given(hf, "query_pre_attn_scalar", 256.0) or 256.0
    cfg.attn_logit_softcapping = _given(hf, "attn_logit_softcapping", attn_cap)
    cfg.final_logit_softcapping = _given(hf, "final_logit_softcapping", final_cap)
    flags = layer_types.read(hf, cfg.num_layers)
    if flags is None:
        flags = [bool((i + 1) % pattern) for i in range(cfg.num_layers)]
    window = hf.count("sliding_window", None) if "sliding_window" in hf else 4096
    if window is not None and any(flags):
        cfg.sliding_window, cfg.sliding_window_pattern = window, layer_types.pattern(flags, pattern)
    return cfg


def model_config(hf: HFConfig, name: str) -> ModelConfig:
    return gemma_config(hf, name, 10000.0, attn_cap=50.0, final_cap=30.0, pattern=2)


def gemma(cfg: TransformerConfig, family: str) -> str:
    """Why ``cfg`` is not a Gemma of ``family``, or '' (the architecture keys it uses are checked
    for every family alike: ``families.why_not``)."""
    if cfg.position_embedding != "rope" or cfg.normalization != "rmsnorm" or cfg.activation != "geglu":
        return f"{family} needs rope, rmsnorm and geglu"
    why = llama.no_biases(cfg, family)
    if why:
        return why
    if not (cfg.zero_centered_gamma and cfg.post_sublayer_norm and cfg.scale_embeddings):
        return (f"{family} has zero-centred norms, post-sub-layer norms and scaled embeddings "
                "(model.zero_centered_gamma, post_sublayer_norm, scale_embeddings: true)")
    return ""


def compatible(cfg: TransformerConfig) -> str:
    """Why ``cfg`` has no Gemma 2 counterpart, or '' when it has one."""
    return gemma(cfg, "Gemma 2")


def query_pre_attn_scalar(cfg: TransformerConfig):
    """The q with 1/sqrt(q) = our softmax scale (an integer where it is one, as files write it)."""
    if cfg.softmax_scale is None:
        return cfg.kv_channels
    q = cfg.softmax_scale ** -2
    return round(q) if round(q) ** -0.5 == cfg.softmax_scale else q


def gemma_hf_config(cfg: TransformerConfig) -> dict:
    """The config.json keys Gemma 2 and 3 write alike."""
    config = llama.hf_config(cfg)
    for key in ("hidden_act", "mlp_bias", "rope_scaling"):
        del config[key]
    layers = cfg.window_layers if cfg.sliding_window is not None else ()
    return {**config, "hidden_activation": ACTIVATION, "query_pre_attn_scalar": query_pre_attn_scalar(cfg),
            "attn_logit_softcapping": cfg.attn_logit_softcapping,
            "final_logit_softcapping": cfg.final_logit_softcapping,
            # A window no layer uses still needs a value: the model builds its mask regardless.
            "sliding_window": cfg.sliding_window if layers else cfg.max_position_embeddings,
            "layer_types": layer_types.write(cfg)}


def hf_config(cfg: TransformerConfig) -> dict:
    return {**gemma_hf_config(cfg), "architectures": ["Gemma2ForCausalLM"], "model_type": MODEL_TYPE}
