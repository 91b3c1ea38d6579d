"""Gemma 3, text only (``Gemma3ForCausalLM``, model_type ``gemma3_text``) <-> our GPT.

Gemma 2's architecture and tensor names (``gemma2``) plus QK-norm (zero-centred like every Gemma
norm; ``self_attn.q_norm`` / ``k_norm``, Qwen3's rows), without soft-capping by default, and with
two RoPEs: ``rope_parameters`` holds one per layer type. The global layers' (``full_attention``:
base, and the long-context scaling, linear for Gemma 3) are ``model.rope_theta`` and
``rope_scaling``; the windowed layers' (``sliding_attention``: a base, unscaled) are
``model.local_rope_theta``. Older files say the same with ``rope_theta``, ``rope_scaling`` (the
global layers') and ``rope_local_base_freq``, which transformers reads alike. By default five
windowed layers to one global (``sliding_window_pattern`` 6).
"""

from __future__ import annotations

from megatron_hydra.config.schema import ModelConfig
from megatron_hydra.config.transformer_config import TransformerConfig
from megatron_hydra.convert import gemma2, llama, qwen3, rope_parameters
from megatron_hydra.convert.layer_types import FULL, SLIDING
from megatron_hydra.convert.mapping import HFConfig
from megatron_hydra.convert.name_map import NameMap

MODEL_TYPE, ARCH = "gemma3_text", "gpt"  # Hugging Face's model_type; our model.arch
EXPRESSES = (*gemma2.EXPRESSES, "qk_norm", "local_rope_theta")
NAME_MAP = NameMap(MODEL_TYPE, rules=(*gemma2.BLOCK_RULES, *qwen3.QK_NORM_RULES, *llama.MLP_RULES),
                   ignored=llama.IGNORED)
GLOBAL_THETA, LOCAL_THETA = 1e6, 1e4


def _ropes(hf: HFConfig):
    """((theta, scaling) of the global layers, (theta, scaling) of the windowed ones)."""
    positions = hf.count("max_position_embeddings", 131072)
    params = hf.part("rope_parameters")
    if params and not ({FULL, SLIDING} & set(params)):
        raise hf.unsupported("rope_parameters", dict(params), f"one object per layer type ({FULL}, {SLIDING}) is")
    full = params.part(FULL) if params else hf.part("rope_scaling")
    full.update(hf.value("rope_scaling", dict, None) or {})  # the older layout's wins, as in transformers
    glob = rope_parameters.read(full, rope_parameters.base(hf, "rope_theta", GLOBAL_THETA), positions)
    local = rope_parameters.read(params.part(SLIDING), rope_parameters.base(hf, "rope_local_base_freq", LOCAL_THETA),
                                 positions)
    return glob, local


def model_config(hf: HFConfig, name: str) -> ModelConfig:
    pattern = hf.value("sliding_window_pattern", int, 6)  # transformers' default for layer_types
    if pattern < 1:
        raise hf.unsupported("sliding_window_pattern", pattern, "a positive integer (every n-th layer global) is")
    cfg = gemma2.gemma_config(hf, name, GLOBAL_THETA, attn_cap=None, final_cap=None, pattern=pattern)
    cfg.qk_norm = True
    (cfg.rope_theta, cfg.rope_scaling), (local, local_scaling) = _ropes(hf)
    windowed = cfg.sliding_window is not None
    if windowed and (local, local_scaling) != (cfg.rope_theta, cfg.rope_scaling):
        if local_scaling is not None:
            raise hf.unsupported(f"rope_parameters.{SLIDING}.rope_type", local_scaling.type,
                               "the windowed layers rotate by their own base unscaled (default), or as the global ones")
        cfg.local_rope_theta = local
    return cfg


def compatible(cfg: TransformerConfig) -> str:
    """Why ``cfg`` has no Gemma 3 counterpart, or '' when it has one."""
    why = gemma2.gemma(cfg, "Gemma 3")
    return why or ("" if cfg.qk_norm else "Gemma 3 normalises q and k (model.qk_norm=true)")


def hf_config(cfg: TransformerConfig) -> dict:
    config = gemma2.gemma_hf_config(cfg)
    del config["rope_theta"]
    full = rope_parameters.write(cfg.rope_theta, cfg.rope_scaling)
    local = full if cfg.local_rope_theta is None else rope_parameters.write(cfg.local_rope_theta, None)
    return {**config, "architectures": ["Gemma3ForCausalLM"], "model_type": MODEL_TYPE,
            "rope_parameters": {FULL: full, SLIDING: local}, "use_bidirectional_attention": False}
