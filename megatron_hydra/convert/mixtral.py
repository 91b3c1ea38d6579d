"""Mixtral family (``MixtralForCausalLM``) <-> our GPT with an MoE MLP in every layer.

- Attention, norms, embeddings and head are Llama's (``llama.BLOCK_RULES``, same names).
- The MLP of every layer is ``block_sparse_moe``: ``gate`` is the router [E, h]; expert e's
  ``w1`` is the gate projection, ``w3`` the up projection, ``w2`` the down projection
  (``w2(silu(w1(x)) * w3(x))``; ours is ``fc2(silu(gate(x)) * fc1(x))``). These are the names of
  the files on the Hub and of what ``save_pretrained`` writes; ``transformers`` 5 fuses the experts
  in memory (``mlp.experts.gate_up_proj``) and converts on load and save.
- Routing: softmax over all expert logits, top-k, the k weights renormalised to sum 1: our
  ``router=softmax, norm_topk=true``. ``router_jitter_noise`` acts in training only (ours has none).
- Sliding-window attention (``sliding_window`` set) is refused.
"""

from __future__ import annotations

import dataclasses

from megatron_hydra.config.schema import ModelConfig, MoEConfig
from megatron_hydra.config.transformer_config import TransformerConfig
from megatron_hydra.convert import llama
from megatron_hydra.convert.llama import LAYERS, L, M
from megatron_hydra.convert.mapping import HFConfig
from megatron_hydra.convert.name_map import NameMap, Rule
from megatron_hydra.errors import ConfigError

MODEL_TYPE, ARCH = "mixtral", "gpt"  # Hugging Face's model_type; our model.arch
EXPRESSES = (*llama.EXPRESSES, "moe")
E, X = L + "mlp.experts.{e}.", M + "block_sparse_moe.experts.{e}."
NAME_MAP = NameMap(
    MODEL_TYPE,
    rules=(
        *llama.BLOCK_RULES,
        Rule(L + "mlp.router.weight", M + "block_sparse_moe.gate.weight", per=LAYERS),
        Rule(E + "gate.weight", X + "w1.weight", per=LAYERS),
        Rule(E + "fc1.weight", X + "w3.weight", per=LAYERS),
        Rule(E + "fc2.weight", X + "w2.weight", per=LAYERS),
    ),
    ignored=llama.IGNORED,
)


def model_config(hf: HFConfig, name: str) -> ModelConfig:
    window = hf.value("sliding_window", int, None)
    if window is not None:
        raise ConfigError(f"{hf.path}: Mixtral sliding_window={window} is not supported: only sliding_window=null "
                          "converts")
    llama.check_activation(hf, "hidden_act", "silu", "silu")
    cfg = llama.base_config(hf, name, rope_theta=1e6, norm_eps=1e-5)
    moe = MoEConfig(num_experts=hf.count("num_local_experts", 8), top_k=hf.count("num_experts_per_tok", 2),
                    ffn_hidden_size=cfg.ffn_hidden_size, layer_freq=1, router="softmax", norm_topk=True,
                    aux_loss_coeff=hf.value("router_aux_loss_coef", float, 0.001))
    return dataclasses.replace(cfg, moe=moe)


def compatible(cfg: TransformerConfig) -> str:
    """Why ``cfg`` has no Mixtral counterpart, or '' when it has one."""
    why = llama.plain(cfg, "Mixtral")
    if why:
        return why
    moe = cfg.moe
    if moe is None or len(cfg.moe_layers) != cfg.num_layers:
        return "Mixtral needs experts (model.moe) in every layer"
    if (moe.router != "softmax" or not moe.norm_topk or moe.expert_bias_rate or moe.shared_ffn_hidden_size
            or cfg.add_bias_linear):
        return "Mixtral routes by softmax with norm_topk, without expert bias, shared experts or biases"
    return ""


def hf_config(cfg: TransformerConfig) -> dict:
    config = llama.hf_config(cfg)
    for key in ("attention_bias", "mlp_bias"):
        del config[key]
    return {**config, "architectures": ["MixtralForCausalLM"], "model_type": MODEL_TYPE,
            "intermediate_size": cfg.moe.ffn_hidden_size, "num_local_experts": cfg.moe.num_experts,
            "num_experts_per_tok": cfg.moe.top_k, "router_aux_loss_coef": cfg.moe.aux_loss_coeff,
            "sliding_window": None}
