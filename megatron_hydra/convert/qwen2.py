"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``) <-> our GPT.

A Llama (``llama.BLOCK_RULES``, ``MLP_RULES``: the same tensor names) with a bias on q, k and v
alone: ``model.qkv_bias=true``, ``add_bias_linear=false``. Its sliding window is set by
``use_sliding_window`` and ``sliding_window``, the windowed layers by ``layer_types`` (or, in files
without it, every layer from ``max_window_layers`` on), which ``convert.layer_types`` maps to
``model.sliding_window_pattern``.
"""

from __future__ import annotations

from typing import Optional

from megatron_hydra.config.schema import ModelConfig
from megatron_hydra.config.transformer_config import TransformerConfig
from megatron_hydra.convert import layer_types, llama
from megatron_hydra.convert.mapping import HFConfig
from megatron_hydra.convert.name_map import NameMap

MODEL_TYPE, ARCH = "qwen2", "gpt"  # Hugging Face's model_type; our model.arch
EXPRESSES = ("rope_scaling", "qkv_bias", "sliding_window")
NAME_MAP = NameMap(MODEL_TYPE, rules=(*llama.BLOCK_RULES, *llama.MLP_RULES), ignored=llama.IGNORED)


def window(hf: HFConfig, cfg: ModelConfig) -> ModelConfig:
    """``cfg`` with Qwen's sliding window: ``sliding_window`` tokens where ``use_sliding_window``,
    on the layers ``layer_types`` marks (else those from ``max_window_layers`` on)."""
    size: Optional[int] = hf.count("sliding_window", None) if hf.value("use_sliding_window", bool, False) else None
    flags = layer_types.read(hf, cfg.num_layers)
    if flags is None:
        start = hf.value("max_window_layers", int, cfg.num_layers)
        flags = [size is not None and i >= start for i in range(cfg.num_layers)]
    if size is not None and any(flags):
        cfg.sliding_window, cfg.sliding_window_pattern = size, layer_types.pattern(flags)
    return cfg


def model_config(hf: HFConfig, name: str) -> ModelConfig:
    llama.check_activation(hf, "hidden_act", "silu", "silu")
    cfg = window(hf, llama.base_config(hf, name))
    cfg.qkv_bias = True
    return cfg


def compatible(cfg: TransformerConfig) -> str:
    """Why ``cfg`` has no Qwen2 counterpart, or '' when it has one."""
    why = llama.plain(cfg, "Qwen2")
    if why:
        return why
    if not cfg.qkv_bias or cfg.add_bias_linear:
        return "Qwen2 has biases on q, k and v alone (model.qkv_bias=true, model.add_bias_linear=false)"
    return ""


def window_config(cfg: TransformerConfig) -> dict:
    """Qwen's sliding-window keys of ``config.json`` for our model."""
    layers = cfg.window_layers if cfg.sliding_window is not None else ()
    return {"use_sliding_window": bool(layers), "sliding_window": cfg.sliding_window if layers else None,
            "max_window_layers": min(layers, default=cfg.num_layers), "layer_types": layer_types.write(cfg)}


def hf_config(cfg: TransformerConfig) -> dict:
    config = llama.hf_config(cfg)
    for key in ("attention_bias", "mlp_bias"):  # Qwen2's biases are on q, k, v whatever they say
        del config[key]
    return {**config, "architectures": ["Qwen2ForCausalLM"], "model_type": MODEL_TYPE, **window_config(cfg)}
