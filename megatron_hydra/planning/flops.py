"""Model FLOPs (Megatron's accounting): what a training step computes, for throughput and MFU.

Training FLOPs per token are 3x the forward's (forward, and backward at twice the cost), counting
matmuls only: per layer, the QKV, attention-output and MLP projections (2 FLOPs per multiply-add)
and the two attention matmuls over the full sequence (Narayanan et al. 2021 count them unmasked);
plus the LM head. For a plain GPT (ffn = 4h, no GQA) this is the paper's
``72 B s l h^2 (1 + s / (6h) + V / (12 l h))``. Activation recompute is not counted: these are
*model* FLOPs, so MFU does not reward recomputation.

A sliding-window layer (``model.sliding_window`` shorter than the sequence) counts the keys its
queries see: the query at position i sees min(w, i + 1) of them, w(w + 1)/2 + (s - w) w over the
sequence. A window of the whole sequence or more binds nothing, so that layer is global and counted
as one: the same computation counts the same whether or not the key is set. Soft-capping and
QK-norm are elementwise and, like the norms, not counted.

LoRA (frozen weights get no gradient: the backward of their layers is as long as the forward, not
twice) and DPO (the reference model's forward over every sample): ``planning.frozen``.
"""

from __future__ import annotations

from typing import Optional

from megatron_hydra.config.transformer_config import TransformerConfig
from megatron_hydra.planning.frozen import training_flops


def window_keys(seq: int, window: Optional[int]) -> float:
    """Keys per query of one layer's attention over ``seq`` tokens, averaged over the queries, as
    the model FLOPs count them (module docstring): ``seq`` unless a window shorter binds."""
    if window is None or window >= seq:
        return float(seq)
    return (seq * window - window * (window - 1) / 2) / seq


def attention_keys(cfg: TransformerConfig) -> float:
    """``window_keys`` summed over the layers: what the attention matmuls of a token run over."""
    return sum(window_keys(cfg.seq_length, cfg.windowed(layer)) for layer in range(cfg.num_layers))


def model_flops_per_token(cfg: TransformerConfig, reference_forward: bool = False) -> float:
    """A Mixture-of-Experts layer counts what a token runs through: its router, its ``top_k``
    experts and the shared expert, in place of the dense MLP. LoRA and DPO's reference forward
    (``reference_forward``): ``planning.frozen.training_flops``."""
    h, d = cfg.hidden_size, cfg.kv_channels
    qkv = 2 * h * (cfg.num_attention_heads + 2 * cfg.num_query_groups) * d
    proj = 2 * cfg.num_attention_heads * d * h
    matrices = 3 if cfg.activation in ("swiglu", "geglu") else 2
    mlp = 2 * h * cfg.ffn_hidden_size * matrices
    attention = 2 * 2 * cfg.num_attention_heads * d * attention_keys(cfg)
    head = 2 * h * cfg.padded_vocab_size
    linear = cfg.num_layers * (qkv + proj + mlp)
    moe = cfg.moe
    if moe is not None:
        routed = 2 * h * (moe.num_experts + (moe.top_k * moe.ffn_hidden_size + moe.shared_ffn_hidden_size) * matrices)
        linear += len(cfg.moe_layers) * (routed - mlp)
    return training_flops(cfg, linear, attention, head, reference_forward)


def t5_flops_per_sample(cfg: TransformerConfig) -> float:
    """T5 by the same accounting: encoder layers over ``seq_length`` tokens; decoder layers over
    ``decoder_seq_length`` tokens with cross-attention (its keys and values projected once per
    encoder token); the head over the decoder tokens."""
    h, d, heads, s, t = cfg.hidden_size, cfg.kv_channels, cfg.num_attention_heads, cfg.seq_length, cfg.decoder_seq_length
    q, kv, proj = 2 * h * heads * d, 2 * h * 2 * cfg.num_query_groups * d, 2 * heads * d * h
    mlp = 2 * h * cfg.ffn_hidden_size * (3 if cfg.activation in ("swiglu", "geglu") else 2)
    encoder = cfg.num_layers * s * (q + kv + proj + mlp + 4 * s * heads * d)
    decoder = cfg.num_decoder_layers * (t * (2 * q + kv + 2 * proj + mlp + 4 * (t + s) * heads * d) + s * kv)
    return 3.0 * (encoder + decoder + 2 * h * cfg.padded_vocab_size * t)


def loss_tokens(cfg: TransformerConfig) -> int:
    """Tokens per sample the LM head and the loss run over: T5's decoder tokens, else the sequence."""
    return cfg.decoder_seq_length if cfg.arch == "t5" else cfg.seq_length


def model_flops_per_step(cfg: TransformerConfig, global_batch_size: int, reference_forward: bool = False) -> float:
    """BERT counts as GPT (its masked-LM head's extra dense layer is under 1% at published shapes).
    ``reference_forward``: ``objective=dpo``'s reference model runs forward over the batch too."""
    if cfg.arch == "t5":
        return t5_flops_per_sample(cfg) * global_batch_size
    return model_flops_per_token(cfg, reference_forward) * global_batch_size * cfg.seq_length
