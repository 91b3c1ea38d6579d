"""Qwen3 (``Qwen3ForCausalLM``) <-> our GPT.

A Llama (the same tensor names) with QK-norm: an RMSNorm over each head's q and k, before RoPE,
one weight [head_dim] each per layer (``self_attn.q_norm`` / ``k_norm`` -> our
``attention.q_norm`` / ``k_norm``), and ``head_dim`` set apart from hidden / heads. Its sliding
window is Qwen2's (``qwen2.window``). ``attention_bias`` would put biases on q, k, v and o but not
on the MLP, which our model does not express: it is refused.
"""

from __future__ import annotations

from megatron_hydra.config.schema import ModelConfig
from megatron_hydra.config.transformer_config import TransformerConfig
from megatron_hydra.convert import llama, qwen2
from megatron_hydra.convert.llama import LAYERS, L, M
from megatron_hydra.convert.mapping import HFConfig
from megatron_hydra.convert.name_map import NameMap, Rule

MODEL_TYPE, ARCH = "qwen3", "gpt"  # Hugging Face's model_type; our model.arch
EXPRESSES = ("rope_scaling", "qk_norm", "sliding_window")
QK_NORM_RULES = tuple(Rule(f"{L}attention.{x}_norm.weight", f"{M}self_attn.{x}_norm.weight", per=LAYERS) for x in "qk")
NAME_MAP = NameMap(MODEL_TYPE, rules=(*llama.BLOCK_RULES, *QK_NORM_RULES, *llama.MLP_RULES), ignored=llama.IGNORED)


def model_config(hf: HFConfig, name: str) -> ModelConfig:
    llama.check_activation(hf, "hidden_act", "silu", "silu")
    llama.refuse_attention_bias(hf)
    cfg = qwen2.window(hf, llama.base_config(hf, name))
    cfg.qk_norm = True
    return cfg


def compatible(cfg: TransformerConfig) -> str:
    """Why ``cfg`` has no Qwen3 counterpart, or '' when it has one."""
    why = llama.plain(cfg, "Qwen3") or llama.no_biases(cfg, "Qwen3")
    return why or ("" if cfg.qk_norm else "Qwen3 normalises q and k (model.qk_norm=true)")


def hf_config(cfg: TransformerConfig) -> dict:
    config = llama.hf_config(cfg)
    del config["mlp_bias"]
    return {**config, "architectures": ["Qwen3ForCausalLM"], "model_type": MODEL_TYPE, **qwen2.window_config(cfg)}
