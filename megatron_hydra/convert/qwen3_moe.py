"""Qwen3-MoE (``Qwen3MoeForCausalLM``, e.g. Qwen3-30B-A3B) <-> our GPT with MoE layers.

- Attention, norms, embeddings and head are Qwen3's (QK-norm included; the same tensor names).
- A layer is MoE unless ``mlp_only_layers`` lists it, and only every ``decoder_sparse_step``-th
  (layer i with (i + 1) % step == 0): ``model.moe.layer_freq`` as one 0/1 per layer. Its ``mlp.gate``
  is the router [E, h]; expert e's ``mlp.experts.e.gate_proj`` / ``up_proj`` / ``down_proj`` are our
  gate / fc1 / fc2 (the names of the files on the Hub and of what ``save_pretrained`` writes;
  ``transformers`` 5 fuses the experts in memory and converts on load and save), of size
  ``moe_intermediate_size``; the dense layers' MLP is Llama's, of size ``intermediate_size``.
- Routing: softmax over all expert logits, top-k, renormalised to sum 1 only with
  ``norm_topk_prob``: our ``router=softmax``, ``norm_topk``. No shared expert.
- ``use_sliding_window`` windows every layer (this family has no ``layer_types``).
"""

from __future__ import annotations

import dataclasses

from megatron_hydra.config.schema import ModelConfig, MoEConfig
from megatron_hydra.config.transformer_config import TransformerConfig
from megatron_hydra.convert import features, llama, qwen3
from megatron_hydra.convert.llama import LAYERS, L, M
from megatron_hydra.convert.mapping import HFConfig
from megatron_hydra.convert.name_map import NameMap, Rule

MODEL_TYPE, ARCH = "qwen3_moe", "gpt"  # Hugging Face's model_type; our model.arch
EXPRESSES = ("rope_scaling", "qk_norm", "sliding_window", "moe")


def moe_layer(cfg: TransformerConfig, layer: int) -> bool:
    return layer in cfg.moe_layers


def dense_layer(cfg: TransformerConfig, layer: int) -> bool:
    return layer not in cfg.moe_layers


def has_experts(cfg: TransformerConfig) -> bool:
    return cfg.moe is not None


E, X = L + "mlp.experts.{e}.", M + "mlp.experts.{e}."
EXPERT_RULES = (
    Rule(L + "mlp.router.weight", M + "mlp.gate.weight", per=LAYERS, when=has_experts, only=moe_layer),
    *(Rule(f"{E}{ours}.weight", f"{X}{theirs}.weight", per=LAYERS, when=has_experts, only=moe_layer)
      for ours, theirs in (("gate", "gate_proj"), ("fc1", "up_proj"), ("fc2", "down_proj"))),
)
NAME_MAP = NameMap(
    MODEL_TYPE,
    rules=(*llama.BLOCK_RULES, *qwen3.QK_NORM_RULES, *EXPERT_RULES,
           *(dataclasses.replace(rule, only=dense_layer) for rule in llama.MLP_RULES)),
    ignored=llama.IGNORED,
)


def _layer_freq(hf: HFConfig, num_layers: int):
    """Qwen's MoE layers as ``model.moe.layer_freq``: 1 when every layer is MoE, else a 0/1 list."""
    step = hf.value("decoder_sparse_step", int, 1)
    if step < 1:
        raise hf.unsupported("decoder_sparse_step", step, "a positive integer is")
    dense = hf.value("mlp_only_layers", list, [])
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        raise hf.unsupported("mlp_only_layers", dense, "a list of layer numbers is")
    dense = set(dense)
    flags = [int(i not in dense and (i + 1) % step == 0) for i in range(num_layers)]
    return 1 if all(flags) else flags


def model_config(hf: HFConfig, name: str) -> ModelConfig:
    llama.check_activation(hf, "hidden_act", "silu", "silu")
    llama.refuse_attention_bias(hf)
    cfg = llama.base_config(hf, name)
    cfg.qk_norm = True
    if hf.value("use_sliding_window", bool, False) and hf.count("sliding_window", None) is not None:
        cfg.sliding_window, cfg.sliding_window_pattern = hf.count("sliding_window"), 1
    experts = hf.count("num_experts", None, least=0) or hf.count("num_local_experts", 128, least=0)
    freq = _layer_freq(hf, cfg.num_layers)
    if experts and (freq == 1 or any(freq)):  # without experts: a dense Qwen3
        cfg.moe = MoEConfig(num_experts=experts, top_k=hf.count("num_experts_per_tok", 8),
                            ffn_hidden_size=hf.count("moe_intermediate_size", 768), layer_freq=freq,
                            router="softmax", norm_topk=hf.value("norm_topk_prob", bool, False),
                            aux_loss_coeff=hf.value("router_aux_loss_coef", float, 0.001))
    return cfg


def compatible(cfg: TransformerConfig) -> str:
    """Why ``cfg`` has no Qwen3-MoE counterpart, or '' when it has one."""
    why = llama.plain(cfg, "Qwen3-MoE") or llama.no_biases(cfg, "Qwen3-MoE")
    if why:
        return why
    if not cfg.qk_norm or cfg.moe is None:
        return "Qwen3-MoE normalises q and k (model.qk_norm=true) and has experts (model.moe)"
    if cfg.window_layers and not features.windowed_everywhere(cfg):
        return "Qwen3-MoE windows every layer or none (model.sliding_window_pattern=1)"
    if cfg.moe.router != "softmax" or cfg.moe.expert_bias_rate or cfg.moe.shared_ffn_hidden_size:
        return "Qwen3-MoE routes by softmax, without expert bias or shared experts"
    return ""


def hf_config(cfg: TransformerConfig) -> dict:
    config = qwen3.hf_config(cfg)
    for key in ("max_window_layers", "layer_types"):
        del config[key]
    moe = cfg.moe
    return {**config, "architectures": ["Qwen3MoeForCausalLM"], "model_type": MODEL_TYPE,
            "num_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
            "moe_intermediate_size": moe.ffn_hidden_size, "norm_topk_prob": moe.norm_topk,
            "router_aux_loss_coef": moe.aux_loss_coeff, "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i in range(cfg.num_layers) if i not in cfg.moe_layers]}
