"""The one config object model code sees: concrete numbers only, nothing left to derive.

A field named as a key of the schema's node (``model.*``, ``model.moe.*``, ``precision.fp8.*``)
holds that key's value, copied by name (``by_name``): a key added to both reaches the model with no
line written for it. ``config.derive`` sets the other fields, and overrides the keys the model
sees only resolved (``num_query_groups``, ``ffn_hidden_size``, ...).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch


def by_name(node: Any, schema: type, target: type) -> Dict[str, Any]:
    """The values of ``node`` (an instance or an OmegaConf node of dataclass ``schema``) whose
    field names ``target`` shares."""
    wanted = {f.name for f in dataclasses.fields(target)}
    return {f.name: getattr(node, f.name) for f in dataclasses.fields(schema) if f.name in wanted}


@dataclass(frozen=True)
class FP8Recipe:
    """``precision.fp8`` as the model sees it (``config.schema.FP8Config``, frozen)."""

    recipe: str = "delayed"  # delayed | current
    format: str = "hybrid"  # hybrid | e4m3
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    margin: int = 0


@dataclass(frozen=True)
class RopeScaling:
    """``model.rope_scaling`` as the model sees it (``config.schema.RopeScalingConfig``, frozen)."""

    type: str = "llama3"  # llama3 | linear | yarn
    factor: float = 8.0
    original_max_position_embeddings: int = 8192
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: Optional[float] = None
    truncate: bool = True


@dataclass(frozen=True)
class MoESpec:
    """A Mixture-of-Experts MLP (``models.moe.MoELayer``) in place of the dense one."""

    num_experts: int
    ffn_hidden_size: int  # of each routed expert
    top_k: int = 2
    # softmax: top-k of the softmax over all experts (GShard, Mixtral); sigmoid: top-k of sigmoid
    # scores (DeepSeek-V3). norm_topk: the k weights renormalised to sum 1.
    router: str = "softmax"
    norm_topk: bool = True
    aux_loss_coeff: float = 0.0  # load-balancing loss (Switch/GShard)
    z_loss_coeff: float = 0.0  # router z-loss (ST-MoE)
    # Auxiliary-loss-free balancing (DeepSeek-V3): per-expert selection bias, moved by this much
    # per step towards the mean load. 0: the bias stays zero.
    expert_bias_rate: float = 0.0
    # None: dropless. Else each expert takes at most ceil(factor * tokens * top_k / num_experts)
    # of a rank's tokens, those with the highest routing weight.
    capacity_factor: Optional[float] = None
    shared_ffn_hidden_size: int = 0  # a dense MLP every token goes through too (0: none)


# The layers LoRA adapts, by our names (``models.lora``): attention's fused QKV and output
# projection, the dense MLP's fc1, gate (gated activations) and fc2.
LORA_TARGETS = ("qkv", "proj", "fc1", "gate", "fc2")


@dataclass(frozen=True)
class LoRASpec:
    """Low-rank adapters on the linear layers named by ``targets`` (``models.lora``), ``peft=lora``."""

    rank: int
    alpha: float
    dropout: float = 0.0
    targets: Tuple[str, ...] = LORA_TARGETS
    rslora: bool = False

    @property
    def scale(self) -> float:
        """The factor on the adapter's output: alpha / rank, or alpha / sqrt(rank) (rslora)."""
        return self.alpha / (self.rank ** 0.5 if self.rslora else self.rank)


@dataclass(frozen=True)
class TransformerConfig:
    num_layers: int  # T5: encoder layers
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    ffn_hidden_size: int
    seq_length: int
    max_position_embeddings: int
    vocab_size: int  # the tokenizer's vocabulary
    padded_vocab_size: int  # a multiple of make_vocab_size_divisible_by * tp
    position_embedding: str = "learned"
    rope_theta: float = 10000.0
    rope_scaling: Optional[RopeScaling] = None
    local_rope_theta: Optional[float] = None  # the windowed layers' RoPE base, unscaled (None: as the rest)
    normalization: str = "layernorm"
    norm_eps: float = 1e-5
    zero_centered_gamma: bool = False  # norms scale by (1 + w)
    post_sublayer_norm: bool = False  # x + norm_out(f(norm_in(x)))
    scale_embeddings: bool = False  # word embeddings times sqrt(hidden_size)
    activation: str = "gelu"
    add_bias_linear: bool = True
    qkv_bias: Optional[bool] = None  # bias on the QKV projection; None: as add_bias_linear
    qk_norm: bool = False  # RMSNorm over each head's q and k before RoPE
    # Sliding-window attention: a query sees itself and the sliding_window-1 tokens before it, in
    # the (global) layers window_layers; None: no layer is windowed.
    sliding_window: Optional[int] = None
    window_layers: Tuple[int, ...] = ()
    attn_logit_softcapping: Optional[float] = None  # scores -> cap * tanh(scores / cap), after scaling
    final_logit_softcapping: Optional[float] = None  # logits -> cap * tanh(logits / cap)
    tie_embeddings: bool = True
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    init_std: float = 0.02
    sequence_parallel: bool = False
    # Under sequence parallelism, the column/row layers' all-gather and reduce-scatter as rings
    # overlapped with partial matmuls (parallel.collective_matmul); parallel.tp_comm_overlap.
    tp_comm_overlap: bool = False
    # Context parallelism (parallel.context_parallel): each sequence split over this many ranks;
    # how attention exchanges keys and values among them: p2p (ring) | a2a (Ulysses).
    context_parallel_size: int = 1
    cp_comm_type: str = "p2p"
    params_dtype: torch.dtype = torch.float32
    arch: str = "gpt"  # gpt | bert | t5: the family (models.archs) that reads this config
    # None -> 1/sqrt(kv_channels). T5 uses 1: its initialisation folds the scale into the weights;
    # model.query_pre_attn_scalar q sets it to 1/sqrt(q) (Gemma).
    softmax_scale: Optional[float] = None
    # BERT: token-type (segment) vocabulary and the sentence-order head.
    num_tokentypes: int = 2
    binary_head: bool = False
    # T5: decoder depth and length, relative position buckets.
    num_decoder_layers: int = 0
    decoder_seq_length: int = 0
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    # Activation recomputation (parallel.recompute): None | full | selective; for full, uniform
    # chunks of recompute_num_layers layers, or block: the first recompute_num_layers of a stage.
    recompute_granularity: Optional[str] = None
    recompute_method: str = "uniform"
    recompute_num_layers: int = 1
    # local | transformer_engine (models.backends); FP8 matmuls (Transformer Engine only) or None.
    transformer_impl: str = "local"
    fp8: Optional[FP8Recipe] = None
    # Mixture of Experts: the experts of every MoE layer, and which (global) layers are MoE.
    moe: Optional[MoESpec] = None
    moe_layers: Tuple[int, ...] = ()
    # Low-rank adapters (peft=lora): every other weight is frozen; None: no adapters.
    lora: Optional[LoRASpec] = None

    def __post_init__(self):
        if self.qkv_bias is None:  # a config built by hand (tests, benchmarks) keeps one bias switch
            object.__setattr__(self, "qkv_bias", self.add_bias_linear)

    def windowed(self, layer: int) -> Optional[int]:
        """The sliding window of global layer ``layer``, or None when it attends to the whole prefix."""
        return self.sliding_window if layer in self.window_layers else None

    @property
    def output_init_std(self) -> float:
        """Megatron scales the init of the projections that write into the residual stream by
        1/sqrt(2 * layers), so the residual's variance does not grow with depth."""
        return self.init_std / (2.0 * self.num_layers) ** 0.5
