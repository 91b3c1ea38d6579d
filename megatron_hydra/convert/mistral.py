"""Mistral (``MistralForCausalLM``) <-> our GPT.

A Llama without biases (the same tensor names) whose ``sliding_window``, when set, windows every
layer (Mistral 7B v0.1: 4096; later versions: null); ``head_dim`` may differ from hidden / heads.
"""

from __future__ import annotations

from megatron_hydra.config.schema import ModelConfig
from megatron_hydra.config.transformer_config import TransformerConfig
from megatron_hydra.convert import features, llama
from megatron_hydra.convert.mapping import HFConfig
from megatron_hydra.convert.name_map import NameMap

MODEL_TYPE, ARCH = "mistral", "gpt"  # Hugging Face's model_type; our model.arch
EXPRESSES = ("rope_scaling", "sliding_window")
NAME_MAP = NameMap(MODEL_TYPE, rules=(*llama.BLOCK_RULES, *llama.MLP_RULES), ignored=llama.IGNORED)


def model_config(hf: HFConfig, name: str) -> ModelConfig:
    llama.check_activation(hf, "hidden_act", "silu", "silu")
    cfg = llama.base_config(hf, name)
    cfg.sliding_window = hf.count("sliding_window", None)
    return cfg


def compatible(cfg: TransformerConfig) -> str:
    """Why ``cfg`` has no Mistral counterpart, or '' when it has one."""
    why = llama.plain(cfg, "Mistral") or llama.no_biases(cfg, "Mistral")
    if why:
        return why
    if cfg.window_layers and not features.windowed_everywhere(cfg):
        return "Mistral windows every layer or none (model.sliding_window_pattern=1)"
    return ""


def hf_config(cfg: TransformerConfig) -> dict:
    config = llama.hf_config(cfg)
    for key in ("attention_bias", "mlp_bias"):
        del config[key]
    window = cfg.sliding_window if cfg.window_layers else None
    return {**config, "architectures": ["MistralForCausalLM"], "model_type": MODEL_TYPE, "sliding_window": window}
